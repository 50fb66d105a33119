"""The run index's rules, written once: what a status write does, and which runs are claimable.

- A closed run stays closed.
- A stable status (closed, suspended, uncertain) ends the run's count of claims;
  a parked run given back to the workers (running again) starts it anew.
- A run is claimable when it is running, was submitted (it has a task) and no live
  lease holds it; the longest queued first. A run claimed ``max_attempts`` times
  without reaching a stable state is parked instead, with the reason recorded.
- A run is accountable only for what it did. A claim whose lease lapsed (its holder
  died, or stopped renewing, without releasing it) counts against the run only if a
  tool of the run was in flight then (``in_flight``: a tool step whose last record
  is ``submitted``); otherwise the lapsed claim is given back, and counted among the
  run's ``lapses`` instead: lapses in a row with no new record in between, parked at
  ``max_lapses`` (something of the run's own, outside any tool, may be killing its
  workers). A stable status or an unpark starts both counts anew.
- A run's place in the queue (``queued_at``) is the time it last joined it: when it
  was submitted, released while still running, or set running by a status write (a
  person's decision, an unpark, a failed pass); and a claim sends it to the back, so
  that the runs in flight are behind those waiting and a claim does not walk past
  them (a run whose worker died is claimed again after those queued before its
  claim). An append that leaves the status as it is never moves it, so on PostgreSQL
  the index the claims read (``runs_claimable``) changes on no plain append, and the
  run's row is updated in place (a HOT update).

The memory backend applies these rules as the functions below; SQLite and
PostgreSQL as the SQL fragments below, the same text in both dialects (each
backend only says how it writes a parameter and the time). Every status write of
a SQL backend (an append's, ``set_status``, parking inside ``claim``) goes
through ``status_write``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import step_ids
from ..events import RunInfo, RunStatus

STABLE = (RunStatus.CLOSED, RunStatus.SUSPENDED, RunStatus.UNCERTAIN)
_STABLE_SQL = "(" + ", ".join(f"'{status.value}'" for status in STABLE) + ")"

# -- as functions (the memory backend) ---------------------------------------------


def status_after(current: RunStatus, requested: RunStatus | None) -> RunStatus:
    """The status a write of ``requested`` (None: no change) leaves the run in."""
    if current is RunStatus.CLOSED or requested is None:
        return current
    return requested


def attempts_after(current: RunStatus, requested: RunStatus | None, attempts: int) -> int:
    """The count of claims (or of lapses) after a status write."""
    if requested in STABLE:
        return 0
    if current is RunStatus.PARKED and requested is RunStatus.RUNNING:
        return 0
    return attempts


def queued_after(
    queued_at: float, current: RunStatus, requested: RunStatus | None, now: float
) -> float:
    """A run's place in the queue after a status write: a write of running joins it again."""
    if requested is RunStatus.RUNNING and current is not RunStatus.CLOSED:
        return now
    return queued_at


def claimable_now(info: RunInfo, now: float) -> bool:
    """Whether a worker may claim the run now."""
    free = info.lease_owner is None or (info.lease_expires or 0.0) < now
    return info.status is RunStatus.RUNNING and info.task is not None and free


def in_flight(records: Iterable[tuple[str, str]]) -> str | None:
    """The record id of the run's tool step in flight, given its (record id, phase) pairs
    in the order they were written: the first tool step whose last record, over all its
    attempts, is ``submitted`` (its effect left, no outcome came back); None if none."""
    last: dict[str, tuple[str, str]] = {}
    for record_id, phase in records:
        if step_ids.is_tool(record_id):
            last[step_ids.base(record_id)] = (record_id, phase)
    return next((rid for rid, phase in last.values() if phase == "submitted"), None)


@dataclass(frozen=True, slots=True)
class Charge:
    """What a claim counts against a run: its claims and lapses before this claim."""

    attempts: int
    lapses: int
    in_flight: str | None


def charge(
    *, attempts: int, lapses: int, lapsed: bool, in_flight: str | None, progressed: bool
) -> Charge:
    """The counts a claim judges the run by. ``lapsed``: the previous claim's lease
    lapsed unreleased; ``in_flight``: the tool step in flight then; ``progressed``: the
    run wrote a record during that claim."""
    if not lapsed or in_flight is not None:
        return Charge(attempts, 0 if lapsed else lapses, in_flight)
    return Charge(max(attempts - 1, 0), 1 if progressed else lapses + 1, None)


def parks(attempts: int, max_attempts: int, lapses: int = 0, max_lapses: int = 0) -> bool:
    """Whether a run claimed ``attempts`` times (and ``lapses`` unblamed lapses in a row)
    is parked instead of claimed once more (``max_lapses`` 0: no limit on lapses)."""
    return attempts >= max_attempts or 0 < max_lapses <= lapses


def park_cause(lapses: int = 0, max_lapses: int = 0) -> str:
    """Why ``parks`` parked a run, as ``asiento.runs.parked`` names it: ``max_lapses``
    when its lapses reached the limit, else ``max_attempts`` (as ``parked_reason``)."""
    return "max_lapses" if 0 < max_lapses <= lapses else "max_attempts"


_PARKED_AFTER, _PARKED_CLAIMS = "parked after ", " claims without reaching a stable state"
_LAST_FAILURE, _NO_WORD = "; last failure: ", " (its workers died without a word)"
_LAPSED = (
    " times in a row while none of its tools was in flight, with no new record in between:"
    " something of the run's own, outside its tools, may be killing its workers"
)
_DIED, _WAS_IN_FLIGHT = "its worker died while its tool step ", " was in flight"


