"""Journals written at an earlier schema open, upgrade and keep counting right.

Each journal is built with the earlier migrations only, filled the way that
schema's asiento filled it, then opened by this asiento.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest

from asiento import (
    Agent,
    Checkpointer,
    Decision,
    FinalStep,
    JournalBusy,
    MemoryCheckpointer,
    ModelResponse,
    Phase,
    RunInfo,
    Session,
    SqliteCheckpointer,
    StepEvent,
    ToolCall,
    Usage,
    errors,
    tool,
)
from asiento.journal import _postgres_schema as pg_schema
from asiento.journal import _sqlite_schema as sqlite_schema
from asiento.journal.base import counts_of, encode_batch
from asiento.journal.postgres import PostgresCheckpointer
from asiento.testing import ScriptedGateway


def ev(
    run_id: str, step_id: str, phase: Phase, decision: Decision | None = None, **payload: Any
) -> StepEvent:
    """A record of ``run_id``."""
    return StepEvent(
        run_id=run_id, step_id=step_id, phase=phase, decision=decision, payload=payload
    )


def model(
    run_id: str, step_id: str, *calls: str, cache: tuple[int, int] | None = None
) -> StepEvent:
    """A model step that paid 10 tokens in and 2 out and asked for ``calls``; ``cache``:
    of the 10, how many were read from and written to a prompt cache."""
    asked = [{"name": c, "arguments": {}, "id": c} for c in calls]
    response: dict[str, Any] = {"text": "" if calls else "done", "tool_calls": asked}
    response["usage"] = [10, 2]
    if cache is not None:
        response["cache"] = list(cache)
    return ev(run_id, step_id, Phase.RESULT, fp="f" * 64, response=response)


# Two approved-or-allowed tool calls, then the answer: 2 model steps, 2 tool steps.
# Its model steps read 6 + 4 tokens from a prompt cache and wrote 3 to it.
CLOSED = [
    model("closed", "m1", "look", "pay", cache=(6, 3)),
    ev("closed", "m1.t1", Phase.INTENT, Decision.ALLOW, tool="look", args={}, fp="a"),
    ev("closed", "m1.t1", Phase.SUBMITTED),
    ev("closed", "m1.t1", Phase.RESULT, status="ok", value="found"),
    ev("closed", "m1.t2", Phase.INTENT, Decision.REQUIRE_APPROVAL, tool="pay", args={}, fp="b"),
    ev("closed", "m1.t2", Phase.APPROVAL, Decision.APPROVED, by="ana", reason="", fp="b"),
    ev("closed", "m1.t2", Phase.SUBMITTED),
    ev("closed", "m1.t2", Phase.RESULT, status="ok", value="tx-1"),
    model("closed", "m2", cache=(4, 0)),
    ev("closed", "final", Phase.RESULT, step="m2", text="done"),
]

# A payment resolved "did not happen" and retried as m1.t1/2, then a denied call:
# 1 model step, 2 tool steps; the retry is an attempt of m1.t1, not a step.
RETRIED = [
    model("retried", "m1", "pay", "wipe"),
    ev("retried", "m1.t1", Phase.INTENT, Decision.ALLOW, tool="pay", args={}, fp="c"),
    ev("retried", "m1.t1", Phase.SUBMITTED),
    ev("retried", "m1.t1", Phase.RESOLUTION, happened=False, by="ana"),
    ev("retried", "m1.t1/2", Phase.SUBMITTED),
    ev("retried", "m1.t1/2", Phase.RESULT, status="ok", value="tx-2"),
    ev("retried", "m1.t2", Phase.INTENT, Decision.DENY, tool="wipe", args={}, fp="d"),
    ev("retried", "m1.t2", Phase.RESULT, status="denied", by="policy", reason="no"),
]

RUNS = {"closed": CLOSED, "retried": RETRIED, "queued": []}

# run id -> (steps, model steps, tool steps, records)
EXPECTED = {"closed": (4, 2, 2, 10), "retried": (3, 1, 2, 8), "queued": (0, 0, 0, 0)}

# run id -> (input tokens, of which read from a cache, written to one): schema 3's columns.
EXPECTED_TOKENS = {"closed": (20, 10, 3), "retried": (10, 0, 0), "queued": (0, 0, 0)}


def rows(events: Sequence[StepEvent]) -> list[tuple[Any, ...]]:
    """The journal rows of ``events`` as every schema stores them."""
    return [
        (
            e.run_id,
            e.step_id,
            e.phase.value,
            None if e.decision is None else e.decision.value,
            json.dumps(dict(e.payload), separators=(",", ":")),
            e.created_at,
        )
        for e in events
    ]


def index_row(run_id: str, events: Sequence[StepEvent]) -> tuple[Any, ...]:
    """The run index row schema 1 kept: records, model calls and tokens, by its appends."""
    usage = counts_of(events)
    status = "closed" if events and events[-1].step_id == "final" else "running"
    task = "queued work" if not events else None
    return (run_id, status, len(events), 1.0, 2.0, usage["calls"], usage["inp"], usage["out"], task)


INDEX_COLUMNS = "run_id, status, events, created_at, updated_at, model_calls, input_tokens,"
INDEX_COLUMNS += " output_tokens, task"


def counts(store_runs: Sequence[Any]) -> dict[str, tuple[int, int, int, int]]:
    """Per run: steps, model steps, tool steps and records, as the run index lists them."""
    return {r.run_id: (r.steps, r.model_calls, r.tool_steps, r.events) for r in store_runs}


def sqlite_at_schema_1(path: Path) -> None:
    """A journal file built by migration 1 only and filled as schema 1's asiento did."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("BEGIN")
        for statement in sqlite_schema.MIGRATIONS[0].split(";"):
            if statement.strip():
                db.execute(statement)
        db.execute("PRAGMA user_version = 1")
        db.execute(f"PRAGMA application_id = {sqlite_schema.APPLICATION_ID}")
        for run_id, events in RUNS.items():
            db.executemany("INSERT INTO journal VALUES (?, ?, ?, ?, ?, ?)", rows(events))
            db.execute(
                f"INSERT INTO runs ({INDEX_COLUMNS}) VALUES ({', '.join('?' * 9)})",
                index_row(run_id, events),
            )
        db.execute("COMMIT")
    finally:
        db.close()


