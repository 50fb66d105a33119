"""The journal in PostgreSQL, for many workers on many machines (psycopg 3, async pool).

    store = await PostgresCheckpointer.connect("postgresql://app@db/agents")
    ...   # Session("run-1", gateway, store), Worker(store, app), open_store(url)
    await store.close()

or ``async with PostgresCheckpointer(dsn) as store:``; a store only constructed
opens itself at its first use. The pool belongs to the event loop that opened
it. Opening applies the missing migrations (numbered, recorded in the table
``asiento_schema``) in one transaction under an advisory lock, so any number
of workers may open a new database at once.

Semantics are ``SqliteCheckpointer``'s, except that lease times come from the
server's clock, the one clock every worker shares. A connection lost before
COMMIT leaves nothing behind and the work is retried on a new connection, with
backoff, for up to ``retry_for`` seconds; a COMMIT whose outcome is unknown is
read back before ``append`` tries again or returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, Self, TypeVar

try:  # the postgres extra; without it, say which one to install
    import psycopg
    from psycopg import AsyncConnection
    from psycopg.conninfo import conninfo_to_dict, make_conninfo
    from psycopg.rows import TupleRow
    from psycopg_pool import AsyncConnectionPool
except ImportError as exc:  # not installed (ModuleNotFoundError), or no libpq found
    _missing = ModuleNotFoundError if isinstance(exc, ModuleNotFoundError) else ImportError
    raise _missing(
        f"PostgreSQL journals need psycopg: pip install 'asiento[postgres]' ({exc})",
        name=exc.name,
    ) from exc

from .. import step_ids
from .._crash import crash_point
from ..errors import (
    DuplicateRecord,
    JournalBusy,
    JournalError,
    JournalTooNew,
    MigrationFailed,
    NotAJournal,
    UsageError,
)
from ..events import Claim, Lease, Phase, RunInfo, RunStatus, Savings, StepEvent
from ..lease import Holder
from ..telemetry import metrics
from . import _postgres_schema as sql
from ._backfill import (
    BUDGET_RECORDS,
    CACHE_RECORDS,
    MIGRATION_ADVICE,
    CacheTotals,
    RunBudgets,
)
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

T = TypeVar("T")
Conn = AsyncConnection[TupleRow]
Work = Callable[[Conn], Awaitable[T]]
Landed = Callable[[], Awaitable[bool]]

# How many runs one claim may park before it gives up for this call.
_MAX_PARKED_PER_CLAIM = 100

# The phases of a person's decision: appending one may make a waiting run claimable.
_DECISIONS = frozenset({Phase.APPROVAL.value, Phase.RESOLUTION.value})

# Connections say who they are in pg_stat_activity, unless the DSN names them.
_CONNECT: dict[str, Any] = {"autocommit": True, "fallback_application_name": "asiento"}
_CONNECT_TIMEOUT = 10


class _CommitUnknown(Exception):
    """The connection died during COMMIT: the transaction may or may not be recorded."""


class _Conflict(Exception):
    """A statement hit a record already in the journal, and wrote nothing."""


class _ConnectionLost(Exception):
    """The connection died before COMMIT: nothing of the transaction was recorded."""


class _Retry:
    """Backoff between attempts on new connections, bounded by a time budget."""

    def __init__(self, budget: float) -> None:
        self._deadline = time.monotonic() + budget
        self._delay = 0.02

    async def pause(self, give_up: JournalError) -> None:
        """Sleep before the next attempt, or raise ``give_up`` once the budget is spent."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise give_up
        await asyncio.sleep(min(self._delay, left))
        self._delay = min(self._delay * 2, 1.0)


