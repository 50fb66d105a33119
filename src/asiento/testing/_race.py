"""The lease race: a driver stopped past its lease, a successor takes the run over.

One trial, on a fresh run, with two fork-servers:

1. driver A (short lease) stops itself with SIGSTOP right after sending its
   k-th model request: it holds the lease and is about to write;
2. the parent waits until A's lease has expired in the run index;
3. driver B takes the run over (the fence grows) and stops itself at its
   first model request, before writing anything;
4. the parent snapshots the journal and the ledgers, continues A and waits
   for it to exit: B is stopped, so whatever appeared meanwhile is A's;
5. B is continued; the run is then driven to its end as usual.

With fencing, A's next append is refused (``LeaseLost``) before its effect
starts: A adds no record and no ledger line. Journal rows carry no writer id,
so this is how the oracle attributes writes: by stopping everybody else.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._drive import RunDriver, drive
from ._files import read_lines
from ._server import ForkServer, HarnessError
from .invariants import RaceRecord, check_race
from .report import Report

if TYPE_CHECKING:
    from .harness import CrashHarness, Plan

STALE_TTL = 0.3  # seconds: A's lease, which expires while A is stopped
WAIT = 20.0  # the longest the parent waits for a child to stop or to exit


def lease_race(harness: CrashHarness, trials: int, seed: int) -> Report:
    rng = random.Random(seed)
    with harness.race("lease races", seed) as (servers, plan, report):
        for _ in range(trials):
            k = rng.randint(1, max(1, plan.model_calls))
            race_trial(harness, servers, plan, f"race:{k}", report)
    return report


def race_trial(
    harness: CrashHarness, servers: list[ForkServer], plan: Plan, case: str, report: Report
) -> None:
    """One race (``race:K``: A stops at its K-th model request), then the run's end."""
    driver, record = _race(harness, servers, int(case.removeprefix("race:")), case)
    ended = drive(driver, servers[0], max_ops=harness.max_ops)
    report.violations += [harness.with_replay(v) for v in check_race(record)]
    harness.check_histories(report, [driver.history(ended=ended)], plan)
    report.trials += 1
    report.faults["takeovers of a stopped holder"] += 1


def _race(
    harness: CrashHarness, servers: list[ForkServer], k: int, case: str
) -> tuple[RunDriver, RaceRecord]:
    driver = harness.driver("race", case=case)
    run_id, reader = driver.run_id, harness.reader
    marks = [harness.workdir / f"{run_id}.{who}.stopped" for who in ("a", "b")]
    base: dict[str, Any] = {"op": "run", "run": run_id}
    cmd_a = base | {"lease_ttl": STALE_TTL, "pause_model": k, "pause_file": str(marks[0])}
    cmd_b = base | {"wait": 10.0, "pause_model": 1, "pause_file": str(marks[1])}
    pids: list[int] = []
    with ThreadPoolExecutor(2) as pool:
        try:
            future_a = pool.submit(servers[0], cmd_a)
            pids.append(_stopped(marks[0], future_a))
            stale_token = reader.run_row(run_id)[1]
            _wait_expired(harness, run_id)
            future_b = pool.submit(servers[1], cmd_b)
            pids.append(_stopped(marks[1], future_b))
            successor_token = reader.run_row(run_id)[1]
            before = reader.journal(run_id)
            effects_at, models_at = (len(read_lines(p)) for p in driver.ledgers)
            os.kill(pids[0], signal.SIGCONT)
            reply_a = future_a.result(timeout=WAIT)
            after = reader.journal(run_id)
            effects, models = (read_lines(p) for p in driver.ledgers)
            os.kill(pids[1], signal.SIGCONT)
            future_b.result(timeout=WAIT)
        finally:
            _release(pids)
    record = RaceRecord(
        run_id=run_id,
        stale_token=stale_token,
        successor_token=successor_token,
        journal_before=before,
        journal_after=after,
        stale_effects=[e for e in effects[effects_at:] if e.get("pid") == pids[0]],
        stale_models=[m for m in models[models_at:] if m.get("pid") == pids[0]],
        stale_outcome=reply_a.get("out"),
        case=case,
    )
    return driver, record


def _stopped(mark: Path, future: Future[dict[str, Any]]) -> int:
    """The pid of the child that wrote ``mark`` and is now stopped."""
    pid = _poll(lambda: int(mark.read_text()) if mark.exists() else None, future)
    _poll(lambda: pid if _state(pid) == "T" else None, future)
    return pid


def _poll(probe: Callable[[], int | None], future: Future[dict[str, Any]]) -> int:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        found = probe()
        if found is not None:
            return found
        if future.done():
            raise HarnessError(f"a racing driver ended before it stopped: {future.result()}")
        time.sleep(0.002)
    raise HarnessError(f"a racing driver did not stop within {WAIT:.0f}s")


def _state(pid: int) -> str:
    """The process state letter from /proc (T: stopped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[0]


def _wait_expired(harness: CrashHarness, run_id: str) -> None:
    """Until the run index says the stopped holder's lease has expired."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        expires = harness.reader.run_row(run_id)[2]
        if expires is not None and expires < time.time() - 0.05:
            return
        time.sleep(0.02)
    raise HarnessError(f"run {run_id}: the stopped holder's lease never expired")


def _release(pids: list[int]) -> None:
    """Never leave a stopped child behind: continue whatever is still stopped."""
    for pid in pids:
        if _state(pid) == "T":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