def postgres_at_schema_1(dsn: str) -> None:
    """The test's schema with migration 1 only, filled as schema 1's asiento did."""
    with psycopg.connect(dsn) as conn:
        conn.execute(pg_schema.CREATE_VERSIONS)
        for statement in pg_schema.MIGRATIONS[0]:
            conn.execute(statement)
        conn.execute("INSERT INTO asiento_schema (version) VALUES (1)")
        with conn.cursor() as cur:
            for run_id, events in RUNS.items():
                insert = (
                    "INSERT INTO journal (run_id, step_id, phase, decision, payload, created_at)"
                )
                cur.executemany(insert + " VALUES (%s, %s, %s, %s, %s, %s)", rows(events))
                cur.execute(
                    f"INSERT INTO runs ({INDEX_COLUMNS}) VALUES ({', '.join(['%s'] * 9)})",
                    index_row(run_id, events),
                )


Opener = Callable[[pytest.FixtureRequest], Awaitable[tuple[Checkpointer, Callable[[], int]]]]


async def open_sqlite(request: pytest.FixtureRequest) -> tuple[Checkpointer, Callable[[], int]]:
    """A schema-1 file opened by this asiento, and how to read its schema version."""
    path = request.getfixturevalue("tmp_path") / "runs.db"
    sqlite_at_schema_1(path)

    def version() -> int:
        with sqlite3.connect(path) as db:
            return int(db.execute("PRAGMA user_version").fetchone()[0])

    assert version() == 1
    return SqliteCheckpointer(path), version


