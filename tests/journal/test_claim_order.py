"""The queue claims read stays out of the appends' way, and keeps its order across upgrades.

Claims order runs by ``queued_at`` (``journal._rules``), which a plain append never
changes: on PostgreSQL no column any index of ``runs`` holds changes on such an
append, so the run's row is updated in place (HOT) instead of adding an entry to
every index at every step (issue 14, item 6).
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg
import pytest

from asiento import (
    Agent,
    Checkpointer,
    FinalStep,
    ModelResponse,
    Phase,
    Session,
    SqliteCheckpointer,
    StepEvent,
    ToolCall,
    tool,
)
from asiento.journal import _postgres_schema as pg_schema
from asiento.journal import _sqlite_schema as sqlite_schema
from asiento.journal.postgres import PostgresCheckpointer
from asiento.lease import Holder
from asiento.testing import ScriptedGateway
from asiento.testing.postgres import hot_updates

# Submitted runs as the previous schema's asiento left them: claims took them by their
# last update (``updated_at``), which is not the order of their ids nor of their creation.
QUEUED = {"b": (1.0, 40.0), "d": (2.0, 10.0), "a": (3.0, 30.0), "c": (4.0, 20.0)}
OLD_ORDER = ["d", "c", "a", "b"]  # by updated_at


def queued_rows() -> list[dict[str, Any]]:
    return [
        {"run_id": run_id, "status": "running", "events": 0, "created_at": created,
         "updated_at": updated, "task": f"task {run_id}", "agent": "default"}
        for run_id, (created, updated) in QUEUED.items()
    ]  # fmt: skip


def sqlite_before(path: Path) -> None:
    """A journal file at the schema before ``queued_at`` (3), holding QUEUED."""
    with closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("BEGIN")
        for migration in sqlite_schema.MIGRATIONS[:3]:
            for statement in migration.split(";"):
                if statement.strip():
                    db.execute(statement)
        db.execute("PRAGMA user_version = 3")
        db.execute(f"PRAGMA application_id = {sqlite_schema.APPLICATION_ID}")
        for row in queued_rows():
            names, marks = ", ".join(row), ", ".join("?" * len(row))
            db.execute(f"INSERT INTO runs ({names}) VALUES ({marks})", list(row.values()))
        db.execute("COMMIT")


def postgres_before(dsn: str) -> None:
    """The test's schema at the schema before ``queued_at`` (4), holding QUEUED."""
    with psycopg.connect(dsn) as conn:
        conn.execute(pg_schema.CREATE_VERSIONS)
        for number, migration in enumerate(pg_schema.MIGRATIONS[:4], 1):
            for statement in migration:
                conn.execute(statement)
            conn.execute("INSERT INTO asiento_schema (version) VALUES (%s)", (number,))
        for row in queued_rows():
            names, marks = ", ".join(row), ", ".join(["%s"] * len(row))
            conn.execute(f"INSERT INTO runs ({names}) VALUES ({marks})", list(row.values()))


async def claim_order(store: Checkpointer) -> list[str]:
    """The order claims take every queued run in, one claim at a time."""
    taken = []
    for _ in range(len(QUEUED) + 1):
        claim = await store.claim(Holder.here(), ttl=30)
        if claim is None:
            break
        taken.append(claim.lease.run_id)
    return taken


@pytest.mark.parametrize("claims", ["one by one", "in one claim_many"])
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_an_upgraded_journal_keeps_its_queue_order(
    backend: str, claims: str, request: pytest.FixtureRequest
) -> None:
    """Runs queued under the previous schema are claimed, after the upgrade, in the order
    the previous asiento would have claimed them (their last update first); on
    PostgreSQL ``runs`` has the fill factor that leaves room for in-place updates."""
    store: Checkpointer
    if backend == "sqlite":
        path = request.getfixturevalue("tmp_path") / "runs.db"
        sqlite_before(path)
        store = SqliteCheckpointer(path)
    else:
        dsn = request.getfixturevalue("pg_dsn")
        postgres_before(dsn)
        store = await PostgresCheckpointer.connect(dsn, max_size=1)
        with psycopg.connect(dsn) as conn:
            found = conn.execute("SELECT reloptions FROM pg_class WHERE oid = 'runs'::regclass")
            assert found.fetchone() == ([f"fillfactor={pg_schema.FILLFACTOR}"],)
    try:
        if claims == "one by one":
            assert await claim_order(store) == OLD_ORDER
        else:
            many = await store.claim_many(Holder.here(), limit=len(QUEUED), ttl=30)
            assert [claim.lease.run_id for claim in many] == OLD_ORDER
    finally:
        await store.close()


