"""Worker fleets on a real PostgreSQL, started by the tests: races, a stopped holder,
terminated connections, server restarts and outages, SIGKILLed workers, approvals, parking.

Every worker is a real process (worker_child.py) running ``asiento.Worker``; its
effects go to an fsynced ledger file, its store's claims and leased appends to a
log, and the tests check the ledger (no effect twice), the journal (closed runs,
no stale write after a takeover) and the run listing.

What the core does, as these tests found it:

- ``claim()`` takes only runs whose lease is free or expired: a worker SIGKILLed on
  this host keeps its run until the lease expires (``Session`` on the same run would
  take it at once, as a provably dead holder). Hence the short leases here.
- During an outage the connection pool waits (up to its 30 s timeout) for the server
  to come back, so a restart shorter than the lease is ridden out; one longer than the
  lease expires it, and a step whose tool finished meanwhile ends ``uncertain``.
- ``Worker.run`` lets a ``JournalError`` from ``claim()`` end it (``asiento worker``
  then exits 1 for its service manager to restart); worker_child.py restarts it and
  logs each restart. The outages here never got that far.
- Core bug: the lease is renewed by a task on the event loop, and a plain (sync) tool
  runs in the loop's thread: a plain tool longer than the lease loses it to another
  worker (test_plain_tool_longer_than_the_lease_keeps_it fails).

Replay the random schedules with ``ASIENTO_FLEET_SEED=<seed>`` (printed on failure).
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from asiento import Holder, Lease, RunInfo, RunLocked, RunStatus, submit
from asiento.journal.postgres import PostgresCheckpointer
from journal import pg_server

from .conftest import (
    CHILD,
    Fleet,
    app_name,
    decided_runs_resume,
    drain_while_killing,
    fencing_violations,
    ledger,
    poison_run_is_parked,
    race_rounds,
    seed,
    settle,
    submit_runs,
    wait_for,
)


def ours(cluster: pg_server.Cluster) -> None:
    """Restarts need the server the tests started, not one ASIENTO_TEST_PG_DSN names."""
    if cluster.local is None:
        pytest.skip(f"the tests cannot restart the server {pg_server.ENV_VAR} names")


async def test_racing_resumers_one_drives_each_round(
    pg_store: PostgresCheckpointer, pg_url: str, tmp_path: Path
) -> None:
    """Four processes resume the same run at once, 20 times: one drives, three get RunLocked."""
    await race_rounds(pg_store, pg_url, tmp_path, rounds=20)


def spawn_session(url: str, folder: Path, run_id: str, *options: str) -> subprocess.Popen[bytes]:
    """A worker_child.py session process driving ``run_id`` with agent ``hold``."""
    errors = (folder / f"stderr.session.{time.monotonic_ns()}").open("wb")
    with errors:
        argv = [sys.executable, str(CHILD), "session", url, str(folder), run_id, *options]
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors)


async def test_stopped_holder_past_its_lease_is_fenced_off(
    pg_store: PostgresCheckpointer, pg_url: str, tmp_path: Path
) -> None:
    """A holder SIGSTOPped past its lease is taken over; continued, it writes and sends nothing."""
    stale = spawn_session(pg_url, tmp_path, "run-1", "--ttl", "1")
    try:
        await asyncio.to_thread(wait_for, (tmp_path / "started.run-1").exists, 30, "started")
        stale.send_signal(signal.SIGSTOP)
        try:
            (tmp_path / "go").touch()
            taker = spawn_session(pg_url, tmp_path, "run-1", "--ttl", "5", "--wait", "15")
            assert await asyncio.to_thread(taker.wait, 40) == 0
            after_takeover = await pg_store.load("run-1")
            listed = await pg_store.runs()
        finally:
            stale.send_signal(signal.SIGCONT)
        assert await asyncio.to_thread(stale.wait, 30) == 76  # LeaseLost at its first write
    finally:
        stale.kill()
    assert await pg_store.load("run-1") == after_takeover
    assert await pg_store.runs() == listed
    assert ledger(tmp_path) == {"run-1": [taker.pid]}
    [run] = listed
    assert (run.status, run.fence) == (RunStatus.CLOSED, 2)


async def test_stopped_holder_starts_no_effect_after_a_takeover(
    pg_store: PostgresCheckpointer, pg_url: str, tmp_path: Path
) -> None:
    """A stopped holder whose lease was taken resumes: it writes nothing and sends nothing."""
    stale = spawn_session(pg_url, tmp_path, "run-1", "--ttl", "1")
    try:
        await asyncio.to_thread(wait_for, (tmp_path / "started.run-1").exists, 30, "started")
        stale.send_signal(signal.SIGSTOP)
        try:
            lease = await until_acquired(pg_store, "run-1")
            before = await pg_store.load("run-1")
            (tmp_path / "go").touch()
        finally:
            stale.send_signal(signal.SIGCONT)
        # Its next writes (the tool's result, then send's intent) collide with nothing:
        # only the fencing token stands between it and the effect.
        assert await asyncio.to_thread(stale.wait, 30) == 76
    finally:
        stale.kill()
    assert await pg_store.load("run-1") == before
    assert ledger(tmp_path) == {}
    await pg_store.release(lease)
    resumed = spawn_session(pg_url, tmp_path, "run-1")
    assert await asyncio.to_thread(resumed.wait, 40) == 0
    assert ledger(tmp_path) == {"run-1": [resumed.pid]}


async def until_acquired(store: PostgresCheckpointer, run_id: str) -> Lease:
    """Take the run's lease as soon as its holder's expires (10 s at most)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return await store.acquire(run_id, Holder.here(), ttl=60)
        except RunLocked:
            assert time.monotonic() < deadline, "the stopped holder's lease never expired"
            await asyncio.sleep(0.05)


