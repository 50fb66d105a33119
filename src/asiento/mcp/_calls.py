"""The SQLite table of calls an MCP server has seen, one row per (scope, idempotency key).

A row is written ``started`` (with its owner: host, pid, process start time and
a lease) in the same transaction that finds the key unseen, so two processes
racing for one key are separated by the primary key under ``BEGIN IMMEDIATE``,
never by a read-then-write check. The row becomes ``done`` with the result, or
``interrupted`` when the call ended without one. Rows older than the TTL are
deleted, except a call still running under a live lease.

The file is opened in WAL mode with ``synchronous=FULL``: a ``started`` row is
on disk before the tool runs, a ``done`` row before its result is sent.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from asiento import _clock
from asiento.errors import UsageError
from asiento.lease import Holder, is_dead_here

_SCHEMA = """
CREATE TABLE IF NOT EXISTS asiento_mcp_calls (
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    tool TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('started', 'done', 'interrupted')),
    result TEXT,
    owner TEXT NOT NULL,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    process_start TEXT NOT NULL,
    lease_until REAL NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (scope, key)
);
CREATE INDEX IF NOT EXISTS asiento_mcp_calls_created ON asiento_mcp_calls (created_at);
"""

_BUSY_TIMEOUT_MS = 10_000

Verdict = Literal["run", "replay", "in-progress", "unknown", "conflict"]
_WHERE_MINE = "WHERE scope = ? AND key = ? AND owner = ? AND status = 'started'"


class CallKey(NamedTuple):
    """A call's name in the table: the client's key, within the scope the server gives it."""

    scope: str
    key: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Seen:
    """What the table says about a key: run it now, or answer without running it."""

    verdict: Verdict
    tool: str = ""  # the tool the key was first used for (for "conflict")
    result: dict[str, Any] | None = None  # the recorded wire result (for "replay")


class CallTable:
    """The calls of one SQLite file; safe to share between threads and processes."""

    def __init__(self, path: str | os.PathLike[str], *, ttl: float, lease: float) -> None:
        self.path = Path(path)
        self.ttl = ttl
        self.lease = lease
        self._local = threading.local()
        self._holder: Holder | None = None
        self._running: set[CallKey] = set()  # the calls this process is running now
        self._running_lock = threading.Lock()
        self._create()

    def claim(self, key: CallKey, tool: str, fingerprint: str) -> Seen:
        """Start the call under ``key`` (verdict "run"), or say why it must not run.

        The verdict is reached inside the write transaction, so no call can finish
        between reading its row and judging it.
        """
        now = _clock.now()
        inserting = False
        try:
            with self._transaction() as db:
                self._sweep(db, now)
                row = db.execute(
                    "SELECT * FROM asiento_mcp_calls WHERE scope = ? AND key = ?", key
                ).fetchone()
                if row is not None:
                    return self._judge(row, fingerprint, now)
                inserting = True
                self._mark_running(key, True)  # before the commit: a row seen started is running
                self._insert_started(db, key, tool, fingerprint, now)
        except BaseException:
            if inserting:
                self._mark_running(key, False)
            raise
        return Seen(verdict="run")

    def _insert_started(
        self, db: sqlite3.Connection, key: CallKey, tool: str, fingerprint: str, now: float
    ) -> None:
        holder = self.holder()
        db.execute(
            "INSERT INTO asiento_mcp_calls (scope, key, tool, fingerprint, status, owner, host, "
            "pid, process_start, lease_until, created_at) "
            "VALUES (?, ?, ?, ?, 'started', ?, ?, ?, ?, ?, ?)",
            (*key, tool, fingerprint, holder.owner, holder.host, holder.pid, holder.started,
             now + self.lease, now),
        )  # fmt: skip

    def finish(self, key: CallKey, result: dict[str, Any]) -> None:
        """Record the call's result: from now on the key replays it."""
        self._close(
            key, "UPDATE asiento_mcp_calls SET status = 'done', result = ?", (json.dumps(result),)
        )

    def interrupt(self, key: CallKey) -> None:
        """The call ended without a result: the key answers "unknown" from now on."""
        self._close(key, "UPDATE asiento_mcp_calls SET status = 'interrupted'", ())

    def release(self, key: CallKey) -> None:
        """Forget the call (it did not run to an outcome): the key may run again."""
        self._close(key, "DELETE FROM asiento_mcp_calls", ())

    def renew(self) -> None:
        """Extend the lease of every call this process is running."""
        with self._running_lock:
            keys = list(self._running)
        if not keys:
            return
        until = _clock.now() + self.lease
        with self._transaction() as db:
            db.executemany(
                f"UPDATE asiento_mcp_calls SET lease_until = ? {_WHERE_MINE}",
                [(until, *key, self.holder().owner) for key in keys],
            )

    def holder(self) -> Holder:
        """This process as an owner of rows; a new one after a fork."""
        if self._holder is None or self._holder.pid != os.getpid():
            self._holder = Holder.here()
        return self._holder

    def _close(self, key: CallKey, statement: str, values: tuple[Any, ...]) -> None:
        """Write how the call ended; it stops running here only once that is committed."""
        try:
            with self._transaction() as db:
                db.execute(f"{statement} {_WHERE_MINE}", (*values, *key, self.holder().owner))
        finally:
            self._mark_running(key, False)

    def _mark_running(self, key: CallKey, running: bool) -> None:
        with self._running_lock:
            if running:
                self._running.add(key)
            else:
                self._running.discard(key)

    def _judge(self, row: sqlite3.Row, fingerprint: str, now: float) -> Seen:
        if row["fingerprint"] != fingerprint:
            return Seen(verdict="conflict", tool=row["tool"])
        if row["status"] == "done":
            return Seen(verdict="replay", result=json.loads(row["result"]))
        if row["status"] == "started" and self._alive(row, now):
            return Seen(verdict="in-progress")
        return Seen(verdict="unknown")

    def _alive(self, row: sqlite3.Row, now: float) -> bool:
        """Whether the call's owner may still be running it (else nobody knows what it did)."""
        if row["owner"] == self.holder().owner:
            with self._running_lock:
                return CallKey(row["scope"], row["key"]) in self._running
        if is_dead_here(row["host"], row["pid"], row["process_start"]):
            return False
        return bool(row["lease_until"] > now)

    def _sweep(self, db: sqlite3.Connection, now: float) -> None:
        """Delete the rows past the TTL, except a call still running under its lease."""
        db.execute(
            "DELETE FROM asiento_mcp_calls WHERE created_at <= ? "
            "AND NOT (status = 'started' AND lease_until > ?)",
            (now - self.ttl, now),
        )

    def _create(self) -> None:
        try:
            db = self._connection()
            db.execute("PRAGMA journal_mode = WAL")
            db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} COMMIT;")
        except sqlite3.DatabaseError as exc:
            raise UsageError(
                f"cannot use {str(self.path)!r} for MCP idempotency keys: {exc}; "
                "give IdempotencyKeys the path of a SQLite file (it is created if missing)"
            ) from exc

    def _transaction(self) -> _Transaction:
        return _Transaction(self._connection())

    def _connection(self) -> sqlite3.Connection:
        """This thread's connection (a new one in a forked child)."""
        held: tuple[int, sqlite3.Connection] | None = getattr(self._local, "db", None)
        if held is not None and held[0] == os.getpid():
            return held[1]
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.row_factory = sqlite3.Row
        db.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        db.execute("PRAGMA synchronous = FULL")
        self._local.db = (os.getpid(), db)
        return db


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on error) on one connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        if not self.db.in_transaction:
            self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        if not self.db.in_transaction:
            return
        if kind is not None:
            self.db.execute("ROLLBACK")
            return
        try:
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:  # a COMMIT that failed leaves nothing half-done
                self.db.execute("ROLLBACK")
            raise
