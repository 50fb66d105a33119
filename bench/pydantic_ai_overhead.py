"""What durability costs a Pydantic AI run: ``durable_run`` against ``agent.run``, in one run.

    python bench/pydantic_ai_overhead.py [--runs 200] [--dir DIR] [--quick]

The agent is a plain ``pydantic_ai.Agent`` whose model is Pydantic AI's in-process
``FunctionModel`` (no network: what is measured is the framework and asiento, not a
provider): it asks for one tool call, then answers, so each run has three steps
(m1, m1.t1, m2). The two modes run in alternating blocks in one process, on the same
machine state; asiento's mode writes each run to a fresh run id in an SQLite file
(full durability: every commit fsynced). Times are medians per run; the overhead
per step is the difference divided by the three steps.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from asiento import SqliteCheckpointer
from asiento.integrations.pydantic_ai import durable_run

STEPS = 3


def _answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    returned = any(isinstance(p, ToolReturnPart) for m in messages for p in m.parts)
    if returned:
        return ModelResponse(parts=[TextPart("refunded A1")])
    return ModelResponse(parts=[ToolCallPart("refund", {"order": "A1"}, tool_call_id="c1")])


def _agent() -> Agent[None, str]:
    agent = Agent(FunctionModel(_answer), instructions="Refund what you are asked to.")

    @agent.tool_plain
    def refund(order: str) -> str:
        """Refund an order."""
        return f"refunded {order}"

    return agent


async def _measure(runs: int, folder: Path) -> dict[str, list[float]]:
    agent = _agent()
    store = SqliteCheckpointer(folder / "runs.db")
    times: dict[str, list[float]] = {"pydantic-ai": [], "asiento": []}
    block = max(1, runs // 10)
    n = 0
    try:
        while n < runs:
            for _ in range(block):
                start = time.perf_counter()
                await agent.run("refund A1")
                times["pydantic-ai"].append(time.perf_counter() - start)
            for _ in range(block):
                n += 1
                start = time.perf_counter()
                result = await durable_run(agent, "refund A1", run_id=f"run-{n}", store=store)
                times["asiento"].append(time.perf_counter() - start)
                if (result.stats.model_calls, result.stats.tool_calls) != (2, 1):
                    raise SystemExit(f"run-{n} did not make 2 model calls and 1 tool call")
        records = len(await store.load("run-1"))
    finally:
        await store.close()
    times["records"] = [float(records)]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="20 runs, for the smoke test")
    args = parser.parse_args()
    runs = 20 if args.quick else args.runs
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        times: dict[str, Any] = asyncio.run(_measure(runs, Path(tmp)))
    plain = statistics.median(times["pydantic-ai"]) * 1000
    durable = statistics.median(times["asiento"]) * 1000
    print(f"{'mode':<14}{'runs':>6}{'ms/run':>10}{'steps/run':>11}{'records/run':>13}")
    print(f"{'pydantic-ai':<14}{len(times['pydantic-ai']):>6}{plain:>10.2f}{STEPS:>11}{'-':>13}")
    records = int(times["records"][0])
    print(f"{'asiento':<14}{len(times['asiento']):>6}{durable:>10.2f}{STEPS:>11}{records:>13}")
    print(f"overhead per step: {(durable - plain) / STEPS:.2f} ms (medians, SQLite, fsync on)")


if __name__ == "__main__":
    main()
