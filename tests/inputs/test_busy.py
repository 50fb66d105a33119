"""SQLITE_BUSY: another process holds the journal's write lock in the middle of a run.

The locker is a real child process with its own SQLite connection: ``BEGIN
IMMEDIATE``, say so on stdout, sleep, roll back. It is started from inside the
run (from the model call or the tool), so the append that meets the lock is
the loop's own. Held longer than the store's ``timeout``, the append raises
``JournalBusy`` and writes nothing; held for less, the append waits and succeeds.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asiento import (
    Agent,
    FinalStep,
    JournalBusy,
    ModelRequest,
    ModelResponse,
    Phase,
    RunStatus,
    Session,
    SqliteCheckpointer,
    StepEvent,
    ToolCall,
    UncertainEffect,
    resolve,
    tool,
)
from asiento.testing import ScriptedGateway

RUN = "busy-run"
TASK = "send two messages"
CHILD_TIMEOUT = 30
SHORT_TIMEOUT = 0.3  # the store's busy timeout when the lock outlasts it
HOLD = 1.5  # how long the locker holds the lock when it outlasts the timeout
LEASE_TTL = 1.0

LOCKER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
db.execute("ROLLBACK")
db.close()
"""


class Locker:
    """Another process that takes the journal's write lock when asked, for ``hold`` seconds."""

    def __init__(self, db: Path, hold: float) -> None:
        self.db, self.hold = db, hold
        self.proc: subprocess.Popen[str] | None = None
        self.locked_at = 0.0

    def lock(self) -> None:
        """Start the locker and return once it holds the lock."""
        assert self.proc is None, "the locker locks once"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(self.db), str(self.hold)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "locked"
        self.locked_at = time.monotonic()

    def wait(self) -> None:
        """Until the locker has let go and exited."""
        if self.proc is not None:
            assert self.proc.wait(timeout=CHILD_TIMEOUT) == 0
            assert self.proc.stdout is not None
            self.proc.stdout.close()


@pytest.fixture
def locker(tmp_path: Path) -> Iterator[Locker]:
    """The locker of the test's journal; never left running."""
    made = Locker(tmp_path / "runs.db", HOLD)
    yield made
    if made.proc is not None:
        made.proc.kill()
        made.proc.wait(timeout=CHILD_TIMEOUT)
        if made.proc.stdout is not None:
            made.proc.stdout.close()


class Effects:
    """What really happened: each tool execution and each model request, in order."""

    def __init__(self) -> None:
        self.tools: list[int] = []
        self.models: list[str] = []


def make_agent(effects: Effects, on_tool: dict[int, Any]) -> Agent:
    """``send(n)`` is not idempotent; ``on_tool[n]`` runs inside it (to take the lock)."""

    @tool
    def send(n: int) -> str:
        """Send message ``n``."""
        effects.tools.append(n)
        if n in on_tool:
            on_tool[n]()
        return f"sent {n}"

    return Agent(tools=[send])


def make_gateway(effects: Effects, on_turn: dict[int, Any]) -> ScriptedGateway:
    """Turns 0 and 1 ask ``send(n=turn)``, turn 2 closes; ``on_turn[t]`` runs before answering."""

    def answer(request: ModelRequest) -> ModelResponse:
        turn = sum(1 for m in request.messages if m.role == "assistant")
        effects.models.append(f"m{turn + 1}")
        if turn in on_turn:
            on_turn[turn]()
        if turn >= 2:
            return ModelResponse(text="sent both")
        return ModelResponse(tool_calls=[ToolCall(name="send", arguments={"n": turn})])

    return ScriptedGateway(answer)


async def drive(
    db: Path,
    effects: Effects,
    *,
    timeout: float = 5.0,
    wait: float = 0.0,
    on_turn: dict[int, Any] | None = None,
    on_tool: dict[int, Any] | None = None,
) -> list[Any]:
    """One pass of the run on a store of its own with the given busy timeout."""
    store = SqliteCheckpointer(db, timeout=timeout)
    gateway = make_gateway(effects, on_turn or {})
    session = Session(RUN, gateway, store, lease_ttl=LEASE_TTL, wait=wait)
    try:
        return [s async for s in make_agent(effects, on_tool or {}).run(TASK, session=session)]
    finally:
        await store.close()


async def journal(db: Path) -> tuple[list[StepEvent], int]:
    """The run's records and the event count of its index, read by a new connection."""
    store = SqliteCheckpointer(db)
    try:
        [info] = await store.runs()
        assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return await store.load(RUN), info.events
    finally:
        await store.close()


def keys(events: list[StepEvent]) -> list[tuple[str, str]]:
    return [(e.step_id, e.phase.value) for e in events]


FIRST_STEP = [
    ("m1", "result"),
    ("m1.t1", "intent"),
    ("m1.t1", "submitted"),
    ("m1.t1", "result"),
]


