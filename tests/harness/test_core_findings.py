"""What building the crash harness found in the core, shown with real processes.

A restarted process that gets the dead holder's pid (an agent restarted by the
supervisor of its container, pid 1: it is pid 2 every time once pids wrap, or
at once in a small namespace) must take the run over at once, as any other
process of that PID namespace would: the lease records the holder's start time
precisely so that a reused pid is not mistaken for the holder.
``asiento.lease.is_dead_here`` returned False whenever the holder's pid was the
caller's own, whatever the start time said, so the restarted agent was refused
with ``RunLocked`` until the lease expired (30 s by default).
"""

from __future__ import annotations

import json
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from asiento.testing import sample
from asiento.testing._child import ChildConfig

from .conftest import SAMPLE


def _namespace_prefix() -> list[str]:
    """unshare in a new PID namespace (as root, or mapped to root in a user namespace)."""
    for prefix in (
        ["unshare", "--pid", "--fork", "--mount-proc"],
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"],
    ):
        try:
            done = subprocess.run([*prefix, "true"], capture_output=True, timeout=30, check=False)
        except FileNotFoundError:
            break
        if done.returncode == 0:
            return prefix
    pytest.skip("this machine cannot create PID namespaces (unshare)")


def _killed_then_restarted_as_the_same_pid(
    prefix: list[str], config: dict[str, object], first: dict[str, object], then: dict[str, object]
) -> list[str]:
    """Two passes in one new PID namespace, both pid 2 (pid 1 is the shell, as a supervisor).

    The shell sets ``ns_last_pid`` back before the second pass, as pids wrapping would.
    """
    child = [sys.executable, "-m", "asiento.testing._child", "once", json.dumps(config)]
    script = (
        f"{shlex.join([*child, json.dumps(first)])} & wait $!; echo first $! $?;"
        f" echo 1 > /proc/sys/kernel/ns_last_pid && {shlex.join([*child, json.dumps(then)])}"
    )
    done = subprocess.run(
        [*prefix, "sh", "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_restarted_process_with_the_dead_holders_pid_resumes_at_once(tmp_path: Path) -> None:
    """Killed as pid 2, restarted as pid 2 in the same namespace: the run resumes, not RunLocked."""
    prefix = _namespace_prefix()
    (tmp_path / "ledgers").mkdir()
    db = tmp_path / "runs.db"
    config = ChildConfig(SAMPLE, sample.TASK, str(db), str(tmp_path)).to_json()
    lines = _killed_then_restarted_as_the_same_pid(
        prefix,
        config,
        {"op": "run", "run": "r1", "crash": "after_model_result@1"},
        {"op": "run", "run": "r1"},
    )
    assert "first 2 137" in lines  # pid 2, SIGKILLed at the crash point
    outcome = json.loads(lines[-1])
    assert outcome["pid"] == 2  # the same pid as the dead holder, another process
    assert outcome["outcome"] == "suspended", outcome  # before the fix: "locked" for 30 s
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT lease_pid, fence FROM runs").fetchone() == (2, 2)
