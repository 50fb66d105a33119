"""Payload sizes: large results are kept, results over the limit are a recorded failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from asiento import (
    Agent,
    JournalFull,
    ModelResponse,
    RecordTooLarge,
    Session,
    SqliteCheckpointer,
    StepEvent,
    ToolCall,
    tool,
)
from asiento.events import Phase
from asiento.journal.base import MAX_RECORD_BYTES
from asiento.testing import ScriptedGateway

SCRIPT = [ModelResponse(tool_calls=[ToolCall(name="big", arguments={})]), ModelResponse(text="ok")]


def agent_returning(size: int, calls: list[int]) -> Agent:
    @tool(idempotent=False)
    def big() -> str:
        """Return a large text."""
        calls.append(size)
        return "x" * size

    return Agent(tools=[big])


async def run_once(agent: Agent, store: SqliteCheckpointer) -> None:
    async for _ in agent.run("t", session=Session("r", ScriptedGateway(SCRIPT), store)):
        pass


async def test_ten_megabyte_result_is_recorded_and_replayed(tmp_path: Path) -> None:
    """A 10 MB tool result is recorded whole and replayed without running the tool again."""
    calls: list[int] = []
    store = SqliteCheckpointer(tmp_path / "runs.db")
    await run_once(agent_returning(10 * 1024 * 1024, calls), store)
    result = next(e for e in await store.load_step("r", "m1.t1") if e.phase == Phase.RESULT)
    assert result.payload["status"] == "ok"
    assert len(result.payload["value"]) == 10 * 1024 * 1024
    again = SqliteCheckpointer(tmp_path / "runs.db")
    await run_once(agent_returning(10 * 1024 * 1024, calls), again)
    assert calls == [10 * 1024 * 1024]


async def test_result_over_the_limit_is_a_recorded_failure(tmp_path: Path) -> None:
    """A result over the record limit is a recorded error of its step; the tool ran once."""
    calls: list[int] = []
    store = SqliteCheckpointer(tmp_path / "runs.db")
    await run_once(agent_returning(MAX_RECORD_BYTES + 10, calls), store)
    result = next(e for e in await store.load_step("r", "m1.t1") if e.phase == Phase.RESULT)
    assert result.payload["status"] == "error"
    assert "limit" in result.payload["error"]
    await run_once(agent_returning(MAX_RECORD_BYTES + 10, calls), store)
    assert len(calls) == 1


async def test_oversized_record_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    """append() refuses a payload over the limit with RecordTooLarge, writing nothing."""
    store = SqliteCheckpointer(tmp_path / "runs.db")
    ok = StepEvent(run_id="r", step_id="a", phase=Phase.RESULT, payload={"v": 1})
    huge = StepEvent(
        run_id="r", step_id="b", phase=Phase.RESULT, payload={"v": "x" * MAX_RECORD_BYTES}
    )
    with pytest.raises(RecordTooLarge, match="limit"):
        await store.append(ok, huge)
    assert await store.load("r") == []


async def test_full_journal_is_a_typed_error_and_keeps_what_was_recorded(tmp_path: Path) -> None:
    """When the journal cannot grow, append raises JournalFull and earlier records stay intact."""
    store = SqliteCheckpointer(tmp_path / "runs.db")
    first = StepEvent(run_id="r", step_id="a", phase=Phase.RESULT, payload={"v": 1})
    await store.append(first)
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")  # stands for a full disk
    big = StepEvent(run_id="r", step_id="b", phase=Phase.RESULT, payload={"v": "x" * 100_000})
    with pytest.raises(JournalFull, match="nothing of this write was recorded"):
        await store.append(big)
    assert [e.step_id for e in await store.load("r")] == ["a"]
    [info] = await store.runs()
    assert info.events == 1
