"""One run, one driver: leases between real processes, SIGSTOP, SIGKILL and SIGTERM."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asiento import (
    Agent,
    Holder,
    ModelResponse,
    RunLocked,
    Session,
    SqliteCheckpointer,
    ToolCall,
    tool,
)
from asiento.lease import process_start
from asiento.testing import ScriptedGateway

CHILD = Path(__file__).with_name("child.py")


def spawn(tmp_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    """Start the child driving run-1 on the test's journal."""
    argv = [sys.executable, str(CHILD), str(tmp_path / "runs.db"), "run-1", str(tmp_path)]
    errors = (tmp_path / f"stderr.{time.monotonic_ns()}").open("wb")
    try:
        return subprocess.Popen([*argv, *extra], stdout=subprocess.DEVNULL, stderr=errors)
    finally:
        errors.close()


def wait_for(check: Callable[[], bool], seconds: float = 20.0) -> None:
    """Poll ``check`` until it holds, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def ledger(tmp_path: Path) -> list[str]:
    path = tmp_path / "send.ledger"
    return path.read_text().splitlines() if path.exists() else []


def test_second_session_in_a_live_process_fails_fast(tmp_path: Path) -> None:
    """A run held by a live process refuses a second driver at once, naming the holder."""
    child = spawn(tmp_path)
    try:
        wait_for((tmp_path / "slow.started").exists)
        second = spawn(tmp_path)
        assert second.wait(timeout=20) == 77
        (tmp_path / "slow.go").touch()
        assert child.wait(timeout=20) == 0
    finally:
        child.kill()
    assert len(ledger(tmp_path)) == 1


async def test_run_locked_names_the_holder_and_wait_waits(tmp_path: Path) -> None:
    """RunLocked names the holder's pid; Session(wait=...) waits for the release."""
    gate = asyncio.Event()

    @tool(idempotent=True)
    async def hold() -> str:
        """Hold the run until the test opens the gate."""
        await asyncio.wait_for(gate.wait(), 10)
        return "held"

    script = [ModelResponse(tool_calls=[ToolCall(name="hold")]), ModelResponse(text="ok")]
    agent = Agent(tools=[hold])
    store = SqliteCheckpointer(tmp_path / "runs.db")

    async def drive(wait: float) -> list[object]:
        session = Session("run-1", ScriptedGateway(script), store, wait=wait)
        return [step async for step in agent.run("t", session=session)]

    first = asyncio.create_task(drive(0))
    await asyncio.sleep(0.1)
    with pytest.raises(RunLocked, match=f"pid {os.getpid()}"):
        await drive(0)
    waiting = asyncio.create_task(drive(10))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    gate.set()
    assert len(await first) == 4
    assert [type(s).__name__ for s in await waiting] == ["FinalStep"]


def test_killed_holder_is_taken_over_at_once(tmp_path: Path) -> None:
    """A holder killed with SIGKILL on this host is taken over immediately, not after expiry."""
    child = spawn(tmp_path, "--ttl", "600")
    wait_for((tmp_path / "slow.started").exists)
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=20) == -signal.SIGKILL
    (tmp_path / "slow.go").touch()
    started = time.monotonic()
    resumed = spawn(tmp_path, "--ttl", "600")
    assert resumed.wait(timeout=20) == 0
    assert time.monotonic() - started < 60  # far below the 600 s lease
    assert len(ledger(tmp_path)) == 1


def test_stopped_holder_past_its_lease_writes_nothing(tmp_path: Path) -> None:
    """A holder frozen by SIGSTOP past its lease is taken over; continued, it writes nothing."""
    stale = spawn(tmp_path, "--ttl", "1")
    wait_for((tmp_path / "slow.started").exists)
    stale.send_signal(signal.SIGSTOP)
    try:
        (tmp_path / "slow.go").touch()
        taker = spawn(tmp_path, "--ttl", "5", "--wait", "15")
        assert taker.wait(timeout=30) == 0
    finally:
        stale.send_signal(signal.SIGCONT)
    assert stale.wait(timeout=30) == 76  # LeaseLost on its first write after the takeover
    assert len(ledger(tmp_path)) == 1
    assert all(line.startswith(str(taker.pid)) for line in ledger(tmp_path))


def test_sigterm_finishes_the_step_in_flight_then_stops(tmp_path: Path) -> None:
    """SIGTERM during a tool: the tool finishes, its result is recorded, the run stops resumable."""
    child = spawn(tmp_path, "--shutdown")
    wait_for((tmp_path / "slow.started").exists)
    child.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    (tmp_path / "slow.go").touch()
    assert child.wait(timeout=20) == 75
    assert ledger(tmp_path) == []  # nothing new started after the request
    store_events = asyncio.run(_phases(tmp_path))
    assert ("m1.t1", "result") in store_events
    assert not any(step.startswith("m2.") for step, _ in store_events)
    (tmp_path / "slow.started").unlink()
    resumed = spawn(tmp_path)
    assert resumed.wait(timeout=20) == 0
    assert not (tmp_path / "slow.started").exists()  # the finished tool was not run again
    assert len(ledger(tmp_path)) == 1


async def _phases(tmp_path: Path) -> list[tuple[str, str]]:
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        info = await store.runs()
        assert info[0].lease_owner is None  # released on the way out
        return [(e.step_id, e.phase.value) for e in await store.load("run-1")]
    finally:
        await store.close()


def _holder_facts(out: Any) -> None:
    holder = Holder.here()
    out.put((os.getpid(), holder.pid, holder.host, holder.started, process_start(os.getpid())))


def test_a_forked_child_holds_as_itself_not_as_its_parent() -> None:
    """The process's identity is read once per process: a child forked after the parent
    read its own names the child's pid and start time, never the parent's."""
    parent = Holder.here()
    assert parent.started == process_start(os.getpid()) != ""
    forked = multiprocessing.get_context("fork")
    out = forked.Queue()
    child = forked.Process(target=_holder_facts, args=(out,))
    child.start()
    pid, holder_pid, host, started, fresh = out.get(timeout=30)
    child.join(timeout=30)
    assert pid == holder_pid == child.pid != parent.pid
    assert (host, started) == (parent.host, fresh)
    assert started != ""
