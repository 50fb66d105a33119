"""A run is accountable only for what it did: a poison run beside healthy ones in one worker.

One worker process drives a run whose tool kills the process (a SIGKILL, or the kernel's
OOM killer in a memory cgroup) beside six healthy runs that are waiting on their model
when it dies; a supervisor restarts the worker each time, as systemd would. Only the
poison run is charged for the deaths: it is parked after exactly ``max_attempts`` claims,
naming its tool, and every healthy run closes with its effect applied once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from asiento import Checkpointer, RunStatus, submit
from asiento.journal.postgres import PostgresCheckpointer

from .cgroup import CgroupUnavailable, MemoryCgroup
from .conftest import Fleet, settle, submit_runs

# A lease of 1 s, 3 claims before parking, 8 runs at once, a model that takes 0.5 s an
# answer for the healthy runs (the poison's answers at once: it kills within a moment of
# each claim, while its neighbours wait on their model).
OPTIONS = ("--ttl", "1", "--max-attempts", "3", "--concurrency", "8", "--model-delay", "0.5")
# The OOM killer ends a worker only once its tool has filled the cgroup, which takes a
# while on a loaded machine: the neighbours' model waits longer there, so that they are
# still waiting on it (not inside their non-idempotent tool, which would rightly be
# uncertain) when the kernel kills the worker.
OOM_OPTIONS = (*OPTIONS[:-1], "3")
DEATHS = 3


async def poison_beside_neighbours(
    store: Checkpointer,
    fleet: Fleet,
    *,
    agent: str = "crash",
    workers: int = 1,
    options: tuple[str, ...] = OPTIONS,
) -> None:
    """The poison run is parked after 3 deaths, naming its tool; its 6 neighbours close."""
    await submit(store, "poison", "poison", agent=agent)
    healthy = await submit_runs(store, 6, "send")
    fleet.start(workers, *options)

    def supervise() -> None:
        for code in fleet.reap():
            assert code == -signal.SIGKILL, fleet.stderr()
            fleet.start(1, *options)

    runs = await settle(store, 120, tick=supervise)
    by_id = {r.run_id: r for r in runs}
    assert {by_id[r].status for r in healthy} == {RunStatus.CLOSED}, by_id
    assert fleet.ledger() == Counter(dict.fromkeys(healthy, 1))
    taken_over = [r for r in healthy if by_id[r].fence > 1]
    assert taken_over, "no healthy run was in flight when a worker died"
    claims = [e for e in fleet.logs() if e["ev"] == "claim" and e["run"] in healthy]
    assert max(e["n"] for e in claims) == 1, "a death was counted against a healthy run"
    poison = by_id["poison"]
    assert (poison.status, poison.attempts) == (RunStatus.PARKED, DEATHS), poison
    assert poison.reason == (
        "parked after 3 claims without reaching a stable state; last failure: its worker"
        " died while its tool step m1.t1/3 was in flight"
    )
    assert fleet.exits.count(-signal.SIGKILL) == DEATHS, fleet.stderr()
    assert fleet.stop() == [75] * workers


def shown(url: str, run_id: str) -> str:
    """What ``asiento show RUN_ID --store URL`` prints, run as a real command."""
    argv = [sys.executable, "-m", "asiento", "show", run_id, "--store", url]
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=True)
    return done.stdout


async def test_poison_run_beside_six_healthy_ones_on_sqlite(
    sqlite_store: Checkpointer, sqlite_path: Path, fleet_factory: Callable[[str], Fleet]
) -> None:
    """SQLite: a run whose tool SIGKILLs the worker is parked; none of its 6 neighbours is;
    ``asiento show`` names the tool that was in flight."""
    await poison_beside_neighbours(sqlite_store, fleet_factory(str(sqlite_path)))
    page = shown(str(sqlite_path), "poison")
    assert "in flight: tool 'explode' (step m1.t1/3): its effect left and no outcome" in page


async def test_poison_run_beside_six_healthy_ones_on_postgres(
    pg_store: PostgresCheckpointer, pg_url: str, fleet_factory: Callable[[str], Fleet]
) -> None:
    """PostgreSQL: the same, judged by the claim statement itself."""
    await poison_beside_neighbours(pg_store, fleet_factory(pg_url))


async def test_poison_run_shared_by_two_workers_on_postgres(
    pg_store: PostgresCheckpointer, pg_url: str, fleet_factory: Callable[[str], Fleet]
) -> None:
    """Two worker processes share the runs: the poison kills whichever drives it, 3 times."""
    await poison_beside_neighbours(pg_store, fleet_factory(pg_url), workers=2)


async def test_run_that_ooms_its_worker_is_parked_and_its_neighbours_close(
    sqlite_store: Checkpointer,
    sqlite_path: Path,
    fleet_factory: Callable[[str], Fleet],
    tmp_path: Path,
) -> None:
    """A tool that allocates until the kernel's OOM killer ends the worker (a memory cgroup
    of 400 MiB) is parked after 3 deaths; the 6 neighbours close, each effect once."""
    try:
        group = MemoryCgroup.make(f"asiento-{os.getpid()}-{tmp_path.name}", 400 << 20)
    except CgroupUnavailable as exc:
        pytest.skip(str(exc))
    fleet = fleet_factory(str(sqlite_path))
    fleet.confine = lambda worker: group.add(worker.pid)
    try:
        await poison_beside_neighbours(sqlite_store, fleet, agent="hog", options=OOM_OPTIONS)
    finally:
        fleet.close()
        group.remove()
