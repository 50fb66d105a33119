"""Group commit on SQLite: appends ready together share one commit, each keeps its own error."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from asiento import (
    DuplicateRecord,
    Holder,
    LeaseLost,
    Phase,
    RunClosed,
    RunStatus,
    SqliteCheckpointer,
    StepEvent,
)
from asiento.journal._sqlite_writer import StoreThread

BENCH = Path(__file__).resolve().parents[2] / "bench" / "group_commit.py"


def ev(run_id: str, step_id: str, phase: Phase = Phase.RESULT) -> StepEvent:
    return StepEvent(run_id=run_id, step_id=step_id, phase=phase, payload={"n": 1})


def count_commits(store: SqliteCheckpointer) -> list[str]:
    """The COMMIT statements the store's connection runs from now on."""
    seen: list[str] = []
    store._db.set_trace_callback(lambda sql: seen.append(sql) if "COMMIT" in sql.upper() else None)
    return seen


async def test_appends_of_many_runs_share_one_commit(sqlite_path: Path) -> None:
    store = SqliteCheckpointer(sqlite_path)
    try:
        commits = count_commits(store)
        await asyncio.gather(*(store.append(ev(f"run-{i}", "m1")) for i in range(20)))
        assert len(commits) == 1, commits
        for i in range(20):  # and this process reads each of them back
            assert [e.step_id for e in await store.load(f"run-{i}")] == ["m1"]
        await store.append(ev("run-0", "m2"))  # alone: a commit of its own, at once
        assert len(commits) == 2, commits
    finally:
        await store.close()


