"""Holders in another PID namespace (containers on one host): never "provably dead".

Two containers share the host name and boot id but not their pids: pid 1 of a
container is init out here, and a free pid here may be a live process there.
Each holder below runs in a namespace of its own (``unshare --pid``), so its
pid either names another process here (pid 1) or none at all; it keeps its
run until its lease expires, alive or killed.
"""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from asiento import Holder, RunLocked, SqliteCheckpointer
from asiento.lease import hostname

from .namespaces import as_pid, free_pid, holder_argv, kill, ready, start, unshare, wait_for
from .test_session_lease import CHILD, ledger

TOOK_OVER = "a holder in another PID namespace was taken over before its lease expired"


def hold_in_a_namespace(
    tmp_path: Path, pid: str, ttl: float
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """A process of a new PID namespace holding run-1 of runs.db (pid "1" or "free" here)."""
    argv = holder_argv("lease", tmp_path / "runs.db", "run-1", ttl, tmp_path / "ready")
    if pid == "free":
        argv = as_pid(free_pid(), argv)
    proc = start([*unshare(), *argv], tmp_path)
    return proc, ready(tmp_path / "ready", proc)


async def try_to_take(tmp_path: Path) -> bool:
    """Whether a session of this process takes run-1 (False: RunLocked)."""
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        await store.acquire("run-1", Holder.here(), ttl=30)
    except RunLocked:
        return False
    finally:
        await store.close()
    return True


@pytest.mark.parametrize("pid", ["1", "free"])
async def test_a_holder_in_another_pid_namespace_keeps_its_lease_alive_or_killed(
    tmp_path: Path, pid: str
) -> None:
    """Its pid is init here, or free here: neither proves it dead; killed, it still is not."""
    proc, facts = hold_in_a_namespace(tmp_path, pid, ttl=600)
    try:
        if pid == "1":
            assert facts["pid"] == 1
        else:
            assert not Path(f"/proc/{facts['pid']}").exists()
        assert not await try_to_take(tmp_path), TOOK_OVER
        assert facts["host"] != hostname()  # its namespace is in its identity
        assert facts["host"].rsplit("/pidns:", 1)[0] == hostname().rsplit("/pidns:", 1)[0]
    finally:
        kill(proc)
    assert not await try_to_take(tmp_path), TOOK_OVER  # dead, but not where we can see


async def test_a_holder_in_another_pid_namespace_is_taken_once_its_lease_expires(
    tmp_path: Path,
) -> None:
    """Killed at once, its run is taken over by the first attempt after the expiry, not before."""
    proc, _ = hold_in_a_namespace(tmp_path, "1", ttl=3)
    kill(proc)
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        [run] = await store.runs()
        deadline = time.monotonic() + 30
        while not await try_to_take(tmp_path):
            assert time.monotonic() < deadline, "the expired lease was never taken over"
            await asyncio.sleep(0.05)
        assert time.time() > run.lease_expires, TOOK_OVER
        [taken] = await store.runs()
        assert taken.fence == run.fence + 1
    finally:
        await store.close()


def test_a_session_driving_in_another_pid_namespace_is_not_taken_over(tmp_path: Path) -> None:
    """A run driven in a container is refused to a second driver here; it then closes, once."""
    argv = [sys.executable, str(CHILD), str(tmp_path / "runs.db"), "run-1", str(tmp_path)]
    driver = start([*unshare(), *argv, "--ttl", "600"], tmp_path)
    try:
        wait_for(lambda: (tmp_path / "slow.started").exists() or driver.poll() is not None)
        assert (tmp_path / "slow.started").read_text() == "1"  # pid 1 of its namespace
        second = start(argv, tmp_path)
        assert second.wait(timeout=30) == 77, TOOK_OVER  # RunLocked
        (tmp_path / "slow.go").touch()
        assert driver.wait(timeout=30) == 0  # not LeaseLost: nobody took its run
    finally:
        if driver.poll() is None:
            kill(driver)
    assert len(ledger(tmp_path)) == 1


def test_a_holder_seeing_another_namespaces_proc_records_no_start_time(tmp_path: Path) -> None:
    """A /proc mounted for another namespace lies about our pids: nothing is judged by it.

    The holder runs in a new PID namespace without its own /proc (it reads the
    host's, where its pid names another process); a rival in that same
    namespace, with a /proc of its own, must not take the holder's run for a
    reused pid.
    """
    ready_file = tmp_path / "ready"
    hold = holder_argv("lease", tmp_path / "runs.db", "run-1", 600, ready_file)
    rival = holder_argv("try", tmp_path / "runs.db", "run-1", ready_file)
    inner = [unshare()[0], "--mount", "--mount-proc", *rival]
    script = f"{shlex.join(hold)} & {shlex.join(inner)}"
    proc = start([*unshare(own_proc=False), "sh", "-c", script], tmp_path, output=True)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            kill(proc)
    assert out.split() == ["locked"], TOOK_OVER
    facts = ready(ready_file, proc)
    assert facts["started"] == ""  # what the host's /proc says of its pid is not its start