async def test_lock_held_past_the_timeout_at_a_model_step(tmp_path: Path, locker: Locker) -> None:
    """The m2 append meets a lock held past the timeout: JournalBusy, nothing of m2 written."""
    db, effects = tmp_path / "runs.db", Effects()
    with pytest.raises(JournalBusy, match="lock"):
        await drive(db, effects, timeout=SHORT_TIMEOUT, on_turn={1: locker.lock})
    waited = time.monotonic() - locker.locked_at
    assert SHORT_TIMEOUT * 0.9 <= waited < HOLD, "the append waited its timeout, no more"
    events, counted = await journal(db)
    assert keys(events) == FIRST_STEP
    assert counted == len(events)
    assert effects.tools == [0]
    locker.wait()
    steps = await drive(db, effects, wait=LEASE_TTL + 10)
    assert isinstance(steps[-1], FinalStep)
    assert not steps[-1].replayed
    assert effects.tools == [0, 1], "each effect ran once"
    # m2 was asked twice: its answer was lost with the refused append (never recorded).
    assert effects.models == ["m1", "m2", "m2", "m3"]


async def test_lock_held_past_the_timeout_after_a_tool(tmp_path: Path, locker: Locker) -> None:
    """The tool's result meets the lock: JournalBusy; the resume is uncertain, never a rerun."""
    db, effects = tmp_path / "runs.db", Effects()
    with pytest.raises(JournalBusy):
        await drive(db, effects, timeout=SHORT_TIMEOUT, on_tool={0: locker.lock})
    events, counted = await journal(db)
    assert keys(events) == FIRST_STEP[:3], "the submitted marker is all there is of m1.t1"
    assert counted == len(events)
    locker.wait()
    with pytest.raises(UncertainEffect) as caught:
        await drive(db, effects, wait=LEASE_TTL + 10)
    assert caught.value.step_id == "m1.t1"
    assert effects.tools == [0], "a submitted, non-idempotent effect is never run again blindly"
    store = SqliteCheckpointer(db)
    await resolve(store, RUN, "m1.t1", happened=True, by="test", result="sent 0")
    await store.close()
    steps = await drive(db, effects)
    assert isinstance(steps[-1], FinalStep)
    assert effects.tools == [0, 1]


async def test_same_process_resumes_at_once_when_the_lock_is_gone(
    tmp_path: Path, locker: Locker
) -> None:
    """After JournalBusy, a new session of the same process resumes as soon as the lock is free.

    The failed session could not release its lease (the release met the same lock); it is
    no longer driving the run, so its lease must not lock this process out for lease_ttl.
    """
    db, effects = tmp_path / "runs.db", Effects()
    store = SqliteCheckpointer(db, timeout=SHORT_TIMEOUT)
    session = Session(RUN, make_gateway(effects, {1: locker.lock}), store)  # default lease_ttl
    with pytest.raises(JournalBusy):
        async for _ in make_agent(effects, {}).run(TASK, session=session):
            pass
    await store.close()
    locker.wait()
    steps = await drive(db, effects)  # wait=0: fail fast if the run is still held
    assert isinstance(steps[-1], FinalStep)
    assert effects.tools == [0, 1]


async def test_lock_shorter_than_the_timeout_is_waited_for(tmp_path: Path) -> None:
    """A lock held for less than the timeout: the append waits for it and the run closes."""
    db, effects = tmp_path / "runs.db", Effects()
    short = Locker(db, hold=0.5)
    steps = await drive(db, effects, timeout=10.0, on_turn={1: short.lock})
    finished = time.monotonic()
    short.wait()
    assert finished - short.locked_at >= 0.45, "the run went on only once the lock was free"
    assert isinstance(steps[-1], FinalStep)
    assert effects.tools == [0, 1]
    assert effects.models == ["m1", "m2", "m3"]
    events, counted = await journal(db)
    assert len(events) == counted == 10
    [info] = await runs(db)
    assert info.status is RunStatus.CLOSED


async def test_lock_held_when_a_run_starts_refuses_it_before_anything(
    tmp_path: Path, locker: Locker
) -> None:
    """A run started while another process holds the lock: JournalBusy, no call, no record."""
    db, effects = tmp_path / "runs.db", Effects()
    await SqliteCheckpointer(db).close()
    locker.lock()
    with pytest.raises(JournalBusy):
        await drive(db, effects, timeout=SHORT_TIMEOUT)
    assert effects.models == []
    locker.wait()
    assert await runs(db) == []
    steps = await drive(db, effects)
    assert isinstance(steps[-1], FinalStep)
    assert [e.phase for e in (await journal(db))[0]][-1] == Phase.RESULT


async def runs(db: Path) -> list[Any]:
    store = SqliteCheckpointer(db)
    try:
        return await store.runs()
    finally:
        await store.close()
