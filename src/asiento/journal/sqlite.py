"""The embedded default: one SQLite file, WAL, one transaction per append.

The primary key ``(run_id, step_id, phase)`` is what separates two writers
racing for the same record; there is no read-then-write check anywhere.
"""

from __future__ import annotations

import errno
import os
import shlex
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .. import _clock, step_ids
from .._crash import crash_point
from ..errors import (
    DuplicateRecord,
    JournalBusy,
    JournalCorrupt,
    JournalError,
    JournalFull,
    JournalReadOnly,
    JournalTooNew,
    MigrationFailed,
    NotAJournal,
    UsageError,
)
from ..events import Claim, Lease, Phase, RunInfo, RunStatus, Savings, StepEvent
from ..lease import Holder
from ..telemetry import metrics
from . import _rules as rules
from ._backfill import MIGRATION_ADVICE
from ._sqlite_capi import keep_wal_on_close, os_errno
from ._sqlite_open import Progress, connect, identity, looks_like_a_journal, migrate, unwritable
from ._sqlite_schema import SCHEMA_VERSION
from ._sqlite_writer import GroupCommit, Outcome, StoreThread
from ._wakeup import WakeUp
from .base import (
    Row,
    check_id,
    check_release,
    counts_of,
    decode_row,
    encode_batch,
    lease_lost,
    may_take,
    run_closed,
    run_info,
    run_locked,
)

Durability = Literal["full", "process"]

_SYNCHRONOUS = {"full": "FULL", "process": "NORMAL"}

# OS errors that SQLite reports as a bare "disk I/O error" but mean "no room to write".
_NO_ROOM = {
    errno.EFBIG: "the file size limit was reached: ulimit -f, RLIMIT_FSIZE",
    errno.EDQUOT: "the disk quota was exceeded",
}

# How many runs one claim may park before it gives up for this call.
_MAX_PARKED_PER_CLAIM = 100
# Claims of one ``claim_many`` transaction: a few fsyncs for a worker's free slots, and
# no long wait for the renewals queued behind.
_CLAIMS_PER_TRANSACTION = 16


def _param(name: str) -> str:
    return f":{name}"


_UPSERT_RUN = f"""
INSERT INTO runs (run_id, status, events, created_at, updated_at, queued_at,
                  model_calls, input_tokens, output_tokens, cost, tool_steps,
                  cached_input_tokens, cache_write_tokens,
                  budget_cost, budget_tokens, budget_model_calls)
VALUES (:run_id, coalesce(:status, 'running'), :added, :now, :now, :now, :calls, :inp, :out,
        :cost, :tools, :cread, :cwrite, :b_budget_cost, :b_budget_tokens, :b_budget_model_calls)
ON CONFLICT (run_id) DO UPDATE SET
    {rules.budget_write(_param, row="runs.")},
    {rules.status_write(":status", ":now", row="runs.")},
    events = runs.events + :added,
    updated_at = :now,
    model_calls = runs.model_calls + :calls,
    tool_steps = runs.tool_steps + :tools,
    input_tokens = runs.input_tokens + :inp,
    output_tokens = runs.output_tokens + :out,
    cached_input_tokens = runs.cached_input_tokens + :cread,
    cache_write_tokens = runs.cache_write_tokens + :cwrite,
    cost = runs.cost + :cost
WHERE runs.{rules.STILL_OPEN}
"""

_APPEND_LEASED = f"""
UPDATE runs SET
    {rules.status_write(":status", ":now")},
    events = events + :added,
    updated_at = :now,
    model_calls = model_calls + :calls,
    tool_steps = tool_steps + :tools,
    input_tokens = input_tokens + :inp,
    output_tokens = output_tokens + :out,
    cached_input_tokens = cached_input_tokens + :cread,
    cache_write_tokens = cache_write_tokens + :cwrite,
    cost = cost + :cost,
    {rules.budget_write(_param)},
    lease_expires = :now + lease_ttl
WHERE run_id = :run_id AND fence = :token AND lease_owner = :owner AND lease_expires >= :now
"""

# The same for the append of almost every step, which leaves the status (and the
# budget) as it is:
# naming ``status`` (an indexed column) in SET rewrites its index entry even when the
# value stays, about half the cost of the statement. Positional, as binding by name
# costs a little more.
_APPEND_LEASED_SAME_STATUS = """
UPDATE runs SET
    events = events + ?1,
    updated_at = ?2,
    model_calls = model_calls + ?3,
    tool_steps = tool_steps + ?4,
    input_tokens = input_tokens + ?5,
    output_tokens = output_tokens + ?6,
    cost = cost + ?7,
    cached_input_tokens = cached_input_tokens + ?8,
    cache_write_tokens = cache_write_tokens + ?9,
    lease_expires = ?2 + lease_ttl
WHERE run_id = ?10 AND fence = ?11 AND lease_owner = ?12 AND lease_expires >= ?2
"""