async def test_a_refused_append_fails_alone_with_its_own_error(sqlite_path: Path) -> None:
    store = SqliteCheckpointer(sqlite_path)
    try:
        await store.append(ev("dup", "m1"))
        await store.append(ev("closed", "m1"), status="closed")
        lease = await store.acquire("leased", Holder.here(), ttl=30)
        await store.acquire("leased", Holder.here(), ttl=30, force=True)  # the lease is lost
        commits = count_commits(store)
        outcomes = await asyncio.gather(
            store.append(ev("ok-1", "m1")),
            store.append(ev("dup", "m2"), ev("dup", "m1")),
            store.append(ev("closed", "m2")),
            store.append(ev("leased", "m1"), lease=lease),
            store.append(ev("ok-2", "m1")),
            return_exceptions=True,
        )
        assert len(commits) == 1, commits
        assert outcomes[0] is None
        assert outcomes[4] is None
        assert isinstance(outcomes[1], DuplicateRecord)
        assert outcomes[1].step_id == "m1"
        assert isinstance(outcomes[2], RunClosed)
        assert isinstance(outcomes[3], LeaseLost)
        assert [e.step_id for e in await store.load("dup")] == ["m1"]  # m2 rolled back with it
        assert [e.step_id for e in await store.load("closed")] == ["m1"]
        assert await store.load("leased") == []
        for run_id in ("ok-1", "ok-2"):
            assert [e.step_id for e in await store.load(run_id)] == ["m1"]
    finally:
        await store.close()
    with sqlite3.connect(sqlite_path) as con:  # what another process sees
        assert con.execute("SELECT count(*) FROM journal").fetchone() == (4,)


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_fsyncs_per_step_fall_with_concurrent_runs(tmp_path: Path) -> None:
    """bench/group_commit.py: exactly 2 fsync-class calls per step alone, far fewer at 16."""
    done = subprocess.run(
        [sys.executable, str(BENCH), "--runs", "1", "16", "--steps", "4", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = {}
    for line in done.stdout.splitlines():
        cells = line.split()
        if len(cells) == 2 and cells[0].isdigit():
            figures[int(cells[0])] = float(cells[1])
    assert figures[1] == 2.0, done.stdout
    assert figures[16] < 1.0, done.stdout


async def test_a_cancelled_leader_still_commits_its_batch(sqlite_path: Path) -> None:
    """The append that leads a batch is cancelled while it yields: every append still commits."""
    store = SqliteCheckpointer(sqlite_path)
    try:
        commits = count_commits(store)
        leader = asyncio.ensure_future(store.append(ev("run-0", "m1")))
        others = [asyncio.ensure_future(store.append(ev(f"run-{i}", "m1"))) for i in (1, 2)]
        await asyncio.sleep(0)  # the leader queued its append and yields; the others join
        leader.cancel()
        await asyncio.wait_for(asyncio.gather(*others), 30)  # bounded, were the batch lost
        with pytest.raises(asyncio.CancelledError):
            await leader
        assert len(commits) == 1, commits
        for i in range(3):
            assert [e.step_id for e in await store.load(f"run-{i}")] == ["m1"]
    finally:
        await store.close()


def test_a_store_serves_one_loop_after_another(sqlite_path: Path) -> None:
    """asyncio.run twice on one store (the second loop finds nothing left queued)."""
    store = SqliteCheckpointer(sqlite_path)

    async def batch(step: str) -> None:
        await asyncio.gather(*(store.append(ev(f"run-{i}", step)) for i in range(3)))

    asyncio.run(batch("m1"))
    asyncio.run(batch("m2"))
    loaded = asyncio.run(store.load("run-2"))
    asyncio.run(store.close())
    assert [e.step_id for e in loaded] == ["m1", "m2"]


def count_statements(store: SqliteCheckpointer, prefix: str) -> list[str]:
    """The statements starting with ``prefix`` the store's connection runs from now on."""
    seen: list[str] = []
    store._db.set_trace_callback(
        lambda sql: seen.append(sql) if sql.lstrip().upper().startswith(prefix) else None
    )
    return seen


async def test_plain_appends_of_many_runs_take_two_statements(sqlite_path: Path) -> None:
    """Leased appends of 30 runs, a third of them their run's last: two UPDATEs of the
    index and one INSERT, whatever their number (each statement off the loop gives the
    GIL up and waits to get it back)."""
    store = SqliteCheckpointer(sqlite_path)
    try:
        leases = [await store.acquire(f"run-{i}", Holder.here(), ttl=30) for i in range(30)]
        updates = count_statements(store, "UPDATE RUNS")
        status = [RunStatus.CLOSED if i % 3 == 0 else None for i in range(30)]
        await asyncio.gather(
            *(
                store.append(ev(f"run-{i}", "m1"), lease=leases[i], status=status[i])
                for i in range(30)
            )
        )
        assert len(updates) == 2, updates  # the appends that change the status, and the others
        for i in range(30):
            assert [e.step_id for e in await store.load(f"run-{i}")] == ["m1"]
            info = await store.run(f"run-{i}")
            assert info is not None
            assert (info.events, info.status) == (1, status[i] or RunStatus.RUNNING)
    finally:
        await store.close()


async def test_a_refused_plain_append_still_fails_alone(sqlite_path: Path) -> None:
    """Among leased appends, a lost lease and a record already there fail alone; the
    others commit, in the same one commit."""
    store = SqliteCheckpointer(sqlite_path)
    try:
        leases = [await store.acquire(f"run-{i}", Holder.here(), ttl=30) for i in range(5)]
        await store.append(ev("run-3", "m1"), lease=leases[3])
        await store.acquire("run-1", Holder.here(), ttl=30, force=True)  # run-1's lease is lost
        commits = count_commits(store)
        outcomes = await asyncio.gather(
            *(store.append(ev(f"run-{i}", "m1"), lease=leases[i]) for i in range(5)),
            return_exceptions=True,
        )
        assert len(commits) == 1, commits
        assert isinstance(outcomes[1], LeaseLost)
        assert isinstance(outcomes[3], DuplicateRecord)
        assert [outcomes[i] for i in (0, 2, 4)] == [None, None, None]
        for i, expected in enumerate([1, 0, 1, 1, 1]):
            assert len(await store.load(f"run-{i}")) == expected
            assert (await store.run(f"run-{i}")).events == expected  # type: ignore[union-attr]
    finally:
        await store.close()


async def test_a_write_waiting_for_another_process_never_holds_the_loop(
    sqlite_path: Path,
) -> None:
    """Another connection holds the write lock for 0.5 s: the renewal waiting for it
    waits on the store's thread, and the event loop goes on meanwhile."""
    store = SqliteCheckpointer(sqlite_path)
    other = sqlite3.connect(sqlite_path, isolation_level=None)
    try:
        lease = await store.acquire("run-0", Holder.here(), ttl=30)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        other.execute("BEGIN IMMEDIATE")
        running = asyncio.create_task(ticker())
        renewing = asyncio.ensure_future(store.renew(lease, ttl=30))
        await asyncio.sleep(0.5)
        assert not renewing.done()  # it waits for the lock...
        other.execute("COMMIT")
        await asyncio.wait_for(renewing, 30)
        running.cancel()
        assert ticks >= 10, f"the loop ticked {ticks} times in 0.5 s"  # ...and the loop ran
    finally:
        other.close()
        await store.close()


async def test_an_urgent_call_goes_ahead_of_the_work_queued() -> None:
    """A lease renewal waits for the work running, never for the work queued behind it."""
    thread = StoreThread("test")
    release, order = threading.Event(), []

    def blocking() -> None:
        release.wait(10)
        order.append("running")

    def note(name: str) -> None:
        order.append(name)

    first = asyncio.ensure_future(thread.send(blocking))
    await asyncio.sleep(0.05)  # the thread is in it
    queued = [asyncio.ensure_future(thread.send(note, f"queued-{n}")) for n in range(3)]
    await asyncio.sleep(0)
    urgent = asyncio.ensure_future(thread.send(note, "urgent", urgent=True))
    await asyncio.sleep(0.05)
    release.set()
    await asyncio.wait_for(asyncio.gather(first, *queued, urgent), 10)
    thread.stop()
    assert order == ["running", "urgent", "queued-0", "queued-1", "queued-2"]
