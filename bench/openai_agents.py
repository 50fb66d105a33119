"""What durability costs an OpenAI Agents SDK run: ``durable_run`` against ``Runner.run``.

One process, one workload: an agent whose scripted model asks for one function
tool per turn for ``--turns`` turns, then answers. The model is an in-process
``agents.Model`` (no HTTP), so the difference is asiento's work alone: the journal
on a real SQLite file (its fsyncs included), the wrapping, the fingerprints. Prints
milliseconds per run and per model+tool step for both, and the overhead per step.
Figures, never pass/fail.

    python bench/openai_agents.py [--runs 20] [--turns 10] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"

from agents import (
    Agent,
    Model,
    ModelResponse,
    RunConfig,
    Runner,
    Usage,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from asiento import SqliteCheckpointer
from asiento.integrations.openai_agents import durable_run


class _Scripted(Model):
    """Asks for ``lookup`` on each of ``turns`` turns, then answers: no network."""

    def __init__(self, turns: int) -> None:
        self.turns = turns

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        items = args[1] if len(args) > 1 else kwargs["input"]
        done = sum(1 for i in items if isinstance(i, dict) and i.get("type") == "function_call")
        usage = Usage(requests=1, input_tokens=100, output_tokens=10, total_tokens=110)
        if done < self.turns:
            call = ResponseFunctionToolCall(
                type="function_call", call_id=f"c{done}", name="lookup",
                arguments=f'{{"n": {done}}}', id=f"fc{done}",
            )  # fmt: skip
            return ModelResponse(output=[call], usage=usage, response_id=None)
        text = ResponseOutputText(type="output_text", text="done", annotations=[])
        message = ResponseOutputMessage(
            type="message", id="m", role="assistant", status="completed", content=[text]
        )
        return ModelResponse(output=[message], usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


@function_tool
def lookup(n: int) -> str:
    """Look a number up."""
    return f"value {n}"


def _agent(turns: int) -> Agent[Any]:
    return Agent(name="bench", model=_Scripted(turns), tools=[lookup])


async def _plain(turns: int) -> float:
    start = time.perf_counter()
    config = RunConfig(tracing_disabled=True)
    await Runner.run(_agent(turns), "go", max_turns=turns + 2, run_config=config)
    return time.perf_counter() - start


async def _durable(turns: int, store: SqliteCheckpointer, run_id: str) -> float:
    start = time.perf_counter()
    await durable_run(_agent(turns), "go", run_id=run_id, store=store, max_turns=turns + 2)
    return time.perf_counter() - start


async def main(runs: int, turns: int, where: Path) -> None:
    set_tracing_disabled(True)
    store = SqliteCheckpointer(where / "bench.db")
    try:
        await _plain(turns)  # warm both paths up
        await _durable(turns, store, "warm")
        plain = [await _plain(turns) for _ in range(runs)]
        durable = [await _durable(turns, store, f"run-{i}") for i in range(runs)]
        replayed = [await _durable(turns, store, f"run-{i}") for i in range(runs)]
    finally:
        await store.close()
    p, d, r = (statistics.median(x) * 1000 for x in (plain, durable, replayed))
    steps = turns  # model+tool steps per run (plus one final model step)
    print(f"{runs} runs of {turns} model+tool steps, SQLite at full durability; median ms")
    print(f"{'':<22}{'per run':>10}{'per step':>10}")
    print(f"{'Runner.run':<22}{p:>10.2f}{p / (steps + 1):>10.3f}")
    print(f"{'durable_run':<22}{d:>10.2f}{d / (steps + 1):>10.3f}")
    print(f"{'closed run (replay)':<22}{r:>10.2f}")
    print(f"overhead per model+tool step: {(d - p) / steps:.3f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--dir", type=Path, default=None)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(ns.runs, ns.turns, ns.dir or Path(tmp)))
