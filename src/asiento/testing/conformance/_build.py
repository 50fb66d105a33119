"""What the conformance tests are built from: records, lease holders, a process that died."""

from __future__ import annotations

import os
import subprocess
from typing import Any

from asiento import Checkpointer, Decision, Holder, Phase, RunInfo, StepEvent
from asiento.lease import hostname, process_start


def ev(
    step_id: str,
    phase: Phase = Phase.RESULT,
    *,
    run_id: str = "run-1",
    decision: Decision | None = None,
    **payload: Any,
) -> StepEvent:
    """A record with a small payload."""
    return StepEvent(
        run_id=run_id, step_id=step_id, phase=phase, decision=decision, payload=payload
    )


def holder(owner: str, *, host: str | None = None, pid: int | None = None) -> Holder:
    """A lease holder; by default a live one: this process, on this host."""
    pid = os.getpid() if pid is None else pid
    here = host is None
    return Holder(
        owner=owner,
        host=hostname() if here else str(host),
        pid=pid,
        started=process_start(pid) if here else "1",
    )


def dead_pid() -> tuple[int, str]:
    """The pid and start time of a process that has exited (and was reaped)."""
    child = subprocess.Popen(["sleep", "5"])
    started = process_start(child.pid)
    child.kill()
    child.wait(timeout=10)
    return child.pid, started


async def info_of(store: Checkpointer, run_id: str = "run-1") -> RunInfo:
    """The listing entry of one run."""
    [info] = [r for r in await store.runs() if r.run_id == run_id]
    return info
