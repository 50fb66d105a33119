"""The ``Checkpointer`` protocol: the run's journal, shared by loop and harness.

Small protocols rather than a base class: a backend is whatever has these
coroutines, in four roles (``Journal``, ``Leases``, ``Queue``, ``RunIndex``).
Every backend passes the same conformance suite (``asiento.testing.conformance``);
the index's rules are written once, in ``_rules``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from .._canonical import compact_encoder
from ..budget import Limits, noted
from ..errors import JournalCorrupt, LeaseLost, RecordTooLarge, RunClosed, RunLocked, UsageError
from ..events import Claim, Decision, Lease, Phase, RunInfo, RunStatus, Savings, StepEvent
from ..lease import Holder, is_dead_here
from ..payloads import usage_of
from ._rules import BUDGET_COLUMNS


@runtime_checkable
class Journal(Protocol):
    """The records of runs: ``append`` is atomic, all of a batch is recorded or none."""

    async def append(
        self,
        *events: StepEvent,
        status: RunStatus | None = None,
        lease: Lease | None = None,
        release: Savings | None = None,
    ) -> None:
        """Record ``events`` (one run) in one transaction, and set the run's status.

        Raises ``DuplicateRecord`` if any ``(run_id, step_id, phase)`` is taken. With
        ``lease`` (the loop's appends), the lease is checked in the same transaction:
        a token that is no longer current, or an expired lease, raises ``LeaseLost``
        and nothing is written; a current one is extended. Without ``lease`` (a
        person's decision), a run the index says is closed raises ``RunClosed`` and
        nothing is written: a closed run stays closed.

        ``release`` (only with ``lease`` and ``status=CLOSED``: the append that closes
        the run) gives the lease up in the same transaction, adding what the pass saved,
        as ``release(lease, savings=release)`` right after would: one commit fewer a run.
        """
        ...

    async def load(self, run_id: str) -> list[StepEvent]:
        """The run's whole timeline, in the order it was written."""
        ...

    async def load_step(self, run_id: str, step_id: str) -> list[StepEvent]:
        """The records of one step, in the order they were written."""
        ...

    async def final(self, run_id: str) -> StepEvent | None:
        """The run's final record if it is closed: one read, not the whole journal."""
        ...

    async def age(self, run_id: str, step_id: str, phase: Phase) -> float | None:
        """Seconds since the record was written, on the store's clock; None if it is absent.

        What decides whether an idempotency key may have expired: the database
        server's clock on PostgreSQL (no client's clock counts), this process's on
        SQLite and in memory. A clock that went back gives a negative age.
        """
        ...


@runtime_checkable
class Leases(Protocol):
    """Who drives a run: at most one session at a time, fenced."""

    async def acquire(
        self, run_id: str, holder: Holder, *, ttl: float, force: bool = False
    ) -> Lease:
        """Take the run's lease, or raise ``RunLocked`` naming the live holder.

        A free or expired lease, or one whose holder is provably dead on this
        host, is taken over and the fencing token grows. ``force`` takes it from
        a live holder too (abandoning a run): that holder writes nothing more.
        """
        ...

    async def renew(self, lease: Lease, *, ttl: float) -> Lease:
        """Extend a current lease, or raise ``LeaseLost``."""
        ...

    async def release(
        self, lease: Lease, *, savings: Savings | None = None, clean: bool = False
    ) -> None:
        """Give the lease up (if still held) and add what the pass did not pay again.

        ``clean``: the pass stopped on request (a graceful shutdown), so its claim
        does not count towards parking the run.
        """
        ...


@runtime_checkable
class Queue(Protocol):
    """Runs submitted for the workers, and their claims."""

    async def submit(self, run_id: str, task: str, *, agent: str = "default") -> None:
        """Queue a new run for the workers; ``UsageError`` if the run id is taken."""
        ...

    async def claim(
        self, holder: Holder, *, ttl: float, max_attempts: int = 5, max_lapses: int = 0
    ) -> Claim | None:
        """Take the lease of one submitted run that needs work, or None.

        Needs work: status running, with no live lease. A run claimed
        ``max_attempts`` times without reaching a stable state (closed,
        suspended, uncertain) is parked instead, with the reason recorded. A claim
        whose lease lapsed counts only if a tool of the run was in flight then;
        ``max_lapses`` (0: no limit) parks a run whose lapses that did not count
        reached it in a row, with no new record in between (``_rules``).
        """
        ...

    async def claim_many(
        self,
        holder: Holder,
        *,
        limit: int,
        ttl: float,
        max_attempts: int = 5,
        max_lapses: int = 0,
    ) -> list[Claim]:
        """Take up to ``limit`` runs that need work, oldest first, as ``claim`` takes one."""
        ...

    async def wait_for_work(self, timeout: float) -> None:
        """Return when a run may have become claimable (a submit, a decision, a
        released lease), or after ``timeout`` seconds at the latest."""
        ...


@runtime_checkable
class RunIndex(Protocol):
    """The run index: a summary of the journal, for listing and claiming."""

    async def runs(self, *, status: RunStatus | None = None) -> list[RunInfo]:
        """The runs this journal knows, oldest first, optionally of one status."""
        ...

    async def run(self, run_id: str) -> RunInfo | None:
        """One run's line in the index, looked up by its id; None for an unknown run."""
        ...

    async def set_status(
        self,
        run_id: str,
        status: RunStatus,
        *,
        reason: str | None = None,
        lease: Lease | None = None,
        waits_for: tuple[str, Phase] | None = None,
    ) -> bool:
        """Mark a known run (uncertain, parked...) without writing a step; note why.

        Setting a parked run back to running starts its claim count anew; a stable
        status (closed, suspended, uncertain) ends the count. A closed run takes no
        other status (``RunClosed``). With ``lease`` (the loop's status), the lease
        is checked as an append checks it. With ``waits_for`` (a step id and the
        phase of the record the run now waits for, such as a person's approval),
        the status is set only while that record is missing, in the same
        transaction: False means the record is there already (a person decided
        after the pass read the journal) and nothing was changed.
        """
        ...


@runtime_checkable
class Checkpointer(Journal, Leases, Queue, RunIndex, Protocol):
    """A store of runs, in its four roles: the journal, leases, the queue, the index.

    The loop needs the journal, leases and ``set_status``; a person's decisions the
    journal, leases and the index; workers the queue too.
    """

    async def close(self) -> None:
        """Release the backend's connections."""
        ...


Row = tuple[str, str, str, str | None, str, float]

# The largest JSON payload one record may hold. Tool results above it are recorded
# as a failure of the step (the tool ran once; its result is too large to keep).
MAX_RECORD_BYTES = 32 * 1024 * 1024


async def one_by_one(claims: Iterable[Awaitable[Claim | None]]) -> list[Claim]:
    """``claim_many`` for a backend whose claims are cheap in-process calls: one at a time,
    until one finds nothing (a lazy iterable: the claims after it are never made)."""
    taken: list[Claim] = []
    for claiming in claims:
        if (claim := await claiming) is None:
            break
        taken.append(claim)
    return taken


def may_take(
    *,
    owner: str | None,
    host: str | None,
    pid: int | None,
    started: str | None,
    expires: float | None,
    holder: Holder,
    now: float,
) -> bool:
    """Whether ``holder`` may take a lease currently recorded as the given one."""
    if owner is None or owner == holder.owner or expires is None or expires < now:
        return True
    return is_dead_here(host, pid, started, owner)


def run_locked(
    run_id: str, host: str | None, pid: int | None, expires: float, now: float
) -> RunLocked:
    return RunLocked(
        f"run {run_id!r} is being driven by another session (pid {pid} on {host}); its lease "
        f"expires in {max(0.0, expires - now):.1f}s. Wait for it, or pass Session(wait=...)"
    )


def run_closed(run_id: str) -> RunClosed:
    return RunClosed(
        f"run {run_id!r} is closed: it takes no decision and no new record, and nothing "
        "was written. `asiento show` tells how it ended"
    )


def lease_lost(lease: Lease) -> LeaseLost:
    return LeaseLost(
        f"run {lease.run_id!r}: this session's lease (token {lease.token}) expired or was "
        "taken over by another session; nothing was written. Resume with a new Session"
    )


_RUN_FIELDS = (
    "run_id",
    "status",
    "events",
    "created_at",
    "updated_at",
    "lease_owner",
    "lease_expires",
    "fence",
    "model_calls",
    "input_tokens",
    "output_tokens",
    "replayed_calls",
    "saved_input_tokens",
    "saved_output_tokens",
    "task",
    "agent",
    "attempts",
    "reason",
    "cost",
    "saved_cost",
    "tool_steps",
    "cached_input_tokens",
    "cache_write_tokens",
    "budget_cost",
    "budget_tokens",
    "budget_model_calls",
    "lease_host",
    "lease_pid",
    "lapses",
)


def run_info(row: Sequence[Any]) -> RunInfo:
    """A row of the run index (columns in RunInfo's order) as a ``RunInfo``."""
    values = dict(zip(_RUN_FIELDS, row, strict=True))
    values["status"] = RunStatus(values["status"])
    if values["lease_owner"] is None:  # a released lease leaves its holder's columns behind
        values["lease_host"] = values["lease_pid"] = None
    return RunInfo(**values)


def counts_of(events: Sequence[StepEvent]) -> dict[str, Any]:
    """What one append adds to the run index: model ``calls``, tokens (``inp``, ``out``,
    and of the input, ``cread`` read from and ``cwrite`` written to a prompt cache) and
    ``cost`` paid, read from the batch's model results, and the ``tools`` steps it
    starts: one ``intent`` per tool call the model asked for (a retry, ``m1.t1/2``,
    writes no intent of its own: it is another attempt of the same step).
    """
    calls = inp = out = tools = cread = cwrite = 0
    cost = 0.0
    for event in events:
        phase = event.phase
        if phase == "intent":
            tools += 1
        elif phase == "result" and (paid := usage_of(event.payload)) is not None:
            calls, inp, out = calls + 1, inp + paid[0], out + paid[1]
            cread, cwrite, cost = cread + paid[2], cwrite + paid[3], cost + paid[4]
    return {
        "calls": calls, "inp": inp, "out": out, "cost": cost, "tools": tools,
        "cread": cread, "cwrite": cwrite,
    } | budget_params(events)  # fmt: skip


# The largest count a 64-bit integer column holds (a larger limit is as good as unlimited).
_MAX_COUNT = 2**63 - 1


def budget_params(events: Sequence[StepEvent]) -> dict[str, Any]:
    """What one append changes in the run's budget (``budget.noted``), as the parameters of
    ``_rules.budget_write``: ``budget`` whether it changes anything; ``bset`` whether it
    records limits, ``b_<column>`` those limits; ``r_<column>`` the raises of the limits
    recorded before (None: no raise of that limit)."""
    note = noted(events)
    if note is None:  # almost every append: nothing about the budget
        return dict(_NO_BUDGET)
    limits: Limits = {} if note.limits is None else note.limits
    raises = {} if note.raises is None else note.raises
    params: dict[str, Any] = {"budget": True, "bset": bool(limits)}
    for column, name in BUDGET_COLUMNS:
        params[f"b_{column}"] = index_limit(column, limits.get(name))
        params[f"r_{column}"] = index_limit(column, raises.get(name))
    return params


def check_release(
    release: Savings | None, status: RunStatus | None, lease: Lease | None
) -> Savings | None:
    """``append(release=...)`` as given, or ``UsageError``: only the closing append of a
    leased pass gives its lease up with it (a run left open must be released as it goes
    back to the queue)."""
    if release is None:
        return None
    if not isinstance(release, Savings):
        raise UsageError(f"append(release=...) takes the pass's Savings, got {release!r}")
    if lease is None or status is None or RunStatus(status) is not RunStatus.CLOSED:
        raise UsageError("append(release=...) needs lease=... and status=RunStatus.CLOSED")
    return release


_NO_BUDGET: dict[str, Any] = {"budget": False, "bset": False} | {
    f"{kind}_{column}": None for column, _ in BUDGET_COLUMNS for kind in ("b", "r")
}


def index_limit(column: str, value: float | None) -> float | int | None:
    """A limit as its index column holds it: a count as an integer, a cost as a float."""
    if value is None or column == "budget_cost":
        return value
    return min(int(value), _MAX_COUNT)


def encode_batch(events: Sequence[StepEvent]) -> tuple[str, list[Row]]:
    """Check one append batch and serialise it, before any transaction starts."""
    if not events:
        raise UsageError("append() needs at least one StepEvent")
    first = events[0]
    if not isinstance(first, StepEvent):
        raise UsageError(f"append() takes StepEvent records, got {type(first).__name__}")
    run_id = check_id("run_id", first.run_id)
    seen: set[tuple[str, str]] = set()
    rows: list[Row] = []
    for event in events:
        _check_event(event, run_id)
        key = (event.step_id, event.phase)
        if key in seen:
            raise UsageError(f"append() got two {event.phase!r} records for step {event.step_id!r}")
        seen.add(key)
        rows.append(_encode(event))
    return run_id, rows


_PHASES = frozenset(Phase)


def _check_event(event: StepEvent, run_id: str) -> None:
    if not isinstance(event, StepEvent):
        raise UsageError(f"append() takes StepEvent records, got {type(event).__name__}")
    if event.run_id != run_id:
        raise UsageError("append() records one run at a time; the batch mixes run ids")
    check_id("step_id", event.step_id)
    if not isinstance(event.phase, str) or event.phase not in _PHASES:
        Phase(event.phase)  # raises, naming the value that is not a phase


_COMPACT = compact_encoder(sort_keys=False)


def _encode(event: StepEvent) -> Row:
    try:
        payload = _COMPACT(event.payload)
    except (TypeError, ValueError, RecursionError) as exc:
        raise UsageError(
            f"run {event.run_id!r} step {event.step_id!r} {event.phase}: payload is not JSON: {exc}"
        ) from exc
    if len(payload) > MAX_RECORD_BYTES:
        raise RecordTooLarge(
            f"run {event.run_id!r} step {event.step_id!r} {event.phase}: the payload is "
            f"{len(payload):,} bytes; the limit is {MAX_RECORD_BYTES:,}. Nothing was written"
        )
    decision = None if event.decision is None else str(event.decision)
    return (event.run_id, event.step_id, str(event.phase), decision, payload, event.created_at)


def decode_row(run_id: str, row: Sequence[Any]) -> StepEvent:
    """A stored row back to a ``StepEvent``; damage is a ``JournalCorrupt``, not a guess."""
    step_id, phase, decision, payload, created_at = row
    try:
        return StepEvent(
            run_id=run_id,
            step_id=step_id,
            phase=Phase(phase),
            decision=None if decision is None else Decision(decision),
            payload=json.loads(payload),
            created_at=float(created_at),
        )
    except (ValueError, TypeError) as exc:
        raise JournalCorrupt(
            f"run {run_id!r} step {step_id!r}: stored record cannot be read: {exc}"
        ) from exc


def check_id(what: str, value: object) -> str:
    """Run and step ids are non-empty text of bounded length; any characters are fine."""
    if not isinstance(value, str) or not value:
        raise UsageError(f"{what} must be a non-empty str, got {value!r}")
    if len(value) > 512:
        raise UsageError(f"{what} is {len(value)} characters long; the limit is 512")
    if "\x00" in value:
        raise UsageError(f"{what} must not contain NUL characters")
    if value.isascii():  # nearly every id: no surrogate to look for
        return value
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise UsageError(f"{what} must be valid Unicode text (no lone surrogates)") from exc
    return value
