"""Kill storm: random SIGKILLs at random instants, many runs interleaved in one journal file.

Each trial is one operation on a run in a freshly forked child: a pass armed at a
random crash point and passage, or an unarmed pass SIGKILLed after 0-30 ms, or an
approval by the harness, armed or killed the same way. Two workers drive their
own runs at once in one SQLite file. Every run is driven to its end and checked
against the ledgers (oracle.violations). Replay a failure with the printed seed:
``ASIENTO_STORM_SEED=<seed> python -m pytest tests/crash/test_storm.py``.
"""

from __future__ import annotations

import itertools
import os
import random
import sqlite3
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asiento.testing import CRASH_POINTS

from .oracle import KILLED, NOT_APPLICABLE, ForkServer, RunLog, drive, integrity, violations

WALL_CLOCK = 150.0  # seconds; the storm stops early and says how far it got
WORKERS = 2
RUNS_PER_WORKER = 3  # live at once, so their records interleave in the file
MAX_TRIALS = 20_000
MAX_KILLS_IN_A_ROW = 6  # then one clean operation, so every run moves on
MAX_OPS_PER_RUN = 60
MAX_DELAY = 0.030
RUN_POINTS = sorted(set(CRASH_POINTS) - NOT_APPLICABLE - {"during_approval"})
APPROVE_POINTS = ("during_approval", "inside_commit@1")


@dataclass
class Storm:
    """What the workers share: the seed, the file, the kill budget and the clock."""

    seed: int
    db: Path
    ledgers: Path
    kills_wanted: int
    deadline: float
    kills: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    aborted: bool = False

    def over(self) -> bool:
        with self.lock:
            spent = self.kills.total() >= self.kills_wanted or time.monotonic() > self.deadline
            return spent or self.aborted

    def count(self, kind: str) -> None:
        with self.lock:
            self.kills[kind] += 1


class Worker:
    """Drives its own runs through its own fork-server, choosing every trial at random."""

    def __init__(self, storm: Storm, index: int, server: ForkServer) -> None:
        self.storm, self.index, self.server = storm, index, server
        self.rng = random.Random(f"{storm.seed}/{index}")
        self.serial = 0

    def campaign(self) -> list[RunLog]:
        try:
            return self._campaign()
        except BaseException:
            self.storm.aborted = True  # the other worker stops too
            raise

    def _campaign(self) -> list[RunLog]:
        active: list[RunLog] = []
        done: list[RunLog] = []
        for _ in range(MAX_TRIALS):
            if self.storm.over():
                break
            while len(active) < RUNS_PER_WORKER:
                active.append(self._new_run())
            log = self.rng.choice(active)
            self._trial(log)
            if log.closed:
                active.remove(log)
                done.append(self._finish(log))
        return done + [self._finish(log) for log in active]

    def _new_run(self) -> RunLog:
        self.serial += 1
        approval = self.rng.random() < 0.4
        run_id = f"w{self.index}-r{self.serial}"
        return RunLog.new(self.storm.db, run_id, self.storm.ledgers, approval=approval)

    def _finish(self, log: RunLog) -> RunLog:
        """Drive what is left without crashes, then ask a closed run once more."""
        drive(log, self.server, max_ops=12)
        return log

    def _trial(self, log: RunLog) -> None:
        crash, kill_after = self._choose(log)
        op = log.advance(self.server, crash=crash, kill_after=kill_after)
        if op.rc == KILLED:
            self.storm.count("armed" if crash else "timed")

    def _choose(self, log: RunLog) -> tuple[str | None, float | None]:
        in_a_row = 0
        for op in reversed(log.ops):
            if op.rc != KILLED:
                break
            in_a_row += 1
        if in_a_row >= MAX_KILLS_IN_A_ROW or len(log.ops) >= MAX_OPS_PER_RUN:
            return None, None
        op, dice = log.next_command()["op"], self.rng.random()
        if op == "run" and dice < 0.5:
            return f"{self.rng.choice(RUN_POINTS)}@{self.rng.randint(1, 4)}", None
        if op == "approve" and dice < 0.35:
            return self.rng.choice(APPROVE_POINTS), None
        if op == "run" or dice < 0.7:
            return None, self.rng.uniform(0, MAX_DELAY)
        return None, None


