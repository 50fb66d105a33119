"""PostgreSQL at fleet scale: claims of many runs in one transaction, and wake-ups
(LISTEN / NOTIFY on ``asiento_work``) instead of polling."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from asiento import Agent, App, Holder, ModelResponse, Phase, RunStatus, Worker
from asiento.journal import _rules as rules
from asiento.journal.postgres import PostgresCheckpointer
from asiento.testing import ScriptedGateway

from .pg_server import host_and_port
from .test_postgres import CommitCutter, admin, app_name, ev, rows, terminate

__all__ = ["admin"]  # the fixture, shared with test_postgres

# A wait that a notification ends is far shorter than this bound; a poll of 30 s is not.
WOKEN_WITHIN = 10.0


def unprepared(store: PostgresCheckpointer) -> PostgresCheckpointer:
    """The store with psycopg's prepared statements off, so that every COMMIT it sends
    says COMMIT on the wire (a prepared one is sent by name)."""
    store._connect["prepare_threshold"] = None
    return store


@pytest.fixture
async def counted(pg_dsn: str) -> AsyncIterator[tuple[PostgresCheckpointer, CommitCutter]]:
    """A store whose connections go through a proxy that counts their COMMITs."""
    counter = CommitCutter(host_and_port(pg_dsn))
    port = await counter.start()
    proxied = make_conninfo(pg_dsn, host="127.0.0.1", port=port, sslmode="disable")
    try:
        async with unprepared(PostgresCheckpointer(proxied, max_size=2)) as store:
            yield store, counter
    finally:
        await counter.close()


async def test_claim_many_takes_the_oldest_up_to_the_limit_in_one_transaction(
    counted: tuple[PostgresCheckpointer, CommitCutter],
) -> None:
    store, counter = counted
    for n in range(5):
        await store.submit(f"run-{n}", f"task {n}")
    holder = Holder.here()
    before = counter.commits
    claims = await store.claim_many(holder, limit=3, ttl=60)
    assert counter.commits - before == 1  # the loop of claims made one transaction a run
    assert [c.lease.run_id for c in claims] == ["run-0", "run-1", "run-2"]
    first = claims[0]
    assert (first.lease.token, first.attempts, first.task) == (1, 1, "task 0")
    runs = {r.run_id: (r.lease_owner, r.fence, r.attempts) for r in await store.runs()}
    assert runs["run-2"] == (holder.owner, 1, 1)
    assert runs["run-3"] == (None, 0, 0)
    rest = await store.claim_many(holder, limit=10, ttl=60)
    assert [c.lease.run_id for c in rest] == ["run-3", "run-4"]
    await store.append(ev("m1", run_id="run-4"), lease=rest[1].lease)  # the leases work


async def test_claim_many_parks_the_over_claimed_as_claim_does(
    counted: tuple[PostgresCheckpointer, CommitCutter], admin: psycopg.AsyncConnection[Any]
) -> None:
    store, counter = counted
    for run_id in ("worn", "mute", "fresh"):
        await store.submit(run_id, "task")
    await admin.execute("UPDATE runs SET attempts = 5, reason = 'boom' WHERE run_id = 'worn'")
    await admin.execute("UPDATE runs SET attempts = 7 WHERE run_id = 'mute'")
    before = counter.commits
    claims = await store.claim_many(Holder.here(), limit=3, ttl=60, max_attempts=5)
    assert counter.commits - before == 1
    assert [c.lease.run_id for c in claims] == ["fresh"]
    found = await rows(admin, "SELECT run_id, status, reason FROM runs ORDER BY run_id")
    assert found == [
        ("fresh", "running", None),
        ("mute", "parked", rules.parked_reason(7, None)),
        ("worn", "parked", rules.parked_reason(5, "boom")),
    ]


async def test_two_claim_many_at_once_never_take_the_same_run(pg_dsn: str) -> None:
    counter = CommitCutter(host_and_port(pg_dsn))
    port = await counter.start()
    proxied = make_conninfo(pg_dsn, host="127.0.0.1", port=port, sslmode="disable")
    try:
        async with (
            unprepared(PostgresCheckpointer(proxied, max_size=1)) as one,
            unprepared(PostgresCheckpointer(proxied, max_size=1)) as two,
        ):
            for n in range(40):
                await one.submit(f"run-{n:02}", "task")
            before = counter.commits
            a, b = await asyncio.gather(
                one.claim_many(Holder.here(), limit=25, ttl=60),
                two.claim_many(Holder.here(), limit=25, ttl=60),
            )
            assert counter.commits - before == 2
            taken_a = {c.lease.run_id for c in a}
            taken_b = {c.lease.run_id for c in b}
            assert not taken_a & taken_b
            assert len(a) + len(b) == 40
    finally:
        await counter.close()


# -- wake-ups -------------------------------------------------------------------------------


async def listener_pids(admin: psycopg.AsyncConnection[Any], dsn: str) -> list[int]:
    query = (
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
        " AND query = 'LISTEN asiento_work'"
    )
    return [pid for (pid,) in await rows(admin, query, app_name(dsn))]


async def listening(store: PostgresCheckpointer) -> None:
    """The store's first wait: it connects, LISTENs, and returns at once (it may have
    missed a notification while it was not listening)."""
    await asyncio.wait_for(store.wait_for_work(30), WOKEN_WITHIN)


async def woken_by(store: PostgresCheckpointer, act: Callable[[], Awaitable[object]]) -> None:
    """``store`` waits (30 s at most); ``act`` (by another store) wakes it long before."""
    waiting = asyncio.create_task(store.wait_for_work(30))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # nothing has been notified yet
    await act()
    await asyncio.wait_for(waiting, WOKEN_WITHIN)


@pytest.fixture
async def two(pg_dsn: str) -> AsyncIterator[tuple[PostgresCheckpointer, PostgresCheckpointer]]:
    """A waiting store and another store that writes, as two workers would have."""
    async with (
        PostgresCheckpointer(pg_dsn, max_size=1) as waiter,
        PostgresCheckpointer(pg_dsn, max_size=1) as other,
    ):
        yield waiter, other


async def test_a_submit_by_another_store_wakes_a_waiting_worker(
    two: tuple[PostgresCheckpointer, PostgresCheckpointer],
) -> None:
    waiter, other = two
    await listening(waiter)
    await woken_by(waiter, lambda: other.submit("run-1", "task"))


async def test_a_release_wakes_a_waiting_worker(
    two: tuple[PostgresCheckpointer, PostgresCheckpointer],
) -> None:
    waiter, other = two
    await other.submit("run-1", "task")
    [claim] = await other.claim_many(Holder.here(), limit=1, ttl=60)
    await listening(waiter)
    await woken_by(waiter, lambda: other.release(claim.lease))


async def test_an_approval_wakes_a_waiting_worker(
    two: tuple[PostgresCheckpointer, PostgresCheckpointer],
) -> None:
    waiter, other = two
    await other.append(ev("m1.t1", Phase.INTENT), status=RunStatus.SUSPENDED)
    await listening(waiter)
    await woken_by(waiter, lambda: other.append(ev("m1.t1", Phase.APPROVAL)))


async def test_a_run_set_running_wakes_a_waiting_worker(
    two: tuple[PostgresCheckpointer, PostgresCheckpointer],
) -> None:
    waiter, other = two
    await other.submit("run-1", "task")
    await other.set_status("run-1", RunStatus.PARKED, reason="test")
    await listening(waiter)
    await woken_by(waiter, lambda: other.set_status("run-1", RunStatus.RUNNING))


async def test_a_lost_listener_falls_back_to_the_poll_and_listens_again(
    two: tuple[PostgresCheckpointer, PostgresCheckpointer], admin: psycopg.AsyncConnection[Any]
) -> None:
    waiter, other = two
    await listening(waiter)
    [old] = await listener_pids(admin, waiter.dsn)
    await terminate(admin, old)
    await asyncio.wait_for(waiter.wait_for_work(0.5), WOKEN_WITHIN)  # no error: a poll
    for _ in range(50):  # the next waits reconnect
        await asyncio.wait_for(waiter.wait_for_work(0.2), WOKEN_WITHIN)
        if [pid for pid in await listener_pids(admin, waiter.dsn) if pid != old]:
            break
    else:
        pytest.fail("the store never listened again")
    await waiter.wait_for_work(0)  # forget the fresh connection's own wake-up
    await woken_by(waiter, lambda: other.submit("run-2", "task"))


async def test_an_idle_worker_starts_a_run_submitted_elsewhere_long_before_its_poll(
    pg_dsn: str, admin: psycopg.AsyncConnection[Any]
) -> None:
    """A worker polling every 30 s drives a run another store submits at once: woken."""
    gateway = ScriptedGateway([ModelResponse(text="done")])
    async with (
        PostgresCheckpointer(pg_dsn, max_size=2) as mine,
        PostgresCheckpointer(pg_dsn, max_size=1) as other,
    ):
        worker = Worker(mine, App(agents={"default": Agent()}, gateway=gateway), poll=30)
        working = asyncio.create_task(worker.run())
        try:
            for _ in range(100):  # until it listens (5 s at most)
                if await listener_pids(admin, mine.dsn):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # it claims once more after listening, finds nothing
            await other.submit("run-1", "task")
            for _ in range(200):  # 10 s at most, a third of the poll
                run = await other.run("run-1")
                if run is not None and run.status is RunStatus.CLOSED:
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("the worker did not start the run before its poll")
        finally:
            working.cancel()
            with contextlib.suppress(BaseException):
                await working


async def test_claim_many_whose_commit_was_cut_off_returns_what_landed(pg_dsn: str) -> None:
    """A claim_many that landed unseen returns the runs it leased, not a run already in
    flight under the same holder, and leases nothing more to strand."""
    cutter = CommitCutter(host_and_port(pg_dsn))
    port = await cutter.start()
    proxied = make_conninfo(pg_dsn, host="127.0.0.1", port=port, sslmode="disable")
    holder = Holder.here()
    try:
        async with unprepared(PostgresCheckpointer(proxied, max_size=2)) as store:
            for run_id in ("a", "b", "c", "d"):
                await store.submit(run_id, f"task {run_id}")
            [in_flight] = await store.claim_many(holder, limit=1, ttl=60)
            assert in_flight.lease.run_id == "a"
            cutter.armed = True
            claims = await asyncio.wait_for(store.claim_many(holder, limit=2, ttl=60), 20)
            assert cutter.cut == 1
            assert [(c.lease.run_id, c.lease.token, c.attempts) for c in claims] == [
                ("b", 1, 1),
                ("c", 1, 1),
            ]
            leased = {r.run_id: (r.lease_owner, r.fence) for r in await store.runs()}
            assert leased["d"] == (None, 0)
            await store.append(ev("m1", run_id="c"), lease=claims[1].lease)  # the lease works
    finally:
        await cutter.close()