class PostgresCheckpointer:
    """Journal in a PostgreSQL database, shared by any number of processes and machines.

    ``dsn`` is a libpq connection string or URL; ``min_size`` and ``max_size``
    bound the connection pool; ``timeout`` is how long to wait for a connection
    (and, while migrating, for a table another session holds);
    ``retry_for`` is how long one operation keeps retrying, on new connections,
    when its connection is lost (a failover, a terminated backend), so that a tool
    result already paid for is not dropped over a blip. Error messages name the
    database without its password.
    """

    def __init__(
        self,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 10,
        timeout: float = 30.0,
        retry_for: float = 10.0,
    ) -> None:
        if not 0 <= min_size <= max_size or max_size < 1:
            raise UsageError("PostgresCheckpointer needs 0 <= min_size <= max_size, max_size >= 1")
        if not timeout > 0 or not retry_for >= 0:
            raise UsageError("PostgresCheckpointer needs timeout > 0 and retry_for >= 0 (seconds)")
        self.dsn = dsn
        self.where = redact(dsn)
        self._connect = dict(_CONNECT)
        if "connect_timeout" not in conninfo_to_dict(dsn):
            self._connect["connect_timeout"] = _CONNECT_TIMEOUT
        self._sizes = (min_size, max_size)
        self._timeout = timeout
        self._retry_for = retry_for
        self._pool: AsyncConnectionPool[Conn] | None = None
        self._opening: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._handed: set[tuple[str, int]] = set()  # (run, fence) claim_many handed out
        self._listener: asyncio.Task[None] | None = None
        self._notified: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"PostgresCheckpointer({self.where!r})"

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 10,
        timeout: float = 30.0,
        retry_for: float = 10.0,
    ) -> Self:
        """Construct and open a store: ``await PostgresCheckpointer.connect(dsn)``."""
        store = cls(dsn, min_size=min_size, max_size=max_size, timeout=timeout, retry_for=retry_for)
        return await store.open()

    async def open(self) -> Self:
        """Apply missing migrations and open the pool; idempotent. Needs a running loop."""
        if self._closed:
            raise UsageError(f"{self!r} was closed; open a new one")
        self._opening = self._opening or asyncio.Lock()
        async with self._opening:
            if self._pool is None:
                await self._migrate()
                self._pool = await self._open_pool()
                self._loop = asyncio.get_running_loop()
        return self

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    # -- the protocol ---------------------------------------------------------------------

    async def append(
        self,
        *events: StepEvent,
        status: RunStatus | None = None,
        lease: Lease | None = None,
        release: Savings | None = None,
    ) -> None:
        run_id, rows = encode_batch(events)
        release = check_release(release, status, lease)
        state = None if status is None else RunStatus(status).value
        params = {"run_id": run_id, "status": state, "added": len(rows)}
        params |= counts_of(events)
        if release is not None:
            params |= _saved_params(release)
        if lease is not None and not any(row[2] in _DECISIONS for row in rows):
            once = partial(self._append_leased, rows, params, lease, release is not None)
        else:
            append = partial(self._append_rows, rows, params, lease, release is not None)
            once = partial(self._transact_once, append)
        await self._exactly_once(once, partial(self._recorded, rows[0]))
        if lease is not None and release is not None:
            self._handed.discard((lease.run_id, lease.token))

    async def _append_leased(
        self, rows: list[Row], params: dict[str, Any], lease: Lease, release: bool
    ) -> None:
        """A step's records under its lease in one statement: the hot path of every pass."""
        batch = json.dumps(rows, ensure_ascii=False, allow_nan=False)
        params = params | {"token": lease.token, "owner": lease.owner, "rows": batch}
        query = sql.APPEND_RELEASED_EVENTS if release else sql.APPEND_LEASED_EVENTS
        crash_point("inside_commit")  # dying here writes nothing, as inside a transaction
        try:
            ((held, _),) = await self._statement_once(query, params)
        except _Conflict:
            raise await self._duplicate(rows) from None
        if not held:
            raise lease_lost(lease)

    async def _duplicate(self, rows: list[Row]) -> DuplicateRecord:
        """The record of the batch already in the journal (what aborted the append)."""
        for run_id, step_id, phase, *_ in rows:
            if await self._fetch(sql.HOLDS, (run_id, step_id, phase)):
                return DuplicateRecord(run_id, step_id, phase)
        run_id, step_id, phase, *_ = rows[0]  # gone again meanwhile: still refused
        return DuplicateRecord(run_id, step_id, phase)

    async def _append_rows(
        self,
        rows: list[Row],
        params: dict[str, Any],
        lease: Lease | None,
        release: bool,
        conn: Conn,
    ) -> None:
        if lease is None:
            cur = await conn.execute(sql.UPSERT_RUN, params)
            if await cur.fetchone() is None:
                raise run_closed(params["run_id"])
        else:  # the lease is checked, and extended or given up, in the append's transaction
            query = sql.APPEND_RELEASED if release else sql.APPEND_LEASED
            cur = await conn.execute(query, params | {"token": lease.token, "owner": lease.owner})
            if await cur.fetchone() is None:
                raise lease_lost(lease)
        columns = [list(column) for column in zip(*rows, strict=True)]
        cur = await conn.execute(sql.INSERT_EVENTS, columns)
        written = set(await cur.fetchall())
        for run_id, step_id, phase, *_ in rows:
            if (step_id, phase) not in written:
                raise DuplicateRecord(run_id, step_id, phase)
        if any(phase in _DECISIONS for _, _, phase, *_ in rows):
            await conn.execute(sql.NOTIFY_WORK)  # a person's decision: the run may go on
        crash_point("inside_commit")

    async def _recorded(self, row: Row) -> bool:
        """Whether exactly this record (same payload, same time) is in the journal."""
        run_id, step_id, phase, decision, payload, created_at = row
        found = await self._fetch(
            "SELECT decision, payload, created_at FROM journal"
            " WHERE run_id = %s AND step_id = %s AND phase = %s",
            (run_id, step_id, phase),
        )
        return found == [(decision, payload, created_at)]

    async def acquire(
        self, run_id: str, holder: Holder, *, ttl: float, force: bool = False
    ) -> Lease:
        async def take(conn: Conn) -> Lease:
            await conn.execute(sql.CREATE_RUN, (run_id,))
            row = await _one(conn, sql.LOCK_RUN, (run_id,))
            owner, host, pid, started, expires, fence, now = row
            current = {"owner": owner, "host": host, "pid": pid, "started": started}
            if not force and not may_take(**current, expires=expires, holder=holder, now=now):
                raise run_locked(run_id, host, pid, expires, now)
            values = (holder.owner, holder.host, holder.pid, holder.started, now + ttl, ttl)
            await conn.execute(sql.TAKE_LEASE, (*values, fence + 1, run_id))
            return Lease(run_id=run_id, token=fence + 1, owner=holder.owner, expires=now + ttl)

        return await self._idempotent(take)

    async def renew(self, lease: Lease, *, ttl: float) -> Lease:
        params = {"ttl": ttl, "run_id": lease.run_id, "token": lease.token, "owner": lease.owner}
        once = partial(self._statement_once, sql.RENEW, params)
        found = await self._retried(once)
        if not found:
            raise lease_lost(lease)
        expires = float(found[0][0])
        return Lease(run_id=lease.run_id, token=lease.token, owner=lease.owner, expires=expires)

    async def release(
        self, lease: Lease, *, savings: Savings | None = None, clean: bool = False
    ) -> None:
        saved = savings or Savings()
        args = (
            saved.calls,
            saved.input_tokens,
            saved.output_tokens,
            saved.cost,
            clean,
            lease.run_id,
            lease.token,
        )

        self._handed.discard((lease.run_id, lease.token))
        await self._retried(partial(self._statement_once, sql.RELEASE_NOTIFY, (*args, lease.owner)))

    async def load(self, run_id: str) -> list[StepEvent]:
        rows = await self._fetch(sql.SELECT_EVENTS + " WHERE run_id = %s ORDER BY seq", (run_id,))
        return [decode_row(run_id, row) for row in rows]

    async def load_step(self, run_id: str, step_id: str) -> list[StepEvent]:
        query = sql.SELECT_EVENTS + " WHERE run_id = %s AND step_id = %s ORDER BY seq"
        rows = await self._fetch(query, (run_id, step_id))
        return [decode_row(run_id, row) for row in rows]

    async def final(self, run_id: str) -> StepEvent | None:
        query = sql.SELECT_EVENTS + " WHERE run_id = %s AND step_id = %s AND phase = %s"
        rows = await self._fetch(query, (run_id, step_ids.FINAL, Phase.RESULT.value))
        return decode_row(run_id, rows[0]) if rows else None

    async def age(self, run_id: str, step_id: str, phase: Phase) -> float | None:
        rows = await self._fetch(sql.AGE, (run_id, step_id, Phase(phase).value))
        return None if not rows else float(rows[0][0])

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

        async def mark(conn: Conn) -> bool:
            locked = await (await conn.execute(sql.LOCK_STATUS, (run_id,))).fetchone()
            if locked is None:
                raise UsageError(f"unknown run {run_id!r} in {self.where}")
            if lease is not None:
                await _check_lease(conn, lease)
            if waits_for is not None:
                step_id, phase = waits_for
                found = await conn.execute(sql.HOLDS, (run_id, step_id, Phase(phase).value))
                if await found.fetchone() is not None:
                    return False
            if locked[0] == RunStatus.CLOSED and value != RunStatus.CLOSED:
                raise run_closed(run_id)
            params = {"status": value, "reason": reason, "run_id": run_id}
            await conn.execute(sql.SET_STATUS, params)
            if value == RunStatus.RUNNING:
                await conn.execute(sql.NOTIFY_WORK)
            return True

        return await self._idempotent(mark)

    async def submit(self, run_id: str, task: str, *, agent: str = "default") -> None:
        check_id("run_id", run_id)
        if "\x00" in task or "\x00" in agent:
            raise UsageError(f"run {run_id!r}: task and agent must not contain NUL characters")

        async def insert(conn: Conn) -> None:
            cur = await conn.execute(sql.SUBMIT, (run_id, task, agent))
            if await cur.fetchone() is None:
                raise UsageError(f"run {run_id!r} already exists in {self.where}")
            await conn.execute(sql.NOTIFY_WORK)

        async def landed() -> bool:
            query = "SELECT task, agent FROM runs WHERE run_id = %s"
            return await self._fetch(query, (run_id,)) == [(task, agent)]

        await self._exactly_once(partial(self._transact_once, insert), landed)

    async def claim(
        self, holder: Holder, *, ttl: float, max_attempts: int = 5, max_lapses: int = 0
    ) -> Claim | None:
        claims = await self.claim_many(
            holder, limit=1, ttl=ttl, max_attempts=max_attempts, max_lapses=max_lapses
        )
        return claims[0] if claims else None

    async def claim_many(
        self,
        holder: Holder,
        *,
        limit: int,
        ttl: float,
        max_attempts: int = 5,
        max_lapses: int = 0,
    ) -> list[Claim]:
        """Up to ``limit`` runs in one statement (``CLAIM_MANY``): picked oldest first with
        SKIP LOCKED, the over-claimed parked and the rest leased in the same statement."""
        params: dict[str, Any] = {"limit": limit, "ttl": ttl, "max_attempts": max_attempts}
        params["max_lapses"] = max_lapses
        params |= {"owner": holder.owner, "host": holder.host, "pid": holder.pid}
        params["started"] = holder.started

        causes: Counter[str] = Counter()  # the runs the committed claim parked, by cause

        async def take(conn: Conn, *, unsure: bool) -> list[Claim]:
            claims = await self._held_unknown(conn, holder, ttl, limit) if unsure else []
            parked = 0
            causes.clear()
            while len(claims) < limit and parked < _MAX_PARKED_PER_CLAIM:
                want = params | {"limit": limit - len(claims)}
                rows = await (await conn.execute(sql.CLAIM_MANY, want)).fetchall()
                newly, lapsed = int(rows[0][0]), int(rows[0][1])
                causes.update({"max_lapses": lapsed, "max_attempts": newly - lapsed})
                for _, _, run_id, task, agent, attempts, fence, expires, flight in rows:
                    if run_id is None:
                        continue  # nothing leased: the row only counts the parked runs
                    lease = Lease(run_id=run_id, token=fence, owner=holder.owner, expires=expires)
                    claims.append(
                        Claim(
                            lease=lease, task=task, agent=agent, attempts=attempts, in_flight=flight
                        )
                    )
                if not newly:
                    break  # the queue is empty, or only parked runs stood in the way
                parked += newly
            return claims

        # A redo after a lost COMMIT first takes back what that COMMIT leased, if it landed.
        claims = await self._idempotent(
            partial(take, unsure=False), after_unknown=partial(take, unsure=True)
        )
        self._handed.update((claim.lease.run_id, claim.lease.token) for claim in claims)
        for cause, count in causes.items():
            for _ in range(count):
                metrics.parked(cause)
        return claims

    async def _held_unknown(
        self, conn: Conn, holder: Holder, ttl: float, limit: int
    ) -> list[Claim]:
        """Runs ``holder`` holds that this store never handed out: a cut-off claim's."""
        rows = await (await conn.execute(sql.HELD_ALL, (holder.owner,))).fetchall()
        claims: list[Claim] = []
        for run_id, task, agent, attempts, fence, now in rows:
            if (run_id, fence) in self._handed or len(claims) >= limit:
                continue
            await conn.execute(sql.EXTEND_LEASE, (now + ttl, ttl, run_id, fence))
            lease = Lease(run_id=run_id, token=fence, owner=holder.owner, expires=now + ttl)
            claims.append(Claim(lease=lease, task=task, agent=agent, attempts=attempts))
        return claims

    async def wait_for_work(self, timeout: float) -> None:
        """Until a ``NOTIFY asiento_work`` (a submit, a release, a run set running, a
        decision) or ``timeout``. A dedicated connection listens, opened at the first wait;
        a fresh one returns at once (it may have missed a notification). If it is lost,
        this wait sleeps out ``timeout`` and the next one reconnects: never an error."""
        if self._closed:
            await asyncio.sleep(max(0.0, timeout))  # a closed store opens nothing again
            return
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._listen(), name=f"listen {self.where}")
        event = self._notified = self._notified or asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(0.0, timeout))
        event.clear()

    async def _listen(self) -> None:
        """Keep a LISTEN connection and set ``_notified`` for each notification, until lost."""
        event = self._notified = self._notified or asyncio.Event()
        try:
            conn = await AsyncConnection.connect(self.dsn, **self._connect)
            async with conn:
                await conn.execute(sql.LISTEN_WORK)
                event.set()  # anything submitted before this LISTEN was not heard
                async for _ in conn.notifies():
                    event.set()
        except Exception:  # lost or refused: waits sleep their timeout, the next reconnects
            return

    async def runs(self, *, status: RunStatus | None = None) -> list[RunInfo]:
        if status is None:
            rows = await self._fetch(sql.SELECT_RUNS + sql.ORDER_RUNS, ())
        else:
            query = sql.SELECT_RUNS + " WHERE status = %s" + sql.ORDER_RUNS
            rows = await self._fetch(query, (RunStatus(status).value,))
        return [run_info(row) for row in rows]

    async def run(self, run_id: str) -> RunInfo | None:
        rows = await self._fetch(sql.SELECT_RUNS + " WHERE run_id = %s", (run_id,))
        return run_info(rows[0]) if rows else None

    # -- connections and transactions ------------------------------------------------------

    async def _transact_once(self, work: Work[T]) -> T:
        """One attempt: ``_ConnectionLost`` if nothing was written, ``_CommitUnknown`` if unsure."""
        pool = await self._ready()
        with self._errors():
            async with pool.connection() as conn:
                try:
                    await conn.execute("BEGIN")
                    result = await work(conn)
                except psycopg.OperationalError as exc:
                    await _rollback(conn)
                    if conn.broken:
                        await pool.check()
                        raise _ConnectionLost(_text(exc)) from exc
                    raise
                except BaseException:
                    await _rollback(conn)
                    raise
                try:
                    await conn.execute("COMMIT")
                except psycopg.OperationalError as exc:
                    if conn.broken:
                        raise _CommitUnknown(_text(exc)) from exc
                    raise
                return result

    async def _statement_once(self, query: str, params: Any) -> list[TupleRow]:
        """One write statement in autocommit: one round trip, one commit.

        ``_CommitUnknown`` when the connection is lost meanwhile (the statement may have
        committed), ``_Conflict`` when it hit a record already there (it wrote nothing).
        """
        pool = await self._ready()
        with self._errors():
            async with pool.connection() as conn:
                try:
                    cur = await conn.execute(query, params)
                    return await cur.fetchall()
                except psycopg.errors.UniqueViolation as exc:
                    raise _Conflict(_text(exc)) from exc
                except psycopg.OperationalError as exc:
                    if conn.broken:
                        await pool.check()  # the others may be dead too (a failover)
                        raise _CommitUnknown(_text(exc)) from exc
                    raise

    async def _exactly_once(self, once: Callable[[], Awaitable[None]], landed: Landed) -> None:
        """One transaction, for a write that must not happen twice.

        A COMMIT whose outcome is unknown is read back (``landed``) before anything
        else; if it is not there, the write is tried again, on a new connection, for
        as long as ``retry_for`` allows.
        """
        retry = _Retry(self._retry_for)
        unsure = False
        while True:
            try:
                await once()
                return None
            except (DuplicateRecord, UsageError):
                if not (unsure and await self._read_back(landed)):
                    raise
                return None  # a COMMIT we could not confirm had landed after all
            except _CommitUnknown as exc:
                unsure = True
                if await self._read_back(landed):
                    return None
                await retry.pause(self._gave_up("committing; nothing was written", exc))
            except _ConnectionLost as exc:
                await retry.pause(self._gave_up("committing; nothing was written", exc))

    async def _read_back(self, landed: Landed) -> bool:
        try:
            return await landed()
        except JournalError as exc:
            raise JournalError(
                f"{self.where}: a COMMIT was cut off and could not be read back ({exc}); "
                "whether it was recorded, the journal will tell when the run is resumed"
            ) from exc

    async def _idempotent(self, work: Work[T], *, after_unknown: Work[T] | None = None) -> T:
        """One transaction, for work that may safely run twice: an unknown COMMIT is redone
        (as ``after_unknown`` once a COMMIT was cut off, when given)."""
        again = None if after_unknown is None else partial(self._transact_once, after_unknown)
        return await self._retried(partial(self._transact_once, work), again)

    async def _retried(
        self, once: Callable[[], Awaitable[T]], again: Callable[[], Awaitable[T]] | None = None
    ) -> T:
        """``once`` (a transaction or a statement that may safely run twice) until it lands;
        ``again`` instead once a COMMIT was cut off, when given."""
        retry = _Retry(self._retry_for)
        while True:
            try:
                return await once()
            except _CommitUnknown as exc:
                once = again or once
                await retry.pause(self._gave_up("committing", exc))
            except _ConnectionLost as exc:
                await retry.pause(self._gave_up("committing", exc))

    async def _fetch(self, query: str, args: Sequence[Any]) -> list[TupleRow]:
        """One read; connections found dead are replaced while ``retry_for`` allows."""
        pool = await self._ready()
        retry = _Retry(self._retry_for)
        while True:
            with self._errors():
                async with pool.connection() as conn:
                    try:
                        cur = await conn.execute(query, args)
                        return await cur.fetchall()
                    except psycopg.OperationalError as exc:
                        if not conn.broken:
                            raise
                        lost = exc
                await pool.check()
                await retry.pause(self._gave_up("reading", _ConnectionLost(_text(lost))))

    def _gave_up(self, doing: str, exc: Exception) -> JournalError:
        return JournalError(
            f"{self.where}: the connection kept being lost while {doing} "
            f"(retried for {self._retry_for:g} s; last: {exc})"
        )

    async def _ready(self) -> AsyncConnectionPool[Conn]:
        if self._pool is None:
            await self.open()
        if self._loop is not asyncio.get_running_loop():
            raise UsageError(
                f"{self!r} was opened in another event loop; open one store per loop "
                "(one per asyncio.run)"
            )
        assert self._pool is not None
        return self._pool

    async def _open_pool(self) -> AsyncConnectionPool[Conn]:
        (low, high), wait = self._sizes, self._timeout
        pool = AsyncConnectionPool[Conn](
            self.dsn, min_size=low, max_size=high, kwargs=self._connect, open=False, timeout=wait
        )
        try:
            with self._errors():
                await pool.open(wait=True, timeout=wait)
        except BaseException:
            await pool.close()
            raise
        return pool

    async def _migrate(self) -> None:
        """Bring the schema up to date in one transaction, under the migrations' lock.

        Once that lock is held, a migration waits at most ``timeout`` for a table another
        session holds (rather than queueing every session behind its own lock): then
        ``JournalBusy``. Any failure rolls every migration of the upgrade back.
        """
        with self._errors():
            conn = await AsyncConnection.connect(self.dsn, **self._connect)
            async with conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(%s)", (sql.MIGRATION_LOCK,))
                version = await self._schema_version(conn)
                wait = f"{max(int(self._timeout * 1000), 1)}ms"
                await conn.execute("SELECT set_config('lock_timeout', %s, true)", (wait,))
                for number in range(version + 1, sql.SCHEMA_VERSION + 1):
                    try:
                        await _apply(conn, number)
                    except Exception as exc:
                        raise self._migration_failed(exc, number, version) from exc

    def _migration_failed(self, exc: Exception, number: int, version: int) -> JournalError:
        """The error for a migration that failed: which one, why, unchanged, what to do."""
        cause = _text(exc) if isinstance(exc, psycopg.Error) else f"{type(exc).__name__}: {exc}"
        text = (
            f"{self.where}: migration {number} (schema {number - 1} to {number}) could not be "
            f"applied: {cause}. The journal is unchanged, still at schema {version} (its "
            "transaction was rolled back)"
        )
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            return JournalBusy(
                f"{text}. Another session held one of its tables for longer than the "
                f"{self._timeout:g} s timeout: retry once it lets go"
            )
        return MigrationFailed(f"{text}. {MIGRATION_ADVICE}", migration=number, version=version)

    async def _schema_version(self, conn: Conn) -> int:
        journal, runs, versions = await _one(
            conn,
            "SELECT to_regclass('journal'), to_regclass('runs'), to_regclass('asiento_schema')",
        )
        if versions is None:
            if journal is not None or runs is not None:
                raise NotAJournal(
                    f"{self.where} already has a table named journal or runs that asiento did "
                    "not create; use another database, or another schema (options=-csearch_path=…)"
                )
            await conn.execute(sql.CREATE_VERSIONS)
        (version,) = await _one(conn, "SELECT coalesce(max(version), 0) FROM asiento_schema")
        if version > sql.SCHEMA_VERSION:
            raise JournalTooNew(
                f"{self.where} has journal schema {version}; this asiento reads up to "
                f"{sql.SCHEMA_VERSION}. Upgrade asiento to resume these runs"
            )
        return int(version)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Turn psycopg's errors into asiento's, naming the database (never its password)."""
        try:
            yield
        except psycopg.errors.LockNotAvailable as exc:
            raise JournalBusy(f"{self.where}: {_text(exc)}; another session holds a lock") from exc
        except psycopg.OperationalError as exc:
            raise JournalError(f"cannot use the journal at {self.where}: {_text(exc)}") from exc
        except psycopg.Error as exc:
            raise JournalError(f"journal at {self.where}: {_text(exc)}") from exc


async def _check_lease(conn: Conn, lease: Lease) -> float:
    """Extend a current lease in this transaction, or raise ``LeaseLost``."""
    params = {"run_id": lease.run_id, "token": lease.token, "owner": lease.owner}
    cur = await conn.execute(sql.CHECK_LEASE, params)
    row = await cur.fetchone()
    if row is None:
        raise lease_lost(lease)
    return float(row[0])


async def _one(conn: Conn, query: str, args: Sequence[Any] = ()) -> TupleRow:
    cur = await conn.execute(query, args)
    row = await cur.fetchone()
    assert row is not None, query
    return row


async def _rollback(conn: Conn) -> None:
    if conn.broken or conn.closed:
        return
    with contextlib.suppress(psycopg.Error):  # the pool drops a connection it cannot reset
        await conn.execute("ROLLBACK")


async def _apply(conn: Conn, number: int) -> None:
    for statement in sql.MIGRATIONS[number - 1]:
        await conn.execute(statement)
    if backfill := _BACKFILLS.get(number):
        await backfill(conn)
    await conn.execute("INSERT INTO asiento_schema (version) VALUES (%s)", (number,))


async def _backfill_cache_tokens(conn: Conn) -> None:
    """Migration 3: each run's prompt-cache tokens, summed from its recorded model results.

    Read in Python, row by row from a server-side cursor: ``jsonb`` cannot read every
    record asiento writes (``_backfill``).
    """
    totals = CacheTotals()
    async with conn.cursor(name="asiento_backfill") as found:
        await found.execute(CACHE_RECORDS)
        async for run_id, payload in found:
            totals.add(run_id, payload)
    async with conn.cursor() as cur:
        await cur.executemany(
            "UPDATE runs SET cached_input_tokens = %s, cache_write_tokens = %s WHERE run_id = %s",
            totals.updates(),
        )


async def _backfill_budgets(conn: Conn) -> None:
    """Migration 6: each run's budget, folded from the records that name one (in Python,
    as ``_backfill_cache_tokens`` reads them)."""
    budgets = RunBudgets()
    async with conn.cursor(name="asiento_backfill_budgets") as found:
        await found.execute(BUDGET_RECORDS + " ORDER BY seq")
        async for run_id, step_id, phase, payload in found:
            budgets.add(run_id, step_id, phase, payload)
    async with conn.cursor() as cur:
        await cur.executemany(
            "UPDATE runs SET budget_cost = %s, budget_tokens = %s, budget_model_calls = %s"
            " WHERE run_id = %s",
            budgets.updates(),
        )


# What a migration fills in after its SQL ran, by the version it brings the database to.
_BACKFILLS: dict[int, Callable[[Conn], Awaitable[None]]] = {
    3: _backfill_cache_tokens,
    6: _backfill_budgets,
}


def _saved_params(saved: Savings) -> dict[str, Any]:
    """What a pass saved, as the parameters of ``APPEND_RELEASED``."""
    return {
        "saved_calls": saved.calls,
        "saved_inp": saved.input_tokens,
        "saved_out": saved.output_tokens,
        "saved_cost": saved.cost,
    }


def _text(exc: psycopg.Error) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def redact(dsn: str) -> str:
    """The DSN as error messages show it: every parameter but the password."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise UsageError(f"not a PostgreSQL connection string or URL: {_text(exc)}") from exc
    params.pop("password", None)
    return make_conninfo("", **params)
