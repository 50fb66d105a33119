"""What building the crash harness found in the core, shown with real processes.

A restarted process that gets the dead holder's pid (a container restarted:
the agent is pid 1, or 2 under a shell, every time) must take the run over at
once, as any other process on the host would: the lease records the holder's
start time precisely so that a reused pid is not mistaken for the holder.
``asiento.lease.is_dead_here`` returns False whenever the holder's pid is the
caller's own, whatever the start time says, so the restarted agent is refused
with ``RunLocked`` until the lease expires (30 s by default).
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


def _pass_in_a_fresh_namespace(
    prefix: list[str], config: dict[str, object], cmd: dict[str, object]
) -> subprocess.CompletedProcess[str]:
    """One pass, its process pid 2 of a new PID namespace (pid 1 is the shell waiting)."""
    child = [sys.executable, "-m", "asiento.testing._child", "once", json.dumps(config)]
    script = shlex.join([*child, json.dumps(cmd)]) + "; exit $?"
    return subprocess.run(
        [*prefix, "sh", "-c", script], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_restarted_process_with_the_dead_holders_pid_resumes_at_once(tmp_path: Path) -> None:
    """Killed as pid 2, restarted as pid 2 (as in a container): the run resumes, not RunLocked."""
    prefix = _namespace_prefix()
    (tmp_path / "ledgers").mkdir()
    db = tmp_path / "runs.db"
    config = ChildConfig(SAMPLE, sample.TASK, str(db), str(tmp_path)).to_json()
    killed = _pass_in_a_fresh_namespace(
        prefix, config, {"op": "run", "run": "r1", "crash": "after_model_result@1"}
    )
    assert killed.returncode == 128 + 9, killed.stderr  # SIGKILLed at the crash point
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT lease_pid FROM runs").fetchone() == (2,)
    resumed = _pass_in_a_fresh_namespace(prefix, config, {"op": "run", "run": "r1"})
    outcome = json.loads(resumed.stdout.splitlines()[-1])
    assert outcome["pid"] == 2  # the same pid as the dead holder, another process
    assert outcome["outcome"] == "suspended", outcome  # today: "locked" for 30 s