class Terminator(threading.Thread):
    """Terminates every backend of the workers at random moments, a bounded number of times."""

    def __init__(self, dsn: str, rng: random.Random, rounds: int) -> None:
        super().__init__(daemon=True)
        self.admin = make_conninfo(dsn, application_name="asiento-test-terminator")
        self.victims, self.rng, self.rounds = app_name(dsn), rng, rounds
        self.terminated = 0
        self.halt = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.admin, autocommit=True) as conn:
            for _ in range(self.rounds):
                if self.halt.wait(self.rng.uniform(0.05, 0.25)):
                    return
                found = conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = %s",
                    (self.victims,),
                ).fetchall()
                self.terminated += len(found)


async def test_fleet_rides_out_terminated_connections(
    pg_store: PostgresCheckpointer, pg_url: str, pg_dsn: str, fleet_factory: Callable[[str], Fleet]
) -> None:
    """Backends terminated at random while 2 workers drain 60 runs: all close, each effect once."""
    run_ids = await submit_runs(pg_store, 60, "send")
    fleet = fleet_factory(pg_url)
    fleet.start(2, "--delay", "0.03")
    await asyncio.to_thread(
        wait_for, lambda: sum(e["ev"] == "ready" for e in fleet.logs()) >= 2, 30, "ready"
    )
    terminator = Terminator(pg_dsn, random.Random(seed()), rounds=30)
    terminator.start()
    try:
        final = await settle(pg_store, 90)
    finally:
        terminator.halt.set()
        await asyncio.to_thread(terminator.join, 10)
    assert terminator.terminated >= 3
    assert fleet.stop() == [75, 75], fleet.stderr()
    assert [(r.run_id, r.status) for r in final] == [(r, RunStatus.CLOSED) for r in run_ids], (
        fleet.stderr()
    )
    assert fleet.ledger() == Counter(dict.fromkeys(run_ids, 1))
    assert await fencing_violations(pg_store, fleet.logs()) == []
    print(f"terminated {terminator.terminated} backends; restarts {restarts(fleet)}")


def restarts(fleet: Fleet) -> int:
    """How often worker_child.py had to restart a Worker.run that a JournalError ended."""
    return sum(e["ev"] == "restart" for e in fleet.logs())


def closed_at_least(count: int) -> Callable[[list[RunInfo]], bool]:
    return lambda runs: sum(r.status is RunStatus.CLOSED for r in runs) >= count


async def test_fleet_rides_out_server_restarts(
    pg_store: PostgresCheckpointer,
    pg_url: str,
    pg_cluster: pg_server.Cluster,
    fleet_factory: Callable[[str], Fleet],
) -> None:
    """A clean restart, then a crash restart, mid-drain: every run closes, each effect once."""
    ours(pg_cluster)
    run_ids = await submit_runs(pg_store, 40, "send")
    fleet = fleet_factory(pg_url)
    fleet.start(2, "--delay", "0.05", "--ttl", "10")
    await settle(pg_store, 60, until=closed_at_least(5))
    await asyncio.to_thread(pg_cluster.restart, "fast")
    await settle(pg_store, 60, until=closed_at_least(20))
    await asyncio.to_thread(pg_cluster.restart, "immediate")
    final = await settle(pg_store, 90)
    assert fleet.stop() == [75, 75], fleet.stderr()
    assert [(r.run_id, r.status) for r in final] == [(r, RunStatus.CLOSED) for r in run_ids]
    assert fleet.ledger() == Counter(dict.fromkeys(run_ids, 1))
    assert await fencing_violations(pg_store, fleet.logs()) == []
    print(f"worker restarts after JournalError: {restarts(fleet)}")


async def test_sigterm_while_the_server_is_down_exits_75_without_waiting_for_the_pool(
    pg_store: PostgresCheckpointer,
    pg_cluster: pg_server.Cluster,
    pg_url: str,
    fleet_factory: Callable[[str], Fleet],
) -> None:
    """An idle worker whose claim waits for a dead server stops on SIGTERM, not 30 s later."""
    ours(pg_cluster)
    fleet = fleet_factory(pg_url)
    [worker] = fleet.start(1, "--poll", "0.05")
    await asyncio.to_thread(wait_for, lambda: any(e["ev"] == "ready" for e in fleet.logs()), 30)
    await asyncio.to_thread(pg_cluster.halt, "fast")
    try:
        await asyncio.sleep(1.0)  # its claims now wait for a connection (the pool's 30 s)
        worker.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = await asyncio.to_thread(worker.wait, 60)
        waited = time.monotonic() - started
    finally:
        await asyncio.to_thread(pg_cluster.resume)
    assert code == 75, fleet.stderr()
    assert waited < 20, f"the worker waited {waited:.1f} s for the pool instead of stopping"
    fleet.live.remove(worker)


