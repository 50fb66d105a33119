"""The journal read from outside the killed processes: SQLite read-only, or psycopg.

The oracle never asks the library under test what it wrote; it reads the
tables with plain SQL.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from ._stores import is_postgres, pg_dsn, sqlite_path
from .invariants import Journal, Record

_JOURNAL = "SELECT step_id, phase, decision, payload, created_at FROM journal WHERE run_id = {p}"
_RUN = "SELECT status, fence, lease_expires FROM runs WHERE run_id = {p}"
_COUNTS = (
    "SELECT r.run_id, r.events, (SELECT count(*) FROM journal j WHERE j.run_id = r.run_id)"
    " FROM runs r"
)


class Reader(Protocol):
    def journal(self, run_id: str) -> Journal: ...

    def run_row(self, run_id: str) -> tuple[str | None, int | None, float | None]: ...

    def counts(self) -> tuple[dict[str, int], dict[str, int]]: ...

    def integrity(self) -> list[str]: ...

    def close(self) -> None: ...


def reader_for(store: str, application_name: str) -> Reader:
    if is_postgres(store):
        return PostgresReader(pg_dsn(store, application_name))
    return SqliteReader(sqlite_path(store))


def _journal(rows: Sequence[Sequence[Any]]) -> Journal:
    journal: dict[str, dict[str, Record]] = {}
    for step, phase, decision, payload, created_at in rows:
        journal.setdefault(step, {})[phase] = (decision, json.loads(payload), float(created_at))
    return journal


class SqliteReader:
    """Reads the SQLite file with a fresh read-only connection per question."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection | None]:
        if not self.path.exists():
            yield None
            return
        con = sqlite3.connect(self.path, timeout=30)  # may recover a killed writer's WAL index
        con.execute("PRAGMA query_only = 1")
        try:
            tables = con.execute("SELECT count(*) FROM sqlite_master WHERE name = 'runs'")
            yield con if tables.fetchone()[0] else None  # killed before the schema's commit
        finally:
            con.close()

    def _rows(self, sql: str, *args: str) -> list[tuple[Any, ...]]:
        with self._connect() as con:
            return [] if con is None else con.execute(sql, args).fetchall()

    def journal(self, run_id: str) -> Journal:
        return _journal(self._rows(_JOURNAL.format(p="?") + " ORDER BY rowid", run_id))

    def run_row(self, run_id: str) -> tuple[str | None, int | None, float | None]:
        rows = self._rows(_RUN.format(p="?"), run_id)
        return (rows[0][0], rows[0][1], rows[0][2]) if rows else (None, None, None)

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        rows = self._rows(_COUNTS)
        return {r[0]: int(r[2]) for r in rows}, {r[0]: int(r[1]) for r in rows}

    def integrity(self) -> list[str]:
        return [str(r[0]) for r in self._rows("PRAGMA integrity_check")] or ["ok"]

    def close(self) -> None:
        pass


class PostgresReader:
    """One autocommit connection, shared under a lock, opened again when the server restarts."""

    ATTEMPTS = 30

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._lock = threading.Lock()
        self._conn: Any = None

    def _rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        import psycopg

        with self._lock:
            for attempt in range(self.ATTEMPTS):
                try:
                    if self._conn is None or self._conn.closed:
                        self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
                    return list(self._conn.execute(sql, args).fetchall())
                except psycopg.errors.UndefinedTable:
                    return []  # no child has opened the store yet
                except psycopg.OperationalError:
                    self._drop()
                    if attempt + 1 == self.ATTEMPTS:
                        raise
                    time.sleep(0.2)  # the server may be restarting
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def journal(self, run_id: str) -> Journal:
        return _journal(self._rows(_JOURNAL.format(p="%s") + " ORDER BY seq", run_id))

    def run_row(self, run_id: str) -> tuple[str | None, int | None, float | None]:
        rows = self._rows(_RUN.format(p="%s"), run_id)
        return (rows[0][0], rows[0][1], rows[0][2]) if rows else (None, None, None)

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        rows = self._rows(_COUNTS)
        return {r[0]: int(r[2]) for r in rows}, {r[0]: int(r[1]) for r in rows}

    def integrity(self) -> list[str]:
        """No page-level check without extensions; the structure checks are done per run."""
        self._rows("SELECT count(*) FROM journal")
        return ["ok"]

    def close(self) -> None:
        with self._lock:
            self._drop()