async def test_a_claimed_run_goes_to_the_back_of_the_queue(tmp_path: Path) -> None:
    """A claim sends the run behind those waiting (so claims do not walk past the runs in
    flight): its lease expired, it is claimed again after the runs queued before its claim."""
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        await store.submit("first", "t")
        await store.submit("second", "t")
        lost = await store.claim(Holder.here(), ttl=0.05)
        assert lost is not None
        assert lost.lease.run_id == "first"
        await asyncio.sleep(0.2)  # the first claim's lease expired
        assert await claim_order(store) == ["second", "first"]
    finally:
        await store.close()


async def test_the_sqlite_claim_reads_the_index_of_claimable_runs(tmp_path: Path) -> None:
    """SQLite finds the next run to claim in ``runs_claimable``, not by sorting the table."""
    store = SqliteCheckpointer(tmp_path / "runs.db")
    await store.close()
    from asiento.journal.sqlite import _CLAIMABLE

    with closing(sqlite3.connect(tmp_path / "runs.db")) as db:
        plan = db.execute("EXPLAIN QUERY PLAN " + _CLAIMABLE, {"now": 0.0}).fetchall()
    details = " ".join(str(row[-1]) for row in plan)
    assert "runs_claimable" in details
    assert "TEMP B-TREE" not in details


# -- PostgreSQL: a plain append changes no indexed column, and is a HOT update -------------


def indexed_columns(conn: psycopg.Connection[Any]) -> set[str]:
    """Every column of ``runs`` an index holds or its predicate reads (what decides HOT)."""
    rows = conn.execute(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a"
        " ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
        " WHERE i.indrelid = 'runs'::regclass"
    ).fetchall()
    columns = {name for (name,) in rows}
    every = {name for (name,) in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = 'runs'::regclass AND attnum > 0"
    ).fetchall()}  # fmt: skip
    for (predicate,) in conn.execute(
        "SELECT pg_get_expr(indpred, indrelid) FROM pg_index"
        " WHERE indrelid = 'runs'::regclass AND indpred IS NOT NULL"
    ).fetchall():
        columns |= {word for word in re.findall(r"[a-z_]+", predicate) if word in every}
    return columns


@tool(idempotent=True)
def step(n: int) -> int:
    """A trivial tool."""
    return n


def script(steps: int) -> ScriptedGateway:
    """``steps`` model+tool steps, then a final answer."""
    asks = [
        ModelResponse(text="", tool_calls=[ToolCall(name="step", arguments={"n": n})])
        for n in range(steps)
    ]
    return ScriptedGateway([*asks, ModelResponse(text="done")])


async def test_a_plain_append_changes_no_column_an_index_of_runs_reads(pg_dsn: str) -> None:
    """The loop's append of a step (status unchanged) leaves every column any index of
    ``runs`` holds, or filters on, as it was: the update can be HOT."""
    store = await PostgresCheckpointer.connect(pg_dsn, max_size=1)
    try:
        await store.submit("run-1", "task")
        claim = await store.claim(Holder.here(), ttl=30)
        assert claim is not None
        with psycopg.connect(pg_dsn) as conn:
            columns = sorted(indexed_columns(conn))
            assert {"status", "task", "run_id"} <= set(columns)
            query = f"SELECT {', '.join(columns)} FROM runs WHERE run_id = 'run-1'"
            before = conn.execute(query).fetchone()
            event = StepEvent(run_id="run-1", step_id="m1", phase=Phase.RESULT, payload={})
            await store.append(event, lease=claim.lease)
            after = conn.execute(query).fetchone()
        assert dict(zip(columns, after or (), strict=True)) == dict(
            zip(columns, before or (), strict=True)
        )
    finally:
        await store.close()


async def settled_updates(dsn: str, at_least: int) -> tuple[int, int]:
    """The counts once the closed backends' statistics reached the view (bounded wait)."""
    deadline = time.monotonic() + 20.0
    counts = hot_updates(dsn)
    while counts[0] < at_least and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        counts = hot_updates(dsn)
    return counts


async def test_the_steps_of_a_run_update_its_row_in_place(pg_dsn: str) -> None:
    """A 40-step run on PostgreSQL: almost every update of its ``runs`` row is HOT (before
    this fix, 2 of 83 were: every append set the indexed ``updated_at``)."""
    steps = 40
    store = await PostgresCheckpointer.connect(pg_dsn, max_size=1)
    try:
        session = Session("run-1", script(steps), store)
        done = [s async for s in Agent(tools=[step]).run("count", session=session)]
        assert isinstance(done[-1], FinalStep)
    finally:
        await store.close()  # its backend exits, and reports its statistics
    updates, hot = await settled_updates(pg_dsn, at_least=2 * steps)
    assert updates >= 2 * steps
    assert hot >= 0.9 * updates, (updates, hot)
