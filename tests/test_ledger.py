"""The paid-call ledger: usage and cost recorded per model step, savings on resume."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from asiento import (
    Agent,
    MemoryCheckpointer,
    ModelResponse,
    Price,
    Session,
    SqliteCheckpointer,
    Tool,
    ToolCall,
    Usage,
    UsageError,
    tool,
)
from asiento.events import Phase
from asiento.ledger import cost_of, price_for
from asiento.testing import ScriptedGateway

PRICES = {"gpt-x": Price(2.0, 8.0), "gpt-x-mini": Price(0.5, 1.0)}
SCRIPT = [
    ModelResponse(
        tool_calls=[ToolCall(name="crash", arguments={})],
        usage=Usage(input_tokens=1000, output_tokens=100),
        model="gpt-x-2026-01-01",
    ),
    ModelResponse(text="done", usage=Usage(input_tokens=2000, output_tokens=50), model="gpt-x"),
]


def crashing_once() -> Tool:
    """A tool that kills its pass the first time (``Boom`` passes through the loop), then
    answers: the next pass resumes after a crash inside a tool step."""
    crashes = [True]

    @tool(idempotent=True)
    def crash() -> str:
        """Die once, then answer."""
        if crashes.pop() if crashes else False:
            raise Boom
        return "ok"

    return crash


class Boom(BaseException):
    """Stands for the process dying inside the tool."""


def test_price_for_takes_the_longest_prefix() -> None:
    """A dated snapshot is priced by the longest model name it starts with."""
    assert price_for("gpt-x-mini-2026", PRICES) == Price(0.5, 1.0)
    assert price_for("gpt-x-2026", PRICES) == Price(2.0, 8.0)
    assert price_for("claude", PRICES) is None
    assert cost_of(Usage(input_tokens=1_000_000, output_tokens=0), "gpt-x", PRICES) == 2.0
    with pytest.raises(UsageError):
        Price(-1.0, 0.0)


async def test_usage_and_cost_are_recorded_and_resume_reports_the_savings(tmp_path: Path) -> None:
    """Each model step records tokens and cost; a resumed pass reports what it did not pay."""
    crash = crashing_once()

    agent = Agent(tools=[crash])
    store = SqliteCheckpointer(tmp_path / "runs.db")
    first = Session("r", ScriptedGateway(SCRIPT), store, prices=PRICES)
    with pytest.raises(Boom):
        async for _ in agent.run("t", session=first):
            pass
    m1 = next(e for e in await store.load_step("r", "m1") if e.phase == Phase.RESULT)
    assert m1.payload["response"]["usage"] == [1000, 100]
    assert m1.payload["cost"] == pytest.approx((1000 * 2.0 + 100 * 8.0) / 1e6)
    assert first.stats.cost == pytest.approx(0.0028)

    second = Session(
        "r", ScriptedGateway(SCRIPT), SqliteCheckpointer(tmp_path / "runs.db"), prices=PRICES
    )
    async for _ in agent.run("t", session=second):
        pass
    assert second.stats.model_calls == 1
    assert second.stats.model_calls_replayed == 1
    assert second.stats.input_tokens_saved == 1000
    assert second.stats.cost_saved == pytest.approx(0.0028)
    [info] = await store.runs()
    assert (info.model_calls, info.input_tokens, info.output_tokens) == (2, 3000, 150)
    assert info.cost == pytest.approx(0.0028 + (2000 * 2.0 + 50 * 8.0) / 1e6)
    assert (info.replayed_calls, info.saved_input_tokens, info.saved_output_tokens) == (
        1,
        1000,
        100,
    )
    assert info.saved_cost == pytest.approx(0.0028)


def test_cache_reads_and_writes_are_charged_at_their_own_prices() -> None:
    """Uncached input, cache reads, cache writes and output each cost their own price."""
    usage = Usage(
        input_tokens=1_000_000,
        output_tokens=100_000,
        cached_input_tokens=600_000,
        cache_write_tokens=200_000,
    )
    cached = {"m": Price(3.0, 15.0, cached_input_per_mtok=0.3, cache_write_per_mtok=3.75)}
    assert cost_of(usage, "m", cached) == pytest.approx(0.6 + 0.18 + 0.75 + 1.5)
    assert cost_of(usage, "m", {"m": Price(3.0, 15.0)}) == pytest.approx(3.0 + 1.5)
    reads_only = {"m": Price(3.0, 15.0, cached_input_per_mtok=0.3)}
    assert cost_of(usage, "m", reads_only) == pytest.approx(0.6 + 0.18 + 0.6 + 1.5)
    assert Usage(input_tokens=1, output_tokens=2).cached_input_tokens == 0
    for bad in ({"cached_input_per_mtok": -0.1}, {"cache_write_per_mtok": -1.0}):
        with pytest.raises(UsageError, match="negative"):
            Price(3.0, 15.0, **bad)


async def test_a_record_written_before_cache_figures_still_replays(tmp_path: Path) -> None:
    """A model result with the old two-number usage replays with 0 cached tokens and its savings."""
    cached = Usage(input_tokens=1000, output_tokens=100, cached_input_tokens=800)
    script = [
        ModelResponse(tool_calls=SCRIPT[0].tool_calls, usage=cached, model="gpt-x"),
        SCRIPT[1],
    ]
    crash = crashing_once()

    agent, first = Agent(tools=[crash]), SqliteCheckpointer(tmp_path / "runs.db")
    with pytest.raises(Boom):
        async for _ in agent.run("t", session=Session("r", ScriptedGateway(script), first)):
            pass
    await first.close()
    db = tmp_path / "runs.db"
    old = _as_written_before(db, cost=0.0028)
    assert old["response"]["usage"] == [1000, 100]
    assert ModelResponse.from_json(old["response"]).usage == Usage(
        input_tokens=1000, output_tokens=100
    )
    store = SqliteCheckpointer(db)
    second = Session("r", ScriptedGateway(script), store, prices=PRICES)
    async for _ in agent.run("t", session=second):
        pass
    assert (second.stats.model_calls, second.stats.model_calls_replayed) == (1, 1)
    assert (second.stats.input_tokens_saved, second.stats.output_tokens_saved) == (1000, 100)
    assert second.stats.cost_saved == pytest.approx(0.0028)
    [info] = await store.runs()
    assert (info.saved_input_tokens, info.saved_output_tokens) == (1000, 100)
    await store.close()


M1_RESULT = "WHERE run_id = 'r' AND step_id = 'm1' AND phase = 'result'"


def _as_written_before(db: Path, *, cost: float) -> dict:
    """Rewrite m1's result the way journals held it before cache figures: two numbers, no cache."""
    conn = sqlite3.connect(db)
    try:
        with conn:
            (raw,) = conn.execute(f"SELECT payload FROM journal {M1_RESULT}").fetchone()
            payload = json.loads(raw)
            assert payload["response"].pop("cache") == [800, 0]
            payload["cost"] = cost
            conn.execute(f"UPDATE journal SET payload = ? {M1_RESULT}", (json.dumps(payload),))
    finally:
        conn.close()
    return payload


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_the_run_index_totals_prompt_cache_tokens(tmp_path: Path, backend: str) -> None:
    """Each paid call's cache reads and writes add up in the run index, as its tokens do."""
    reads = Usage(input_tokens=1000, output_tokens=100, cached_input_tokens=800)
    writes = Usage(input_tokens=500, output_tokens=50, cache_write_tokens=450)
    script = [
        ModelResponse(tool_calls=SCRIPT[0].tool_calls, usage=reads, model="gpt-x"),
        ModelResponse(text="done", usage=writes, model="gpt-x"),
    ]

    @tool(idempotent=True, name="crash")  # the tool SCRIPT's first answer asks for
    def answer() -> str:
        """Answer."""
        return "ok"

    store = MemoryCheckpointer() if backend == "memory" else SqliteCheckpointer(tmp_path / "r.db")
    async for _ in Agent(tools=[answer]).run(
        "t", session=Session("r", ScriptedGateway(script), store)
    ):
        pass
    [info] = await store.runs()
    assert (info.input_tokens, info.cached_input_tokens, info.cache_write_tokens) == (
        1500,
        800,
        450,
    )