# The plain appends of a batch (see ``_APPEND_LEASED_SAME_STATUS``), many runs in one
# statement: the VALUES rows are (run_id, token, owner, events, calls, tools, inp, out,
# cost, cread, cwrite[, status]), bound after ?1, the time. ``{status}``: the SET clause
# of a status (for the appends that change it: a run's last, say), or nothing.
_APPEND_PLAIN = """
UPDATE runs SET {status}
    events = events + v.column4,
    updated_at = ?1,
    model_calls = model_calls + v.column5,
    tool_steps = tool_steps + v.column6,
    input_tokens = input_tokens + v.column7,
    output_tokens = output_tokens + v.column8,
    cost = cost + v.column9,
    cached_input_tokens = cached_input_tokens + v.column10,
    cache_write_tokens = cache_write_tokens + v.column11,
    lease_expires = ?1 + lease_ttl
FROM (VALUES {values}) AS v
WHERE runs.run_id = v.column1 AND runs.fence = v.column2 AND runs.lease_owner = v.column3
    AND runs.lease_expires >= ?1
"""
# Leases renewed in one statement: the VALUES rows are (run_id, token, owner, ttl).
_RENEW = """
UPDATE runs SET lease_ttl = v.column4, lease_expires = ?1 + v.column4
FROM (VALUES {values}) AS v
WHERE runs.run_id = v.column1 AND runs.fence = v.column2 AND runs.lease_owner = v.column3
    AND runs.lease_expires >= ?1
RETURNING runs.run_id, runs.fence
"""
# Leases given up in one statement: the VALUES rows are (run_id, token, owner, and what
# the pass saved: calls, input and output tokens, cost; and whether it stopped cleanly).
_RELEASE = f"""
UPDATE runs SET lease_owner = NULL, lease_expires = NULL, {rules.requeue_released("?1")},
    replayed_calls = replayed_calls + v.column4,
    saved_input_tokens = saved_input_tokens + v.column5,
    saved_output_tokens = saved_output_tokens + v.column6,
    saved_cost = saved_cost + v.column7,
    attempts = CASE WHEN v.column8 THEN max(attempts - 1, 0) ELSE attempts END
FROM (VALUES {{values}}) AS v
WHERE runs.run_id = v.column1 AND runs.fence = v.column2 AND runs.lease_owner = v.column3
"""
# Below SQLite's 32,766 bound variables a statement.
_ROWS_PER_UPDATE = 2000
_ROWS_PER_INSERT = 4000


_INSERT_RECORD = "INSERT INTO journal VALUES (?, ?, ?, ?, ?, ?)"

_CHECK_LEASE = """
UPDATE runs SET lease_expires = :now + lease_ttl
WHERE run_id = :run_id AND fence = :token AND lease_owner = :owner AND lease_expires >= :now
"""

_RUN_COLUMNS = """run_id, status, events, created_at, updated_at, lease_owner, lease_expires,
fence, model_calls, input_tokens, output_tokens, replayed_calls, saved_input_tokens,
saved_output_tokens, task, agent, attempts, reason, cost, saved_cost, tool_steps,
cached_input_tokens, cache_write_tokens, budget_cost, budget_tokens, budget_model_calls,
lease_host, lease_pid, lapses"""

# A closed run takes no other status (no row changes: ``RunClosed``).
_SET_STATUS = f"""
UPDATE runs SET {rules.status_write(":status", ":now")}, updated_at = :now,
    reason = coalesce(:reason, reason)
WHERE run_id = :run_id AND ({rules.STILL_OPEN} OR :status = 'closed')
"""

# INDEXED BY: without statistics, SQLite would rather read every running run by status
# and sort them, whatever the size of the queue.
_CLAIMABLE = f"""
SELECT run_id, task, agent, attempts, reason, fence, lease_owner IS NOT NULL, lapses,
    events > claim_events
FROM runs INDEXED BY runs_claimable
WHERE {rules.claimable(":now")}
ORDER BY {rules.queue_order()} LIMIT 1
"""


class _Refused(Exception):
    """An append of the plain ones was refused: each is written apart, to fail alone."""


def _plain(item: _Append) -> bool:
    """Leased, its budget as it is: the append of almost every step."""
    return item.lease is not None and not item.counts["budget"]


