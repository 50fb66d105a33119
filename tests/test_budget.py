"""Budgets per run: a new paid call is made only while the run's recorded spending is
below every limit; over it the run stops, suspended and recorded, until a person raises
the budget (in Python or with ``asiento budget``); replayed answers are never blocked."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asiento import (
    Agent,
    Budget,
    BudgetStep,
    FinalStep,
    Phase,
    RunClosed,
    RunStatus,
    Session,
    SqliteCheckpointer,
    UsageError,
    abandon,
    raise_budget,
)
from asiento.model import Usage
from asiento.testing import ScriptedGateway, StreamingScriptedGateway
from sqlite_files import Journal
from test_agent import RUN, TASK, asks, counting_tool, done

STEPS = 5  # model calls that ask for a tool, then one that answers


def script() -> list[Any]:
    used = Usage(input_tokens=10, output_tokens=5)
    answers = [asks(("echo", {"text": f"n{i}"})) for i in range(STEPS)] + [done()]
    from dataclasses import replace

    return [replace(a, usage=used) for a in answers]


def agent(budget: Budget | None) -> Agent:
    return Agent(tools=[counting_tool("echo", [], idempotent=True)], budget=budget)


async def drive(a: Agent, gw: ScriptedGateway, store: Any) -> list[Any]:
    return [s async for s in a.run(TASK, session=Session(RUN, gw, store))]


async def stopped(journal: Journal, calls: int = 2) -> BudgetStep:
    gw = ScriptedGateway(script())
    steps = await drive(agent(Budget(max_model_calls=calls)), gw, journal.open())
    assert len(gw.calls) == calls  # exactly the budget, no more
    assert isinstance(steps[-1], BudgetStep)
    return steps[-1]


async def test_budget_stops_before_the_call_that_would_exceed_it(journal: Journal) -> None:
    step = await stopped(journal, calls=2)
    assert step.limit == "max_model_calls"
    assert step.spent["max_model_calls"] == 2
    assert step.budget["max_model_calls"] == 2
    store = journal.open()
    info = await store.run(RUN)
    assert info is not None
    assert info.status == RunStatus.SUSPENDED
    assert "max_model_calls: spent 2 of 2" in (info.reason or "")
    assert await store.final(RUN) is None  # not closed
    recorded = [e for e in await store.load(RUN) if e.step_id == "budget1"]
    assert [e.phase for e in recorded] == [Phase.INTENT]


async def test_tokens_limit_counts_recorded_usage(journal: Journal) -> None:
    gw = ScriptedGateway(script())
    steps = await drive(agent(Budget(max_tokens=31)), gw, journal.open())
    assert len(gw.calls) == 3  # 15, 30 tokens: below 31; 45 reached
    assert isinstance(steps[-1], BudgetStep)
    assert steps[-1].limit == "max_tokens"


async def test_resume_replays_without_counting_twice_or_paying(journal: Journal) -> None:
    await stopped(journal, calls=2)
    for _ in range(2):  # resumed twice, no raise: replays, pays nothing, stops again
        gw = ScriptedGateway(script())
        steps = await drive(agent(Budget(max_model_calls=2)), gw, journal.open())
        assert gw.calls == []
        assert isinstance(steps[-1], BudgetStep)
        assert steps[-1].spent["max_model_calls"] == 2  # the replayed calls counted once
    events = await journal.open().load(RUN)
    assert [e.step_id for e in events].count("budget1") == 1  # one stop recorded


async def test_raise_then_resume_pays_only_the_new_calls(journal: Journal) -> None:
    await stopped(journal, calls=2)
    await raise_budget(journal.open(), RUN, by="ana", max_model_calls=4, reason="worth it")
    info = await journal.open().run(RUN)
    assert info is not None
    assert info.status == RunStatus.RUNNING
    gw = ScriptedGateway(script())
    steps = await drive(agent(Budget(max_model_calls=2)), gw, journal.open())
    assert len(gw.calls) == 2
    assert isinstance(steps[-1], BudgetStep)
    assert steps[-1].step_id == "budget2"
    assert steps[-1].budget["max_model_calls"] == 4
    await raise_budget(journal.open(), RUN, by="ana", max_model_calls=100)
    gw = ScriptedGateway(script())
    steps = await drive(agent(Budget(max_model_calls=2)), gw, journal.open())
    assert len(gw.calls) == STEPS + 1 - 4
    assert isinstance(steps[-1], FinalStep)


async def test_code_budget_and_raise_combine_as_the_larger(journal: Journal) -> None:
    """A raise never lowers a limit, and a larger limit in code applies as well."""
    await stopped(journal, calls=2)
    await raise_budget(journal.open(), RUN, by="ana", max_model_calls=3)
    gw = ScriptedGateway(script())
    steps = await drive(agent(Budget(max_model_calls=5)), gw, journal.open())
    assert len(gw.calls) == 3
    assert steps[-1].budget["max_model_calls"] == 5


async def test_a_raise_racing_the_pass_is_not_lost(journal: Journal) -> None:
    """The raise lands after the pass read the journal, before it marks the run suspended:
    the conditional status sees it and the pass goes on with the raised budget."""
    await stopped(journal, calls=2)
    inner = journal.open()
    other = journal.open()

    class RaiseFirst:
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        async def set_status(self, run_id: str, status: RunStatus, **kw: Any) -> bool:
            if (
                status is RunStatus.SUSPENDED
                and kw.get("waits_for")
                and not any(
                    e.phase is Phase.APPROVAL for e in await other.load_step(RUN, "budget1")
                )
            ):
                await raise_budget(other, RUN, by="ana", max_model_calls=100)
            return await inner.set_status(run_id, status, **kw)

    gw = ScriptedGateway(script())
    steps = [
        s
        async for s in agent(Budget(max_model_calls=2)).run(
            TASK,
            session=Session(RUN, gw, RaiseFirst()),  # type: ignore[arg-type]
        )
    ]
    assert isinstance(steps[-1], FinalStep)
    assert len(gw.calls) == STEPS + 1 - 2


async def test_raise_on_a_closed_run_is_refused(journal: Journal) -> None:
    await stopped(journal)
    await abandon(journal.open(), RUN, by="ana", reason="too dear")
    before = await journal.open().load(RUN)
    with pytest.raises(RunClosed, match="closed"):
        await raise_budget(journal.open(), RUN, by="ana", max_model_calls=9)
    assert await journal.open().load(RUN) == before


async def test_raise_on_a_run_not_stopped_is_refused(journal: Journal) -> None:
    await stopped(journal)
    await raise_budget(journal.open(), RUN, by="ana", max_model_calls=9)
    with pytest.raises(UsageError, match="not stopped on its budget"):
        await raise_budget(journal.open(), RUN, by="ana", max_model_calls=9)
    with pytest.raises(UsageError, match="which limit"):
        await raise_budget(journal.open(), RUN, by="ana")
    with pytest.raises(UsageError, match="max_cost"):
        Budget(max_cost=-1)


HUGE = 10**400  # a 400-digit limit: more than a float or a 64-bit column holds


async def test_a_raise_beyond_a_64_bit_count_is_one_clear_refusal(journal: Journal) -> None:
    await stopped(journal)
    before = await journal.open().load(RUN)
    for limit in ("max_model_calls", "max_tokens", "max_cost"):
        with pytest.raises(UsageError, match=r"at most 9223372036854775807 \(2\*\*63 - 1\)"):
            await raise_budget(journal.open(), RUN, by="ana", **{limit: HUGE})
    with pytest.raises(UsageError, match="integer of 1329 bits"):
        Budget(max_tokens=HUGE)
    assert await journal.open().load(RUN) == before
    await raise_budget(journal.open(), RUN, by="ana", max_model_calls=2**63 - 1)  # the largest


def test_a_huge_raise_from_the_cli_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    journal = Journal(db)

    async def first() -> None:
        await stopped(journal, calls=2)
        for s in journal.opened:
            await s.close()

    asyncio.run(first())
    argv = [sys.executable, "-m", "asiento", "budget", RUN, "--max-model-calls", str(HUGE)]
    proc = subprocess.run(
        [*argv, "--by", "ana", "--store", str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "must be at most 9223372036854775807" in proc.stderr


def test_raise_from_the_cli_then_resume(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    journal = Journal(db)

    async def first() -> None:
        await stopped(journal, calls=2)
        for s in journal.opened:
            await s.close()

    asyncio.run(first())
    env = {**os.environ, "COLUMNS": "200"}
    argv = [sys.executable, "-m", "asiento", "budget", RUN, "--max-model-calls", "50"]
    proc = subprocess.run(
        [*argv, "--by", "ana", "--store", str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "budget raised" in proc.stdout
    shown = subprocess.run(
        [sys.executable, "-m", "asiento", "show", RUN, "--store", str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert shown.returncode == 0, shown.stderr
    assert "budget raised to max_model_calls=50 by ana" in shown.stdout
    assert "stopped on its budget before m3" in shown.stdout

    async def second() -> int:
        gw = ScriptedGateway(script())
        store = SqliteCheckpointer(db)
        steps = await drive(agent(Budget(max_model_calls=2)), gw, store)
        await store.close()
        assert isinstance(steps[-1], FinalStep)
        return len(gw.calls)

    assert asyncio.run(second()) == STEPS + 1 - 2


CHILD = """
import asyncio, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from asiento import Budget, Session, SqliteCheckpointer
from asiento.testing import ScriptedGateway
import test_budget as tb

