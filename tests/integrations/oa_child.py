"""One pass of a refund agent written with the OpenAI Agents SDK, run durably by asiento.

Run as a script by the crash tests (arm ``ASIENTO_CRASH_AT`` to have it kill itself):

    python oa_child.py DB RUN_ID BASE_URL TOOL_LOG [idempotent] [spans=FILE]

The agent is the SDK's own ``Agent`` with ``OpenAIChatCompletionsModel`` on the
official ``AsyncOpenAI`` client; each real run of the ``refund`` tool appends a line
to TOOL_LOG, so a test counts the effects across processes. With ``spans=FILE`` the
run is traced (``telemetry=``): each span one fsynced JSON line of FILE as it ends, so
what a killed pass exported outlives it. The outcome is one JSON line on stdout.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"

import openai
from agents import Agent, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled

from asiento import SqliteCheckpointer, UncertainEffect
from asiento.integrations.openai_agents import durable_run

TASK = "refund order 42"


def build_agent(
    client: openai.AsyncOpenAI,
    tool_log: Path,
    *,
    instructions: str = "You refund orders.",
    more_tools: tuple[Any, ...] = (),
) -> Agent[Any]:
    """The agent a resumed process rebuilds, the same every time."""

    @function_tool
    def refund(order: int, amount: float) -> str:
        """Refund an order.

        Args:
            order: the order number.
            amount: how much to give back.
        """
        with tool_log.open("a") as log:
            log.write(json.dumps({"order": order, "amount": amount}) + "\n")
        return f"refunded {amount} on order {order}"

    model = OpenAIChatCompletionsModel(model="gpt-test", openai_client=client)
    return Agent(
        name="refunds", instructions=instructions, model=model, tools=[refund, *more_tools]
    )


async def main(db: str, run_id: str, base_url: str, tool_log: str, *flags: str) -> dict[str, Any]:
    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(api_key="sk-test", base_url=base_url, max_retries=0)
    agent = build_agent(client, Path(tool_log))
    store = SqliteCheckpointer(db)
    idempotent = {"refund"} if "idempotent" in flags else set()
    try:
        result = await durable_run(
            agent,
            TASK,
            run_id=run_id,
            store=store,
            idempotent_tools=idempotent,
            telemetry=_telemetry(flags),
        )
    except UncertainEffect as exc:
        return {"ended": "uncertain", "step": exc.step_id}
    finally:
        await store.close()
        await client.close()
    return {"ended": "closed", "output": result.final_output, "replayed": result.replayed}


def _telemetry(flags: tuple[str, ...]) -> Any:
    """Tracing to the file a ``spans=FILE`` flag names, a JSON line per span (else None)."""
    spans = next((f.removeprefix("spans=") for f in flags if f.startswith("spans=")), None)
    if spans is None:
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult

    from asiento import Telemetry
    from asiento.testing._files import append_line

    class Lines:
        def export(self, batch: Any) -> SpanExportResult:
            for span in batch:
                append_line(spans, json.loads(span.to_json(indent=None)))
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            return None

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Lines()))  # type: ignore[arg-type]
    return Telemetry(tracer_provider=provider)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:]))), flush=True)
