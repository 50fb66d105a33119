"""The traced crash-test child: drive one pass of a traced run on a SQLite file and exit.

    python tests/telemetry/trace_child.py DB RUN_ID --effects FILE --models FILE --spans FILE

Arm a crash point with ``ASIENTO_CRASH_AT=name@N``: the child SIGKILLs itself there.

Three files outlive any SIGKILL, because every line is one ``write(2)`` followed by
``fsync`` before the code goes on (asiento.testing's ledgers):

- the effects ledger: one line per tool execution (the effect applied);
- the model ledger: one ``asked`` line per model request (a generation billed), then
  one ``answered`` line when the gateway's answer came back to the pass;
- the spans file: one JSON span per line, as the SDK's ``ReadableSpan.to_json`` writes
  it, exported synchronously (``SimpleSpanProcessor``) when the span ends.

The scripted model asks, in m1, for ``lookup`` (idempotent) then ``send`` (not
idempotent); in m2 for ``lookup`` again; m3 answers "done". Exit code 0 once the run
is closed; the outcome is one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from asiento import (
    Agent,
    FinalStep,
    ModelRequest,
    ModelResponse,
    Session,
    SqliteCheckpointer,
    ToolCall,
    tool,
)
from asiento.telemetry import tracing
from asiento.testing import ScriptedGateway
from asiento.testing._files import append_line

AGENT = "ledger-agent"
MODEL = "scripted-1"
TASK = "look alpha up, send it to x, then look beta up"
SCRIPT = (
    ModelResponse(
        text="",
        tool_calls=[
            ToolCall(name="lookup", arguments={"key": "alpha"}),
            ToolCall(name="send", arguments={"to": "x"}),
        ],
        model=MODEL,
    ),
    ModelResponse(text="", tool_calls=[ToolCall(name="lookup", arguments={"key": "beta"})]),
    ModelResponse(text="done", model=MODEL),
)


class LedgerExporter(SpanExporter):
    """Appends each span as one JSON line, fsynced before the pass goes on."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            append_line(self.path, json.loads(span.to_json(indent=None)))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class LedgerGateway:
    """ScriptedGateway that notes each request (billed) and each answer it returns."""

    model = MODEL

    def __init__(self, models: str) -> None:
        self.models = models
        self.inner = ScriptedGateway(SCRIPT)

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        line = {"key": idempotency_key, "pid": os.getpid()}
        append_line(self.models, {**line, "event": "asked"})
        answer = await self.inner.complete(request, idempotency_key=idempotency_key)
        append_line(self.models, {**line, "event": "answered"})
        return answer


def make_tools(effects: str) -> list[object]:
    @tool(idempotent=True)
    def lookup(key: str) -> str:
        """Look a key up; safe to repeat."""
        append_line(effects, {"tool": "lookup", "key": key, "pid": os.getpid()})
        return f"value-of-{key}"

    @tool
    def send(to: str) -> str:
        """Send a message; not safe to repeat."""
        append_line(effects, {"tool": "send", "to": to, "pid": os.getpid()})
        return f"sent-to-{to}"

    return [lookup, send]


async def run_pass(args: argparse.Namespace) -> dict[str, object]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(LedgerExporter(args.spans)))
    agent = Agent(
        instructions="You are a traced crash-test agent.",
        tools=make_tools(args.effects),  # type: ignore[arg-type]
        name=AGENT,
        telemetry=tracing.Telemetry(tracer_provider=provider),
    )
    store = SqliteCheckpointer(args.db)
    session = Session(args.run, LedgerGateway(args.models), store)
    last = None
    try:
        async for step in agent.run(TASK, session=session):
            last = step
    finally:
        await store.close()
        provider.shutdown()
    if not isinstance(last, FinalStep):
        raise RuntimeError(f"the pass ended on {last!r}")
    return {"outcome": "closed", "replayed": last.replayed}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trace_child.py")
    parser.add_argument("db")
    parser.add_argument("run")
    for name in ("--effects", "--models", "--spans"):
        parser.add_argument(name, required=True)
    out = asyncio.run(run_pass(parser.parse_args(argv)))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
