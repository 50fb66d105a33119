"""Journals written by an older asiento read, resume, and match what is written today.

The fixtures in ``fixtures/`` were written by ``scenarios.py`` with the code of
commit b3236b8, before the payloads had types (issue 13): an SQLite file, and the
rows of a PostgreSQL journal as ``COPY`` wrote them. Today's code must read every
record, resume the runs that wait (an approval, an uncertain effect) to their end,
answer the closed ones without a call, and record the same runs byte for byte.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path

import psycopg
import pytest

from asiento import (
    Checkpointer,
    FinalStep,
    RunStatus,
    SqliteCheckpointer,
    approve,
    resolve,
)
from asiento.decisions import pending_approval
from asiento.journal.postgres import PostgresCheckpointer
from asiento.testing import ScriptedGateway

from . import scenarios


async def sqlite_copy(tmp_path: Path) -> Checkpointer:
    path = tmp_path / "old.db"
    shutil.copyfile(scenarios.SQLITE_FIXTURE, path)
    return SqliteCheckpointer(path)


async def postgres_copy(dsn: str) -> Checkpointer:
    store = await PostgresCheckpointer.connect(dsn)  # today's schema, empty
    with psycopg.connect(dsn) as conn:
        for table, path in scenarios.POSTGRES_FIXTURES.items():
            columns = scenarios.POSTGRES_COLUMNS[table]
            with conn.cursor().copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
                copy.write(path.read_bytes())
    return store


@pytest.fixture(params=["sqlite", "postgres"])
async def old(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Checkpointer]:
    """A copy of the old journal, on its backend."""
    if request.param == "sqlite":
        store = await sqlite_copy(tmp_path)
    else:
        store = await postgres_copy(request.getfixturevalue("pg_dsn"))
    yield store
    await store.close()


def raw_rows(path: Path, run_id: str) -> list[tuple[str, str, str | None, bytes]]:
    """A run's records as the file holds them, but their time: step, phase, decision and
    the payload's bytes."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:  # never creates it
        found = db.execute(
            "SELECT step_id, phase, decision, CAST(payload AS BLOB) FROM journal"
            " WHERE run_id = ? ORDER BY rowid",
            (run_id,),
        ).fetchall()
    return [(step, phase, decision, bytes(payload)) for step, phase, decision, payload in found]


async def test_every_old_record_reads_back(old: Checkpointer) -> None:
    """Every run of the old journal loads, and the index counts what the journal holds."""
    listed = {info.run_id: info for info in await old.runs()}
    assert set(listed) == set(scenarios.RUNS)
    for run_id, info in listed.items():
        assert len(await old.load(run_id)) == info.events


async def test_old_closed_runs_answer_without_a_call(old: Checkpointer) -> None:
    """Each closed run of the old journal is answered from its final record: no call."""
    for info in await old.runs(status=RunStatus.CLOSED):
        gateway = ScriptedGateway([])
        last = await scenarios.drive(old, info.run_id, set(), gateway)
        assert isinstance(last, FinalStep), (info.run_id, last)
        assert last.replayed
        assert gateway.calls == []


async def test_old_waiting_runs_resume_to_their_end(old: Checkpointer) -> None:
    """The old suspended run is approved and paid once; the old uncertain one is resolved
    and sent once; both close, each model answer already recorded asked for nothing."""
    waiting = await pending_approval(old, "waiting", "m1.t1")
    await approve(old, "waiting", "m1.t1", by="bo", fingerprint=waiting.fingerprint)
    await resolve(old, "uncertain", "m1.t1", happened=False, by="bo", reason="checked")
    for run_id in ("waiting", "uncertain"):
        gateway = ScriptedGateway(scenarios.SCRIPTS[run_id])
        last = await scenarios.drive(old, run_id, set(), gateway)
        assert isinstance(last, FinalStep), (run_id, last)
        assert not last.replayed
        assert [key.split(":")[1] for key in gateway.keys] == ["m2"]  # m1 was recorded
        info = await old.run(run_id)
        assert info is not None
        assert info.status is RunStatus.CLOSED


async def test_records_written_today_are_byte_identical(tmp_path: Path) -> None:
    """The same runs recorded by today's code give the old records byte for byte."""
    today = SqliteCheckpointer(tmp_path / "today.db")
    try:
        await scenarios.record(today)
    finally:
        await today.close()
    for run_id in scenarios.RUNS:
        old = raw_rows(scenarios.SQLITE_FIXTURE, run_id)
        assert old, run_id
        assert raw_rows(tmp_path / "today.db", run_id) == old, run_id