def died_in(in_flight: str) -> str:
    """The failure a lapsed claim records when a tool of the run was in flight."""
    return f"{_DIED}{in_flight}{_WAS_IN_FLIGHT}"


def parked_reason(attempts: int, last: str | None, *, lapses: int = 0, max_lapses: int = 0) -> str:
    """What the index says of a parked run: parked by its lapses when they reached
    ``max_lapses``, else by its claims."""
    if 0 < max_lapses <= lapses:
        return f"parked: its worker died {lapses}{_LAPSED}"
    why = f"{_LAST_FAILURE}{last}" if last else _NO_WORD
    return f"{_PARKED_AFTER}{attempts}{_PARKED_CLAIMS}{why}"


# -- as SQL (SQLite and PostgreSQL) --------------------------------------------------


def status_write(
    new: str, now: str, *, row: str = "", attempts: str | None = None, lapses: str | None = None
) -> str:
    """The SET clauses of a status write; ``new`` is the requested status as an SQL
    expression (NULL: no change), ``now`` the time, ``row`` the target row's prefix in
    an upsert; ``attempts`` and ``lapses`` what the counts become when the write does
    not start them anew (the row's own by default). A write of NULL leaves every column
    it names as it was."""
    status, queued = f"{row}status", f"{row}queued_at"
    anew = f"{new} IN {_STABLE_SQL} OR ({status} = 'parked' AND {new} = 'running')"
    counts = (
        f"{column} = CASE WHEN {anew} THEN 0 ELSE {kept or row + column} END"
        for column, kept in (("attempts", attempts), ("lapses", lapses))
    )
    return (
        f"status = CASE WHEN {status} = 'closed' THEN 'closed' ELSE coalesce({new}, {status}) END"
        f", {', '.join(counts)}"
        f", queued_at = CASE WHEN {new} = 'running' AND {status} <> 'closed' THEN {now}"
        f" ELSE {queued} END"
    )


def requeue_released(now: str) -> str:
    """The SET clause of a release: a run given back while still running joins the queue
    again (a closed or waiting one keeps its place: it is not in the queue)."""
    return f"queued_at = CASE WHEN status = 'running' THEN {now} ELSE queued_at END"


def claimable(now: str) -> str:
    """The WHERE clause of the runs a worker may claim, ``now`` being the time."""
    return (
        "status = 'running' AND task IS NOT NULL"
        f" AND (lease_owner IS NULL OR lease_expires < {now})"
    )


def parks_sql(
    max_attempts: str, *, attempts: str = "attempts", lapses: str = "0", max_lapses: str = "0"
) -> str:
    """``parks`` as SQL, each argument an SQL expression (the row's ``attempts`` by default)."""
    return f"({attempts} >= {max_attempts} OR (0 < {max_lapses} AND {max_lapses} <= {lapses}))"


def _literal(text: str) -> str:
    """``text`` as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def died_in_sql(in_flight: str) -> str:
    """``died_in`` as SQL, ``in_flight`` an SQL expression of the step's record id."""
    return f"{_literal(_DIED)} || {in_flight} || {_literal(_WAS_IN_FLIGHT)}"


def parked_reason_sql(
    *,
    attempts: str = "attempts",
    last: str = "reason",
    lapses: str = "0",
    max_lapses: str = "0",
) -> str:
    """``parked_reason`` as SQL (the same text), each argument an SQL expression: parked by
    its lapses when ``lapses`` reached ``max_lapses``."""
    by_claims = (
        f"'{_PARKED_AFTER}' || {attempts} || '{_PARKED_CLAIMS}' || CASE WHEN coalesce({last}, '')"
        f" = '' THEN '{_NO_WORD}' ELSE '{_LAST_FAILURE}' || {last} END"
    )
    by_lapses = f"'parked: its worker died ' || {lapses} || {_literal(_LAPSED)}"
    parked_by_lapses = f"(0 < {max_lapses} AND {max_lapses} <= {lapses})"
    return f"CASE WHEN {parked_by_lapses} THEN {by_lapses} ELSE {by_claims} END"


def queue_order(collate: str = "") -> str:
    """The ORDER BY of a claim: the longest queued first, ``run_id`` (compared byte by
    byte: PostgreSQL passes ``collate=' COLLATE "C"'``, SQLite's default) breaking a tie."""
    return f"queued_at, run_id{collate}"


# The budget columns of the run index, and the limit of ``Budget`` each holds.
BUDGET_COLUMNS = (
    ("budget_cost", "max_cost"),
    ("budget_tokens", "max_tokens"),
    ("budget_model_calls", "max_model_calls"),
)


def budget_write(param: Callable[[str], str], *, row: str = "") -> str:
    """``budget.after`` as the SET clauses of an append: the limits the batch records
    (``bset``, ``b_<column>``), else each raise (``r_<column>``) above the limit shown; an
    unset limit stays unset. ``param`` writes a parameter in the dialect; the names are
    ``base.budget_params``'s, ``row`` the target row's prefix in an upsert."""
    clauses = []
    for column, _ in BUDGET_COLUMNS:
        new, up, old = param(f"b_{column}"), param(f"r_{column}"), f"{row}{column}"
        clauses.append(
            f"{column} = CASE WHEN {param('bset')} THEN {new}"
            f" WHEN {up} > {old} THEN {up} ELSE {old} END"
        )
    return ", ".join(clauses)


# A closed run takes no new record from an append without a lease (a person's decision).
STILL_OPEN = "status <> 'closed'"