def _storm_seed() -> int:
    return int(os.environ.get("ASIENTO_STORM_SEED") or time.time_ns() % 2**32)


def _interleavings(db: Path) -> int:
    """How often consecutive journal rows belong to different runs."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        runs = [r[0] for r in con.execute("SELECT run_id FROM journal ORDER BY rowid")]
    finally:
        con.close()
    return sum(a != b for a, b in itertools.pairwise(runs))


def _tally(logs: list[RunLog]) -> dict[str, int]:
    """What the kills hit: mid-pass (after a commit), uncertain stops, repeated work."""
    tally: Counter[str] = Counter()
    for log in logs:
        for op, after in itertools.pairwise(log.ops):
            tally["kills after a commit"] += op.rc == KILLED and after.before != op.before
            tally["uncertain stops"] += op.rc == 3
        keys = Counter(line["key"] for line in log.model_lines())
        tally["model requests repeated (not recorded)"] += sum(n - 1 for n in keys.values())
        steps = Counter(line["step"] for line in log.effect_lines())
        tally["idempotent re-runs"] += sum(n - 1 for n in steps.values())
    return dict(tally)


def _campaign(storm: Storm, tmp_path: Path) -> list[RunLog]:
    servers = [ForkServer(tmp_path / f"server{i}.err") for i in range(WORKERS)]
    try:
        workers = [Worker(storm, i, s) for i, s in enumerate(servers)]
        with ThreadPoolExecutor(WORKERS) as pool:
            futures = [pool.submit(w.campaign) for w in workers]
            errors = [f.exception() for f in futures]
        tails = "\n".join(s.stderr_tail(2000) for s in servers)
        failed = [e for e in errors if e is not None]
        assert not failed, f"seed={storm.seed}: {failed[0]!r}\n{tails}"
        return [log for f in futures for log in f.result()]
    finally:
        for server in servers:
            server.close()


@pytest.mark.slow
def test_kill_storm(tmp_path: Path) -> None:
    """Hundreds of random SIGKILLs never repeat an effect or a paid answer, nor lose a run."""
    seed, started = _storm_seed(), time.monotonic()
    print(f"kill storm: ASIENTO_STORM_SEED={seed}")
    (tmp_path / "ledgers").mkdir()
    kills_wanted = int(os.environ.get("ASIENTO_STORM_KILLS") or 300)
    storm = Storm(
        seed, tmp_path / "storm.db", tmp_path / "ledgers", kills_wanted, started + WALL_CLOCK
    )
    logs = _campaign(storm, tmp_path)
    found = [v for log in logs for v in violations(log)]
    assert not found, f"seed={seed}: {len(found)} violations:\n" + "\n".join(found[:40])
    assert all(log.closed for log in logs), f"seed={seed}: a run did not close"
    assert integrity(storm.db) == "ok", f"seed={seed}"
    assert _interleavings(storm.db) > len(logs), f"seed={seed}: the runs did not interleave"
    kills, elapsed = storm.kills, time.monotonic() - started
    early = "" if kills.total() >= kills_wanted else f" (stopped early at {WALL_CLOCK:.0f} s)"
    print(
        f"kill storm seed={seed}: {kills.total()} SIGKILLs {dict(kills)}, {len(logs)} runs, "
        f"{sum(len(log.ops) for log in logs)} operations in {elapsed:.1f} s{early}; {_tally(logs)}"
    )
    if kills.total() >= 20:
        assert kills["armed"], f"seed={seed}: no armed crash point ever fired: {kills}"
        assert kills["timed"], f"seed={seed}: no timed SIGKILL ever landed: {kills}"