class Counting(ScriptedGateway):
    async def complete(self, request, *, idempotency_key):
        with open(sys.argv[2], "a") as paid:
            paid.write(idempotency_key + "\\n")
        return await super().complete(request, idempotency_key=idempotency_key)

async def main():
    store = SqliteCheckpointer(Path(sys.argv[1]))
    a = tb.agent(Budget(max_model_calls=3))
    steps = [s async for s in a.run(tb.TASK, session=Session(tb.RUN, Counting(tb.script()), store))]
    print(type(steps[-1]).__name__)
    await store.close()

asyncio.run(main())
"""


def test_a_run_killed_after_some_calls_is_not_charged_twice(tmp_path: Path) -> None:
    """SIGKILLed right after m2's answer is durable; the restarted process replays m1 and m2
    (not counted again) and pays only m3: the budget of 3 is paid exactly 3 calls."""
    db, paid = tmp_path / "runs.db", tmp_path / "paid.txt"
    here = str(Path(__file__).parent)
    argv = [sys.executable, "-c", CHILD, str(db), str(paid), here]
    env = {**os.environ, "ASIENTO_CRASH_AT": "after_model_result@2"}
    killed = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert killed.returncode == -9, killed.stderr
    assert len(paid.read_text().splitlines()) == 2
    env.pop("ASIENTO_CRASH_AT")
    resumed = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.strip() == "BudgetStep"
    keys = paid.read_text().splitlines()
    assert len(keys) == 3
    assert len(set(keys)) == 3  # no call paid twice


class CuttingGateway(StreamingScriptedGateway):
    """Streams each answer, but the first ``cut`` streams break after their first part:
    each is a generation the provider billed and the run never received."""

    def __init__(self, responses: list[Any], cut: int) -> None:
        super().__init__(responses)
        self.cut = cut

    async def stream(self, request: Any, *, idempotency_key: str) -> Any:
        breaking = len(self.calls) < self.cut
        async for part in super().stream(request, idempotency_key=idempotency_key):
            yield part
            if breaking:
                raise ConnectionError("the stream was cut")


async def test_cut_streams_count_against_the_budget(journal: Journal) -> None:
    """max_model_calls=1: one cut generation spends it; the next pass stops, not asks."""
    budget = Budget(max_model_calls=1)
    gw = CuttingGateway(script(), cut=4)
    for _ in range(4):  # each pass would ask (and pay) m1 again, were cuts not counted
        store = journal.open()
        try:
            session = Session(RUN, gw, store)
            steps = [s async for s in agent(budget).run(TASK, session=session, stream=True)]
        except ConnectionError:
            continue
        finally:
            await store.close()
        break
    assert len(gw.calls) == 1  # billed once, as the budget allows
    assert isinstance(steps[-1], BudgetStep)
    assert steps[-1].spent["max_model_calls"] == 1
    await raise_budget(journal.open(), RUN, by="ana", max_model_calls=2)
    gw.cut = 0
    session = Session(RUN, gw, journal.open())
    steps = [s async for s in agent(budget).run(TASK, session=session, stream=True)]
    assert len(gw.calls) == 2  # m1 asked again: the cut one and this one, two of two
    assert isinstance(steps[-1], BudgetStep)
    assert steps[-1].spent["max_model_calls"] == 2  # the answer's repaid counts too