def _plain_params(item: _Append) -> tuple[Any, ...]:
    counts, lease = item.counts, item.lease
    assert lease is not None
    status = () if item.status is None else (RunStatus(item.status).value,)
    return (
        *(item.run_id, lease.token, lease.owner, len(item.rows), counts["calls"]),
        *(counts["tools"], counts["inp"], counts["out"], counts["cost"], counts["cread"]),
        counts["cwrite"],
        *status,
    )


def _releases(items: list[_Append]) -> list[tuple[Lease, Savings, bool]]:
    """The leases the closing appends among ``items`` give up with their records."""
    return [
        (item.lease, item.release, False)
        for item in items
        if item.release is not None and item.lease is not None
    ]


_STATUS_OF_VALUES = rules.status_write("v.column12", "?1") + ","


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@dataclass(frozen=True, slots=True)
class _Append:
    """One append, checked and encoded, waiting for its batch's commit."""

    run_id: str
    rows: list[Row]
    counts: dict[str, Any]
    status: RunStatus | None
    lease: Lease | None
    release: Savings | None = None  # the closing append gives the lease up with it


class SqliteCheckpointer:
    """Journal in one SQLite file.

    ``durability="full"`` (the default) survives power loss: every commit is
    fsynced. ``durability="process"`` survives a crash of the process only and
    saves the fsync per commit. ``timeout`` is how long to wait for another
    process's lock. A journal this process cannot write is refused with
    ``JournalReadOnly``; ``read_only=True`` opens one to read it (a read-only
    mount included), never migrating it, and its writes raise ``JournalReadOnly``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        durability: Durability = "full",
        timeout: float = 5.0,
        read_only: bool = False,
    ) -> None:
        if durability not in _SYNCHRONOUS:
            raise UsageError(f"durability must be 'full' or 'process', got {durability!r}")
        self.path = Path(path)
        self.durability = durability
        self.read_only = read_only
        self._wakeup = WakeUp()
        self._timeout = timeout
        self._db = connect(self.path, timeout, read_only=read_only)
        # Every use of the connection goes through its thread (``_sqlite_writer``): a
        # commit that fsyncs or waits for a lock never holds the event loop.
        self._thread = StoreThread(f"asiento-sqlite {self.path.name}")
        self._writer = GroupCommit(self._thread, self._commit_batch, self._commit_alone)
        try:
            self._open()
        except BaseException:
            keep_wal_on_close(self._db, self.path)  # refused: leave every file as found
            self._db.close()
            raise

    def _open(self) -> None:
        """Check that the file is a journal this asiento reads, and bring its schema up to date."""
        try:
            version = identity(self._db, self.path, read_only=self.read_only, timeout=self._timeout)
            self._db.execute(f"PRAGMA synchronous={_SYNCHRONOUS[self.durability]}")
        except sqlite3.Error as exc:
            raise self._translated(exc) from exc
        if version < SCHEMA_VERSION:
            progress = Progress(version)
            try:
                migrate(self._db, self.path, progress)
            except JournalTooNew:
                raise
            except Exception as exc:
                raise self._migration_failed(exc, progress) from exc

    async def append(
        self,
        *events: StepEvent,
        status: RunStatus | None = None,
        lease: Lease | None = None,
        release: Savings | None = None,
    ) -> None:
        # Checked and encoded before it joins a batch: bad input fails only its caller.
        run_id, rows = encode_batch(events)
        release = check_release(release, status, lease)
        item = _Append(run_id, rows, counts_of(events), status, lease, release)
        await self._writer.submit(item, run_id=run_id)

    def _commit_batch(self, batch: list[_Append]) -> list[Outcome]:
        """Write the appends of one loop turn in one transaction (see ``_sqlite_writer``)."""
        if len(batch) == 1:  # a single run: exactly the one transaction of before
            try:
                self._commit_alone(batch[0])
            except Exception as exc:
                return [exc]
            return [None]
        return self._commit_together(batch)

    def _commit_alone(self, item: _Append) -> None:
        # The hot path of every step: one transaction written out by hand, without
        # the context managers the other methods use (they cost a few µs a step).
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                self._write(item, time.time(), alone=True)
                crash_point("inside_commit")
            except BaseException:
                db.rollback()
                raise
            db.commit()
        except sqlite3.Error as exc:
            raise self._translated(exc) from exc

    def _commit_together(self, batch: list[_Append]) -> list[Outcome]:
        """One transaction, one SAVEPOINT per append: an append refused (DuplicateRecord,
        LeaseLost, RunClosed) is rolled back alone with its own error; the others commit.
        An SQLite error (busy, full, read-only, damaged...) fails the whole batch, each
        append with the error it would have had alone: nothing of the batch is recorded.
        """
        db, now = self._db, time.time()
        outcomes: dict[int, Outcome] = {}
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                plain = [n for n, item in enumerate(batch) if _plain(item)]
                if len(plain) > 1 and self._write_plain([batch[n] for n in plain], now):
                    for n in plain:
                        outcomes[n] = None
                        crash_point("inside_commit")
                for n, item in enumerate(batch):
                    if n not in outcomes:
                        outcomes[n] = self._write_apart(item, now)
            except BaseException:
                db.rollback()
                raise
            db.commit()
        except sqlite3.Error as exc:
            return [self._translated(exc) for _ in batch]
        return [outcomes[n] for n in range(len(batch))]

    def _write_apart(self, item: _Append, now: float) -> Outcome:
        """One append of a batch in its own SAVEPOINT: refused, it is rolled back alone."""
        db = self._db
        db.execute("SAVEPOINT one_append")
        try:
            self._write(item, now, alone=False)
        except (JournalError, UsageError) as exc:
            db.execute("ROLLBACK TO one_append")
            return exc
        else:
            crash_point("inside_commit")
            return None
        finally:
            db.execute("RELEASE one_append")

    def _write_plain(self, items: list[_Append], now: float) -> bool:
        """The plain appends of a batch (leased, budget unchanged, one per run) in three
        statements at most, whatever their number; False, and nothing written, if any
        one is refused (its lease lost, a record already there): then each is written
        apart, to fail alone. Few statements matter off the loop: each one gives the
        GIL up and waits to get it back while the loop is busy.
        """
        if len({item.run_id for item in items}) < len(items):
            return False
        db = self._db
        same = [item for item in items if item.status is None]
        changed = [item for item in items if item.status is not None]
        db.execute("SAVEPOINT plain_appends")
        try:
            for group, status, width in ((same, "", 11), (changed, _STATUS_OF_VALUES, 12)):
                for chunk in _chunks(group, _ROWS_PER_UPDATE):
                    row = "(" + ", ".join(["?"] * width) + ")"
                    sql = _APPEND_PLAIN.format(status=status, values=", ".join([row] * len(chunk)))
                    args = [arg for item in chunk for arg in _plain_params(item)]
                    if db.execute(sql, [now, *args]).rowcount != len(chunk):
                        raise _Refused
            rows = [row for item in items for row in item.rows]
            for part in _chunks(rows, _ROWS_PER_INSERT):
                sql = "INSERT INTO journal VALUES " + ", ".join(["(?, ?, ?, ?, ?, ?)"] * len(part))
                db.execute(sql, [value for row in part for value in row])
            self._give_up(_releases(items), now)
        except (_Refused, sqlite3.IntegrityError):
            db.execute("ROLLBACK TO plain_appends")
            db.execute("RELEASE plain_appends")
            return False
        db.execute("RELEASE plain_appends")
        return True

    def _write(self, item: _Append, now: float, *, alone: bool) -> None:
        """The statements of one append, inside a transaction the caller opened."""
        db, counts, lease, status = self._db, item.counts, item.lease, item.status
        run_id, rows = item.run_id, item.rows
        if lease is not None and status is None and not counts["budget"]:  # the lease checked
            added = (len(rows), now, counts["calls"], counts["tools"], counts["inp"])
            more = (counts["out"], counts["cost"], counts["cread"], counts["cwrite"])
            where = (run_id, lease.token, lease.owner)
            row = added + more + where
            if db.execute(_APPEND_LEASED_SAME_STATUS, row).rowcount == 0:
                raise lease_lost(lease)
        else:
            params = {"run_id": run_id, "status": status, "added": len(rows), "now": now}
            params |= counts
            if lease is None:
                if db.execute(_UPSERT_RUN, params).rowcount == 0:
                    raise run_closed(run_id)
            else:
                params |= {"token": lease.token, "owner": lease.owner}
                if db.execute(_APPEND_LEASED, params).rowcount == 0:
                    raise lease_lost(lease)
        try:
            db.executemany(_INSERT_RECORD, rows)
        except sqlite3.IntegrityError:
            raise self._duplicate(run_id, rows, alone=alone) from None
        if item.release is not None:  # the closing append: its lease goes with it
            self._give_up(_releases([item]), now)

    def _duplicate(self, run_id: str, rows: list[Row], *, alone: bool) -> DuplicateRecord:
        """Undo the append's rows and name its first record the journal already held."""
        if alone:
            self._db.rollback()
        else:  # one append of a batch: only its own savepoint
            self._db.execute("ROLLBACK TO one_append")
        sql = "SELECT 1 FROM journal WHERE run_id = ? AND step_id = ? AND phase = ?"
        for row in rows:
            if self._db.execute(sql, row[:3]).fetchone() is not None:
                return DuplicateRecord(run_id, row[1], row[2])
        return DuplicateRecord(run_id, rows[0][1], rows[0][2])

    def _check_lease(self, lease: Lease) -> None:
        params = {"run_id": lease.run_id, "token": lease.token, "owner": lease.owner}
        if self._db.execute(_CHECK_LEASE, {**params, "now": time.time()}).rowcount == 0:
            raise lease_lost(lease)

    async def acquire(
        self, run_id: str, holder: Holder, *, ttl: float, force: bool = False
    ) -> Lease:
        return await self._thread.send(self._acquire, run_id, holder, ttl, force)

    def _acquire(self, run_id: str, holder: Holder, ttl: float, force: bool) -> Lease:
        sql = (
            "SELECT lease_owner, lease_host, lease_pid, lease_started, lease_expires, fence"
            " FROM runs WHERE run_id = ?"
        )
        now = time.time()
        with self._errors(), self._transaction():
            row = self._db.execute(sql, (run_id,)).fetchone()
            if row is None:
                self._db.execute(
                    "INSERT INTO runs (run_id, status, events, created_at, updated_at, queued_at)"
                    " VALUES (?, 'running', 0, ?, ?, ?)",
                    (run_id, now, now, now),
                )
                row = (None, None, None, None, None, 0)
            owner, host, pid, started, expires, fence = row
            current = {"owner": owner, "host": host, "pid": pid, "started": started}
            if not force and not may_take(**current, expires=expires, holder=holder, now=now):
                raise run_locked(run_id, host, pid, expires, now)
            self._take(run_id, holder, ttl, fence, now)
        return Lease(run_id=run_id, token=fence + 1, owner=holder.owner, expires=now + ttl)

    def _take(self, run_id: str, holder: Holder, ttl: float, fence: int, now: float) -> None:
        self._db.execute(
            "UPDATE runs SET lease_owner = ?, lease_host = ?, lease_pid = ?, lease_started = ?,"
            " lease_expires = ?, lease_ttl = ?, fence = ? WHERE run_id = ?",
            (
                holder.owner,
                holder.host,
                holder.pid,
                holder.started,
                now + ttl,
                ttl,
                fence + 1,
                run_id,
            ),
        )

    async def renew(self, lease: Lease, *, ttl: float) -> Lease:
        now = time.time()
        # Ahead of the work queued, and with every renewal due meanwhile: one commit for
        # all the leases of a worker, however many runs it drives.
        await self._thread.together(self._renew_all, (lease, ttl), urgent=True)
        return Lease(run_id=lease.run_id, token=lease.token, owner=lease.owner, expires=now + ttl)

    def _renew_all(self, renewals: list[tuple[Lease, float]]) -> list[Outcome]:
        """Renew the leases in one statement; a lease no longer held gets ``LeaseLost``."""
        now, renewed = time.time(), set[tuple[str, int]]()
        try:
            with self._transaction():
                for chunk in _chunks(renewals, _ROWS_PER_UPDATE):
                    values = ", ".join(["(?, ?, ?, ?)"] * len(chunk))
                    args = [
                        a
                        for lease, ttl in chunk
                        for a in (lease.run_id, lease.token, lease.owner, ttl)
                    ]
                    rows = self._db.execute(_RENEW.format(values=values), [now, *args]).fetchall()
                    renewed.update((run_id, fence) for run_id, fence in rows)
        except sqlite3.Error as exc:
            return [self._translated(exc) for _ in renewals]
        return [
            None if (lease.run_id, lease.token) in renewed else lease_lost(lease)
            for lease, _ in renewals
        ]

    async def release(
        self, lease: Lease, *, savings: Savings | None = None, clean: bool = False
    ) -> None:
        # With the releases queued meanwhile: one commit when many runs end at once.
        await self._thread.together(self._release_all, (lease, savings or Savings(), clean))
        self._wakeup.ring()

    def _release_all(self, releases: list[tuple[Lease, Savings, bool]]) -> list[Outcome]:
        """Give the leases up (those still held) in one statement."""
        try:
            with self._transaction():
                self._give_up(releases, time.time())
        except sqlite3.Error as exc:
            return [self._translated(exc) for _ in releases]
        return [None] * len(releases)

    def _give_up(self, releases: list[tuple[Lease, Savings, bool]], now: float) -> None:
        """The statements of releases, inside a transaction the caller opened."""
        for chunk in _chunks(releases, _ROWS_PER_UPDATE):
            values = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * len(chunk))
            args = [
                value
                for lease, saved, clean in chunk
                for value in (
                    *(lease.run_id, lease.token, lease.owner, saved.calls),
                    *(saved.input_tokens, saved.output_tokens, saved.cost, clean),
                )
            ]
            self._db.execute(_RELEASE.format(values=values), [now, *args])

    async def load(self, run_id: str) -> list[StepEvent]:
        sql = (
            "SELECT step_id, phase, decision, payload, created_at FROM journal"
            " WHERE run_id = ? ORDER BY rowid"
        )
        rows = await self._thread.call(self._all, sql, (run_id,))
        return [decode_row(run_id, row) for row in rows]

    def _all(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        with self._errors():
            return self._db.execute(sql, args).fetchall()

    def _one(self, sql: str, args: tuple[Any, ...]) -> Any:
        with self._errors():
            return self._db.execute(sql, args).fetchone()

    async def load_step(self, run_id: str, step_id: str) -> list[StepEvent]:
        sql = (
            "SELECT step_id, phase, decision, payload, created_at FROM journal"
            " WHERE run_id = ? AND step_id = ? ORDER BY rowid"
        )
        rows = await self._thread.call(self._all, sql, (run_id, step_id))
        return [decode_row(run_id, row) for row in rows]

    async def final(self, run_id: str) -> StepEvent | None:
        sql = (
            "SELECT step_id, phase, decision, payload, created_at FROM journal"
            " WHERE run_id = ? AND step_id = ? AND phase = ?"
        )
        row = await self._thread.call(self._one, sql, (run_id, step_ids.FINAL, Phase.RESULT.value))
        return None if row is None else decode_row(run_id, row)

    async def age(self, run_id: str, step_id: str, phase: Phase) -> float | None:
        sql = "SELECT created_at FROM journal WHERE run_id = ? AND step_id = ? AND phase = ?"
        row = await self._thread.call(self._one, sql, (run_id, step_id, Phase(phase).value))
        return None if row is None else _clock.now() - float(row[0])

    async def set_status(
        self,
        run_id: str,
        status: RunStatus,
        *,
        reason: str | None = None,
        lease: Lease | None = None,
        waits_for: tuple[str, Phase] | None = None,
    ) -> bool:
        value = RunStatus(status).value
        changed = await self._thread.send(self._set_status, run_id, value, reason, lease, waits_for)
        if changed:
            self._wakeup.ring()
        return changed

    def _set_status(
        self,
        run_id: str,
        value: str,
        reason: str | None,
        lease: Lease | None,
        waits_for: tuple[str, Phase] | None,
    ) -> bool:
        with self._errors(), self._transaction():
            if lease is not None:
                self._check_lease(lease)
            if waits_for is not None and self._holds(run_id, *waits_for):
                return False
            params = {"status": value, "now": time.time(), "reason": reason, "run_id": run_id}
            cur = self._db.execute(_SET_STATUS, params)
            if cur.rowcount == 0:
                raise self._not_markable(run_id)
        return True

    def _holds(self, run_id: str, step_id: str, phase: Phase) -> bool:
        sql = "SELECT 1 FROM journal WHERE run_id = ? AND step_id = ? AND phase = ?"
        return self._db.execute(sql, (run_id, step_id, Phase(phase).value)).fetchone() is not None

    def _not_markable(self, run_id: str) -> UsageError:
        """Why ``set_status`` changed no row: the run is unknown, or closed."""
        if self._db.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone():
            return run_closed(run_id)
        return UsageError(f"unknown run {run_id!r} in {self.path}")

    async def submit(self, run_id: str, task: str, *, agent: str = "default") -> None:
        check_id("run_id", run_id)
        await self._thread.send(self._submit, run_id, task, agent)
        self._wakeup.ring()

    def _submit(self, run_id: str, task: str, agent: str) -> None:
        now = time.time()
        with self._errors(), self._transaction():
            try:
                self._db.execute(
                    "INSERT INTO runs (run_id, status, events, created_at, updated_at, queued_at,"
                    " task, agent) VALUES (?, 'running', 0, ?, ?, ?, ?, ?)",
                    (run_id, now, now, now, task, agent),
                )
            except sqlite3.IntegrityError:
                raise UsageError(f"run {run_id!r} already exists in {self.path}") from None

    async def claim(
        self, holder: Holder, *, ttl: float, max_attempts: int = 5, max_lapses: int = 0
    ) -> Claim | None:
        claims = await self._thread.send(self._claim, holder, 1, ttl, max_attempts, max_lapses)
        return claims[0] if claims else None

    def _claim(
        self, holder: Holder, limit: int, ttl: float, max_attempts: int, max_lapses: int
    ) -> list[Claim]:
        """Up to ``limit`` claims in one transaction (one commit for a worker's free slots)."""
        taken: list[Claim] = []
        parked: list[str] = []  # the causes of the runs this claim parked
        with self._errors(), self._transaction():
            while len(taken) < limit and (
                claim := self._claim_one(holder, ttl, max_attempts, max_lapses, parked)
            ):
                taken.append(claim)
        for cause in parked:  # committed: counted once, by the process that parked
            metrics.parked(cause)
        return taken

    def _claim_one(
        self, holder: Holder, ttl: float, max_attempts: int, max_lapses: int, parked: list[str]
    ) -> Claim | None:
        for _ in range(_MAX_PARKED_PER_CLAIM):
            now = time.time()
            row = self._db.execute(_CLAIMABLE, {"now": now}).fetchone()
            if row is None:
                return None
            run_id, task, agent, attempts, reason, fence, lapsed, lapses, progressed = row
            judged = rules.charge(
                attempts=attempts,
                lapses=lapses,
                lapsed=bool(lapsed),
                in_flight=self._in_flight(run_id) if lapsed else None,
                progressed=bool(progressed),
            )
            if judged.in_flight is not None:
                reason = rules.died_in(judged.in_flight)
            self._db.execute(
                "UPDATE runs SET attempts = ?, lapses = ?, reason = ? WHERE run_id = ?",
                (judged.attempts, judged.lapses, reason, run_id),
            )
            if rules.parks(judged.attempts, max_attempts, judged.lapses, max_lapses):
                why = rules.parked_reason(
                    judged.attempts, reason, lapses=judged.lapses, max_lapses=max_lapses
                )
                params = {"status": "parked", "now": now, "run_id": run_id}
                self._db.execute(_SET_STATUS, params | {"reason": why})
                parked.append(rules.park_cause(judged.lapses, max_lapses))
                continue
            self._take(run_id, holder, ttl, fence, now)
            self._db.execute(
                "UPDATE runs SET attempts = attempts + 1, claim_events = events, queued_at = ?"
                " WHERE run_id = ?",
                (now, run_id),
            )
            lease = Lease(run_id=run_id, token=fence + 1, owner=holder.owner, expires=now + ttl)
            return Claim(
                lease=lease,
                task=task,
                agent=agent,
                attempts=judged.attempts + 1,
                in_flight=judged.in_flight,
            )
        return None

    def _in_flight(self, run_id: str) -> str | None:
        """``_rules.in_flight`` of the run's tool records, in the order they were written."""
        sql = (
            "SELECT step_id, phase FROM journal WHERE run_id = ? AND step_id LIKE '%.t%'"
            " ORDER BY rowid"
        )
        return rules.in_flight(self._db.execute(sql, (run_id,)))

    async def claim_many(
        self,
        holder: Holder,
        *,
        limit: int,
        ttl: float,
        max_attempts: int = 5,
        max_lapses: int = 0,
    ) -> list[Claim]:
        taken: list[Claim] = []
        while len(taken) < limit:  # in chunks: a renewal never waits for hundreds of claims
            want = min(_CLAIMS_PER_TRANSACTION, limit - len(taken))
            got = await self._thread.send(self._claim, holder, want, ttl, max_attempts, max_lapses)
            taken += got
            if len(got) < want:
                break
        return taken

    async def wait_for_work(self, timeout: float) -> None:
        await self._wakeup.wait(timeout)  # this object's writes ring; others' wait the poll

    async def runs(self, *, status: RunStatus | None = None) -> list[RunInfo]:
        sql = f"SELECT {_RUN_COLUMNS} FROM runs"
        args: tuple[str, ...] = ()
        if status is not None:
            sql, args = sql + " WHERE status = ?", (RunStatus(status).value,)
        rows = await self._thread.call(self._all, sql + " ORDER BY created_at, run_id", args)
        return [run_info(row) for row in rows]

    async def run(self, run_id: str) -> RunInfo | None:
        sql = f"SELECT {_RUN_COLUMNS} FROM runs WHERE run_id = ?"
        row = await self._thread.call(self._one, sql, (run_id,))
        return None if row is None else run_info(row)

    async def close(self) -> None:
        await self._thread.send(self._db.close)  # after the work queued before it
        self._thread.stop()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.rollback()
            raise
        self._db.commit()

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Turn SQLite's errors into asiento's, naming the file."""
        try:
            yield
        except sqlite3.Error as exc:
            raise self._translated(exc) from exc

    def _translated(self, exc: sqlite3.Error) -> Exception:
        """The asiento error for one of SQLite's (errors outside these two classes pass)."""
        if _error_name(exc) == "SQLITE_NOTADB" and not looks_like_a_journal(self.path):
            return NotAJournal(
                f"{self.path} is not an asiento journal ({exc}); it was left as it is"
            )
        trouble = self._trouble(exc)
        if trouble is None:
            return exc
        text = "; ".join(
            part for part in (f"{self.path}: {trouble.cause}", trouble.outcome) if part
        )
        return trouble.kind(f"{text}. {trouble.advice}" if trouble.advice else text)

    def _migration_failed(self, exc: Exception, progress: Progress) -> JournalError:
        """The error for a migration that failed: which one, why, unchanged, what to do."""
        trouble = self._trouble(exc) if isinstance(exc, sqlite3.Error) else None
        kind = trouble.kind if trouble is not None else JournalError
        cause = trouble.cause if trouble is not None else f"{type(exc).__name__}: {exc}"
        text = f"{self.path}: {progress.step()} could not be applied: {cause}. {progress.kept()}"
        if trouble is not None and kind is not JournalError:
            return kind(f"{text}. {trouble.advice}")
        return MigrationFailed(
            f"{text}. {MIGRATION_ADVICE}",
            migration=progress.number or progress.start + 1,
            version=progress.start,
        )

    def _trouble(self, exc: sqlite3.Error) -> _Trouble | None:
        """What one of SQLite's errors means for this journal (None: not a database error)."""
        text, name = str(exc), _error_name(exc)
        if name.startswith("SQLITE_READONLY") or "readonly database" in text:
            return self._read_only(exc)
        if name.startswith("SQLITE_CORRUPT") or name == "SQLITE_NOTADB" or "decode" in text:
            return self._corrupt(exc)
        if isinstance(exc, sqlite3.OperationalError):
            if "is full" in text:
                return _Trouble(JournalFull, text, _NOTHING, "Free some space, then resume the run")
            if limit := self._limit_behind(exc):
                advice = "Raise the limit or free some space, then resume the run"
                return _Trouble(JournalFull, f"{text} ({limit})", _NOTHING, advice)
            if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
                cause = (
                    f"{text}: another process held the journal's lock for longer than the "
                    f"{self._timeout:g} s timeout"
                )
                return _Trouble(JournalBusy, cause, "nothing was written", "Retry once it lets go")
            if name.startswith("SQLITE_CANTOPEN"):
                advice = "Check that its folder exists and that this process may write there"
                return _Trouble(JournalError, f"cannot open the journal file ({text})", "", advice)
            return _Trouble(JournalError, text, "", "")
        if isinstance(exc, sqlite3.DatabaseError):
            return self._corrupt(exc)
        return None

    def _read_only(self, exc: sqlite3.Error) -> _Trouble:
        why = unwritable(self.path)
        if why is None and self.read_only:
            cause = f"this store was opened with read_only=True ({exc})"
            advice = "Open it without read_only=True to record anything"
            return _Trouble(JournalReadOnly, cause, _NOTHING, advice)
        advice = (
            "Make the journal writable (the file, and its folder, where SQLite keeps the -wal "
            "and -shm files), then try again"
        )
        cause = f"cannot write the journal: {why or 'SQLite may not write it'} ({exc})"
        return _Trouble(JournalReadOnly, cause, _NOTHING, advice)

    def _limit_behind(self, exc: sqlite3.Error) -> str | None:
        """The limit a bare "disk I/O error" ran into, if it was one (EFBIG, EDQUOT)."""
        if "disk I/O error" not in str(exc):
            return None
        return _NO_ROOM.get(os_errno(self._db, self.path) or 0)

    def _corrupt(self, exc: sqlite3.Error) -> _Trouble:
        """A damaged file, which from now on closing will not checkpoint."""
        if keep_wal_on_close(self._db, self.path):
            outcome = "it was left as it is, and asiento will not write to it"
        else:
            outcome = (
                "copy the file and its -wal before closing this store: this Python cannot stop "
                "SQLite from checkpointing the WAL on close"
            )
        advice = (
            "Restore the journal from a backup, or salvage what SQLite can still read into a "
            f"new file (sqlite3 {shlex.quote(str(self.path))} .recover | sqlite3 salvaged.db) "
            "and check it before resuming its runs"
        )
        return _Trouble(JournalCorrupt, f"the journal file is damaged ({exc})", outcome, advice)


_NOTHING = "nothing of this write was recorded"


@dataclass(frozen=True, slots=True)
class _Trouble:
    """What an SQLite error means: the error to raise, why, what it left, what to do."""

    kind: type[JournalError]
    cause: str
    outcome: str
    advice: str


def _error_name(exc: sqlite3.Error) -> str:
    return str(getattr(exc, "sqlite_errorname", "") or "")