async def open_postgres(request: pytest.FixtureRequest) -> tuple[Checkpointer, Callable[[], int]]:
    """A schema-1 database opened by this asiento, and how to read its schema version."""
    dsn = request.getfixturevalue("pg_dsn")
    postgres_at_schema_1(dsn)

    def version() -> int:
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT max(version) FROM asiento_schema").fetchone()
            assert row is not None
            return int(row[0])

    assert version() == 1
    return await PostgresCheckpointer.connect(dsn, max_size=1), version


OPENERS: dict[str, Opener] = {"sqlite": open_sqlite, "postgres": open_postgres}
LATEST = {"sqlite": sqlite_schema.SCHEMA_VERSION, "postgres": pg_schema.SCHEMA_VERSION}


@pytest.mark.parametrize("backend", list(OPENERS))
async def test_schema_1_journal_upgrades_and_counts_its_steps(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """Opening a schema-1 journal migrates it (2 adds tool steps) and backfills each run's
    tool steps from its intent records: steps as a fresh journal counts them."""
    store, version = await OPENERS[backend](request)
    try:
        assert version() == LATEST[backend]
        assert counts(await store.runs()) == EXPECTED
        assert [e.step_id for e in await store.load("closed")][-1] == "final"
        fresh = MemoryCheckpointer()
        for events in (CLOSED, RETRIED):
            await fresh.append(*events)
        assert {k: v for k, v in counts(await store.runs()).items() if k != "queued"} == counts(
            await fresh.runs()
        )
    finally:
        await store.close()


@pytest.mark.parametrize("backend", list(OPENERS))
async def test_upgraded_journal_counts_new_steps_from_the_backfill(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """After the upgrade, appends add their steps to the backfilled counts."""
    store, _ = await OPENERS[backend](request)
    try:
        await store.append(
            model("retried", "m2", "look"),
            ev("retried", "m2.t1", Phase.INTENT, Decision.ALLOW, tool="look", args={}, fp="e"),
        )
        await store.append(ev("queued", "m1", Phase.RESULT, note="no response"))
        listed = counts(await store.runs())
        assert (listed["retried"], listed["queued"]) == ((5, 2, 3, 10), (0, 0, 0, 1))
    finally:
        await store.close()


def tokens(store_runs: Sequence[Any]) -> dict[str, tuple[int, int, int]]:
    return {
        r.run_id: (r.input_tokens, r.cached_input_tokens, r.cache_write_tokens) for r in store_runs
    }


@pytest.mark.parametrize("backend", list(OPENERS))
async def test_upgrade_to_schema_3_backfills_prompt_cache_tokens(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """Migration 3 sums each run's cache tokens from its recorded model results, as a
    fresh journal counts them; appends after it add theirs."""
    store, version = await OPENERS[backend](request)
    try:
        assert version() == LATEST[backend] >= 3
        assert tokens(await store.runs()) == EXPECTED_TOKENS
        fresh = MemoryCheckpointer()
        for events in (CLOSED, RETRIED):
            await fresh.append(*events)
        upgraded = {k: v for k, v in tokens(await store.runs()).items() if k != "queued"}
        assert upgraded == tokens(await fresh.runs())
        await store.append(model("retried", "m2", "look", cache=(7, 1)))
        assert tokens(await store.runs())["retried"] == (20, 7, 1)
    finally:
        await store.close()


async def test_a_record_the_sqlite_backfill_cannot_read_counts_nothing(tmp_path: Path) -> None:
    """A damaged model result does not stop the upgrade; the run's other records count."""
    path = tmp_path / "runs.db"
    sqlite_at_schema_1(path)
    with sqlite3.connect(path) as db:
        db.execute(
            "INSERT INTO journal VALUES ('closed', 'm9', 'result', NULL, ?, 1.0)",
            ('{"response": {"cache": [5, "five"]}}',),
        )
        db.execute(
            "INSERT INTO journal VALUES ('closed', 'm8', 'result', NULL, ?, 1.0)",
            ('{"response": {"cache": [5, 1]',),  # cut short
        )
    store = SqliteCheckpointer(path)
    try:
        assert tokens(await store.runs())["closed"] == (20, 10, 3)
    finally:
        await store.close()


# -- every record asiento writes, through every migration (issue 12, item 9) -------------
#
# The records are the real loop's: an Agent run whose appends go to a MemoryCheckpointer
# that also keeps the rows ``encode_batch`` made of them, which are exactly what the
# SQLite and PostgreSQL appends insert (the encoder is the same since schema 1). They
# are then written into a journal built by the earlier migrations only, as that
# schema's asiento would have held them, and opened by this asiento.


class Recorder(MemoryCheckpointer):
    """A memory journal that also keeps every row its appends encoded, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[Any, ...]] = []

    async def append(self, *events: StepEvent, **kwargs: Any) -> None:
        await super().append(*events, **kwargs)
        self.rows += encode_batch(events)[1]


@tool(idempotent=True)
def fetch(url: str) -> dict[str, str]:
    """An HTTP-like answer that names a cache (so a cache filter matches) and holds a NUL."""
    return {"cache": "MISS", "body": "a\x00b"}


def usage(cached: int, written: int = 0) -> Usage:
    return Usage(input_tokens=10, output_tokens=2, cached_input_tokens=cached,
                 cache_write_tokens=written)  # fmt: skip


# Model answers with a lone surrogate and NUL bytes (recorded as JSON escapes, which
# jsonb refuses), a tool result with a NUL and a "cache" key; and, in "absurd", a usage
# no 64-bit column holds (a schema-2 asiento recorded it without summing it).
HARD_RUNS = {
    "hard": [
        ModelResponse(
            text="looking \ud800",
            tool_calls=[ToolCall(name="fetch", arguments={"url": "x\udfff\x00"})],
            usage=usage(6, 3),
        ),
        ModelResponse(text="found a\x00b", usage=usage(4)),
    ],
    "absurd": [ModelResponse(text="done", usage=usage(2**64))],
}

# run id -> (input tokens, of which read from a cache, written to one) after the upgrade:
# the cache tokens no bigint holds count nothing.
HARD_TOKENS = {"hard": (20, 10, 3), "absurd": (10, 0, 0)}


async def record_hard_runs() -> Recorder:
    """The real loop records HARD_RUNS (each to its final step) in a Recorder."""
    recorder = Recorder()
    for run_id, script in HARD_RUNS.items():
        session = Session(run_id, ScriptedGateway(script), recorder)
        steps = [step async for step in Agent(tools=[fetch]).run("task \ud800", session=session)]
        assert isinstance(steps[-1], FinalStep)
    assert any("\\u0000" in row[4] and '"cache"' in row[4] for row in recorder.rows)
    assert any("\\ud800" in row[4] and '"cache"' in row[4] for row in recorder.rows)
    return recorder


def index_rows(infos: Sequence[RunInfo], version: int) -> list[dict[str, Any]]:
    """The run index rows a schema-``version`` asiento kept for these runs."""
    found = []
    for info in infos:
        row = {
            "run_id": info.run_id, "status": info.status.value, "events": info.events,
            "created_at": info.created_at, "updated_at": info.updated_at,
            "model_calls": info.model_calls, "input_tokens": info.input_tokens,
            "output_tokens": info.output_tokens, "cost": info.cost,
        }  # fmt: skip
        if version >= 2:
            row["tool_steps"] = info.tool_steps
        found.append(row)
    return found


def sqlite_at(path: Path, version: int, records: Sequence[Any], index: Sequence[dict]) -> None:
    """A WAL journal file built by the first ``version`` migrations, holding ``records``."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("BEGIN")
        for migration in sqlite_schema.MIGRATIONS[:version]:
            for statement in migration.split(";"):
                if statement.strip():
                    db.execute(statement)
        db.execute(f"PRAGMA user_version = {version}")
        db.execute(f"PRAGMA application_id = {sqlite_schema.APPLICATION_ID}")
        db.executemany(
            "INSERT INTO journal (run_id, step_id, phase, decision, payload, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            records,
        )
        for row in index:
            names = ", ".join(row)
            db.execute(f"INSERT INTO runs ({names}) VALUES ({', '.join('?' * len(row))})",
                       list(row.values()))  # fmt: skip
        db.execute("COMMIT")
    finally:
        db.close()


def postgres_at(dsn: str, version: int, records: Sequence[Any], index: Sequence[dict]) -> None:
    """The test's schema built by the first ``version`` migrations, holding ``records``."""
    with psycopg.connect(dsn) as conn:
        conn.execute(pg_schema.CREATE_VERSIONS)
        for number, migration in enumerate(pg_schema.MIGRATIONS[:version], 1):
            for statement in migration:
                conn.execute(statement)
            conn.execute("INSERT INTO asiento_schema (version) VALUES (%s)", (number,))
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO journal (run_id, step_id, phase, decision, payload, created_at)"
                " VALUES (%s, %s, %s, %s, %s, %s)",
                records,
            )
            for row in index:
                names = ", ".join(row)
                cur.execute(f"INSERT INTO runs ({names}) VALUES ({', '.join(['%s'] * len(row))})",
                            list(row.values()))  # fmt: skip


async def open_at(
    backend: str, version: int, recorder: Recorder, request: pytest.FixtureRequest
) -> Checkpointer:
    """A journal at schema ``version`` holding the recorder's rows, opened by this asiento."""
    index = index_rows(await recorder.runs(), version)
    if backend == "sqlite":
        path = request.getfixturevalue("tmp_path") / "runs.db"
        sqlite_at(path, version, recorder.rows, index)
        return SqliteCheckpointer(path)
    dsn = request.getfixturevalue("pg_dsn")
    postgres_at(dsn, version, recorder.rows, index)
    return await PostgresCheckpointer.connect(dsn, max_size=1)


def records_of(events: Sequence[StepEvent]) -> list[tuple[Any, ...]]:
    return [(e.step_id, e.phase, e.decision, e.payload, e.created_at) for e in events]


@pytest.mark.parametrize("start", [1, 2])
@pytest.mark.parametrize("backend", list(OPENERS))
async def test_every_migration_takes_every_record_asiento_writes(
    backend: str, start: int, request: pytest.FixtureRequest
) -> None:
    """A journal at schema 1 or 2 holding what the real loop records (NUL bytes and lone
    surrogates in answers, arguments and a tool result that names a cache; a usage no
    bigint holds) upgrades on both backends, counts each run as asiento counts it, and
    reads back every record exactly."""
    recorder = await record_hard_runs()
    store = await open_at(backend, start, recorder, request)
    try:
        assert counts(await store.runs()) == counts(await recorder.runs())
        assert tokens(await store.runs()) == HARD_TOKENS
        for run_id in HARD_RUNS:
            assert records_of(await store.load(run_id)) == records_of(await recorder.load(run_id))
    finally:
        await store.close()


# -- a migration that fails says so, and changes nothing (issue 12, items 8 and 9) ------


def sqlite_snapshot(path: Path) -> tuple[Any, ...]:
    """Everything a migration could change in the file: version, columns, every row."""
    with closing(sqlite3.connect(path)) as db:
        return (
            db.execute("PRAGMA user_version").fetchone()[0],
            [row[1] for row in db.execute("PRAGMA table_info(runs)")],
            db.execute("SELECT * FROM journal ORDER BY rowid").fetchall(),
            db.execute("SELECT * FROM runs ORDER BY run_id").fetchall(),
        )


def postgres_snapshot(dsn: str) -> tuple[Any, ...]:
    """The same for the test's schema."""
    with psycopg.connect(dsn) as conn:
        columns = conn.execute(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_schema = current_schema() AND table_name = 'runs'"
            " ORDER BY ordinal_position"
        ).fetchall()
        return (
            conn.execute("SELECT max(version) FROM asiento_schema").fetchone(),
            [name for (name,) in columns],
            conn.execute("SELECT * FROM journal ORDER BY seq").fetchall(),
            conn.execute("SELECT * FROM runs ORDER BY run_id").fetchall(),
        )


@pytest.mark.parametrize("backend", list(OPENERS))
async def test_a_failed_migration_names_itself_and_leaves_the_journal_unchanged(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """A schema-1 journal whose runs table already has a column migration 3 adds (made by
    hand): opening raises MigrationFailed naming migration 3, the cause, that the journal
    is unchanged and what to do; migration 2 was rolled back with it (same version,
    columns and rows). Once the column is dropped, the upgrade goes through."""
    add = "ALTER TABLE runs ADD COLUMN cached_input_tokens INTEGER NOT NULL DEFAULT 0"
    drop = "ALTER TABLE runs DROP COLUMN cached_input_tokens"
    if backend == "sqlite":
        path = request.getfixturevalue("tmp_path") / "runs.db"
        sqlite_at_schema_1(path)
        with closing(sqlite3.connect(path)) as db:
            db.execute(add)
        snapshot: Callable[[], tuple[Any, ...]] = partial(sqlite_snapshot, path)
        execute: Callable[[str], None] = partial(sqlite_execute, path)
        opening = partial(asyncio.to_thread, SqliteCheckpointer, path)
    else:
        dsn = request.getfixturevalue("pg_dsn")
        postgres_at_schema_1(dsn)
        with psycopg.connect(dsn) as conn:
            conn.execute(add)
        snapshot, execute = partial(postgres_snapshot, dsn), partial(postgres_execute, dsn)
        opening = partial(PostgresCheckpointer.connect, dsn, max_size=1)
    before = snapshot()
    assert "tool_steps" not in before[1]
    with pytest.raises(errors.MigrationFailed) as failed:
        await opening()
    message = str(failed.value)
    assert "migration 3 (schema 2 to 3)" in message
    assert "cached_input_tokens" in message  # the cause, in the database's words
    assert "unchanged, still at schema 1 (its transaction was rolled back)" in message
    assert "open it again" in message
    assert (failed.value.migration, failed.value.version) == (3, 1)
    assert snapshot() == before, "migration 2 was not rolled back with migration 3"
    execute(drop)
    store = await opening()
    try:
        assert counts(await store.runs()) == EXPECTED
    finally:
        await store.close()


def sqlite_execute(path: Path, statement: str) -> None:
    with closing(sqlite3.connect(path)) as db:
        db.execute(statement)


def postgres_execute(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(statement)


HOLDER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
db.execute("SELECT count(*) FROM runs").fetchone()
print("locked", flush=True)
sys.stdin.read()  # until the test closes our stdin
db.execute("ROLLBACK")
db.close()
"""


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Another process holds ``BEGIN EXCLUSIVE`` on the file while the block runs."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None
    assert holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
        holder.stdout.close()


@pytest.mark.parametrize("mode", ["wal", "delete"])
async def test_a_busy_journal_during_migration_is_journal_busy(tmp_path: Path, mode: str) -> None:
    """A schema-2 file while another process holds BEGIN EXCLUSIVE on it: opening raises
    JournalBusy (in WAL mode, naming the upgrade and that the journal is unchanged), not
    sqlite3's OperationalError nor NotAJournal; once the lock is let go it upgrades."""
    path = tmp_path / "runs.db"
    recorder = await record_hard_runs()
    sqlite_at(path, 2, recorder.rows, index_rows(await recorder.runs(), 2))
    if mode == "delete":
        sqlite_execute(path, "PRAGMA journal_mode=DELETE")
    before = sqlite_snapshot(path)
    with exclusive_lock(path), pytest.raises(JournalBusy) as busy:
        SqliteCheckpointer(path, timeout=0.2)
    assert "another process held the journal's lock" in str(busy.value)
    if mode == "wal":
        latest = sqlite_schema.SCHEMA_VERSION
        upgrade = f"the upgrade from schema 2 to {latest} could not be applied"
        assert upgrade in str(busy.value)
        assert "unchanged, still at schema 2 (it could not start)" in str(busy.value)
    assert sqlite_snapshot(path) == before
    store = SqliteCheckpointer(path, timeout=0.2)
    try:
        assert tokens(await store.runs()) == HARD_TOKENS
    finally:
        await store.close()


async def test_a_postgres_migration_waits_for_a_busy_table_only_until_its_timeout(
    pg_dsn: str,
) -> None:
    """A schema-2 database whose runs table another session holds (an open transaction
    that read it): opening with timeout=0.3 raises JournalBusy naming migration 3 and
    that the journal is unchanged, instead of waiting for ever (and making every other
    session queue behind its lock); once that session ends, it upgrades."""
    recorder = await record_hard_runs()
    postgres_at(pg_dsn, 2, recorder.rows, index_rows(await recorder.runs(), 2))
    before = postgres_snapshot(pg_dsn)
    with psycopg.connect(pg_dsn) as other:
        other.execute("SELECT count(*) FROM runs").fetchone()  # holds ACCESS SHARE until COMMIT
        with pytest.raises(JournalBusy) as busy:
            await asyncio.wait_for(PostgresCheckpointer.connect(pg_dsn, timeout=0.3), 30)
        other.rollback()
    assert "migration 3 (schema 2 to 3)" in str(busy.value)
    assert "unchanged, still at schema 2" in str(busy.value)
    assert postgres_snapshot(pg_dsn) == before
    store = await PostgresCheckpointer.connect(pg_dsn, timeout=0.3)
    try:
        assert tokens(await store.runs()) == HARD_TOKENS
    finally:
        await store.close()


async def test_damage_met_by_a_migration_is_journal_corrupt_naming_it(tmp_path: Path) -> None:
    """A schema-1 journal whose record pages were overwritten (the header and the schema
    intact): the upgrade meets the damage and raises JournalCorrupt naming the migration
    (2 or 3, by where the pages lie), that the journal is unchanged and what to do, not
    sqlite3's DatabaseError; the file is left byte for byte as it was."""
    path = tmp_path / "runs.db"
    bulky = [
        ev("bulky", f"m{i}.t1", Phase.INTENT, Decision.ALLOW, tool="look", args={"n": "x" * 300})
        for i in range(300)
    ]
    sqlite_at(path, 1, rows(bulky), index_rows(await recorded(bulky), 1))
    data = bytearray(path.read_bytes())
    assert len(data) > 20 * 4096
    data[8 * 4096 : 12 * 4096] = b"\xde\xad\xbe\xef" * 4096
    path.write_bytes(bytes(data))
    with pytest.raises(errors.JournalCorrupt) as damaged:
        SqliteCheckpointer(path)
    message = str(damaged.value)
    assert re.search(r"migration [23] \(schema [12] to [23]\) could not be applied", message)
    assert "is damaged" in message
    assert "unchanged, still at schema 1" in message
    assert "backup" in message
    assert path.read_bytes() == bytes(data)


async def recorded(events: Sequence[StepEvent]) -> list[RunInfo]:
    """The run index a memory journal keeps for ``events``."""
    memory = MemoryCheckpointer()
    await memory.append(*events)
    return await memory.runs()
