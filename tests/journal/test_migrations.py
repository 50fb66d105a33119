"""Journals written at an earlier schema open, upgrade and keep counting right.

Each journal is built with the earlier migrations only, filled the way that
schema's asiento filled it, then opened by this asiento.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from asiento import Checkpointer, Decision, MemoryCheckpointer, Phase, SqliteCheckpointer, StepEvent
from asiento.journal import _postgres_schema as pg_schema
from asiento.journal import _sqlite_schema as sqlite_schema
from asiento.journal.base import counts_of
from asiento.journal.postgres import PostgresCheckpointer


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