async def outage_during_tool(
    store: PostgresCheckpointer, cluster: pg_server.Cluster, fleet: Fleet, ttl: str, down: float
) -> RunInfo:
    """Stop the server while a tool runs, let the tool finish, start it ``down`` s later."""
    await submit(store, "gated", "gated", agent="gated")
    fleet.start(1, "--ttl", ttl)
    await asyncio.to_thread(wait_for, (fleet.folder / "started.gated").exists, 30, "tool")
    await asyncio.to_thread(cluster.halt, "fast")
    try:
        (fleet.folder / "go").touch()
        await asyncio.sleep(down)
    finally:
        await asyncio.to_thread(cluster.resume)
    [run] = await settle(store, 60)
    assert fleet.stop() == [75], fleet.stderr()
    assert fleet.ledger() == Counter({"gated": 1})
    return run


async def test_outage_shorter_than_the_lease_is_ridden_out(
    pg_store: PostgresCheckpointer,
    pg_cluster: pg_server.Cluster,
    pg_url: str,
    fleet_factory: Callable[[str], Fleet],
) -> None:
    """Server down for 2 s while a tool runs, lease 10 s: the result is recorded, the run closes."""
    ours(pg_cluster)
    run = await outage_during_tool(pg_store, pg_cluster, fleet_factory(pg_url), "10", 2.0)
    assert (run.status, run.fence) == (RunStatus.CLOSED, 1)


async def test_outage_longer_than_the_lease_leaves_the_effect_uncertain(
    pg_store: PostgresCheckpointer,
    pg_cluster: pg_server.Cluster,
    pg_url: str,
    fleet_factory: Callable[[str], Fleet],
) -> None:
    """Server down past a 1 s lease while a tool runs: its result is refused, run uncertain."""
    ours(pg_cluster)
    fleet = fleet_factory(pg_url)
    run = await outage_during_tool(pg_store, pg_cluster, fleet, "1", 2.5)
    assert run.status is RunStatus.UNCERTAIN
    refused = [e for e in fleet.logs() if e["ev"] == "lease-lost"]
    assert [e["keys"] for e in refused] == [[["m1.t1", "result"]]]
    phases = [(e.step_id, str(e.phase)) for e in await pg_store.load("gated")]
    assert phases == [("m1", "result"), ("m1.t1", "intent"), ("m1.t1", "submitted")]


async def test_fleet_of_four_drains_200_runs_while_workers_are_killed(
    pg_store: PostgresCheckpointer, pg_url: str, fleet_factory: Callable[[str], Fleet]
) -> None:
    """4 workers drain 200 runs while 8 are SIGKILLed and replaced: none twice, all settled."""
    started = time.monotonic()
    fleet = fleet_factory(pg_url)
    statuses = await drain_while_killing(pg_store, fleet, workers=4, runs=200, kills=8, seed=seed())
    print(f"{fleet.kills} kills, statuses {dict(statuses)}, {time.monotonic() - started:.1f}s")


async def test_plain_tool_longer_than_the_lease_keeps_it(
    pg_store: PostgresCheckpointer, pg_url: str, fleet_factory: Callable[[str], Fleet]
) -> None:
    """A plain (sync) tool running 2.5 s under a 1 s lease keeps it: no worker takes over."""
    await submit(pg_store, "long", "long", agent="long")
    fleet = fleet_factory(pg_url)
    fleet.start(2, "--ttl", "1", "--delay", "2.5")
    [run] = await settle(pg_store, 30)
    assert fleet.stop() == [75, 75], fleet.stderr()
    assert fleet.ledger() == Counter({"long": 1})
    refused = [e["keys"] for e in fleet.logs() if e["ev"] == "lease-lost"]
    outcome = (run.status, run.fence, refused)
    assert outcome == (RunStatus.CLOSED, 1, []), f"taken over while its tool ran: {outcome}"


async def test_suspended_runs_are_resumed_once_decided(
    pg_store: PostgresCheckpointer, pg_url: str, fleet_factory: Callable[[str], Fleet]
) -> None:
    """Suspended runs wait for a decision; then a worker picks them up and closes them."""
    await decided_runs_resume(pg_store, fleet_factory(pg_url))


async def test_run_that_kills_its_workers_is_parked(
    pg_store: PostgresCheckpointer, pg_url: str, fleet_factory: Callable[[str], Fleet]
) -> None:
    """A run whose tool SIGKILLs each worker is parked after 3 claims, with the reason."""
    await poison_run_is_parked(pg_store, fleet_factory(pg_url))
