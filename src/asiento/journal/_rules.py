"""The run index's rules, written once: what a status write does, and which runs are claimable.

- A closed run stays closed.
- A stable status (closed, suspended, uncertain) ends the run's count of claims;
  a parked run given back to the workers (running again) starts it anew.
- A run is claimable when it is running, was submitted (it has a task) and no live
  lease holds it; the longest queued first. A run claimed ``max_attempts`` times
  without reaching a stable state is parked instead, with the reason recorded.
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

from collections.abc import Callable

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
    """The count of claims after a status write."""
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


def parks(attempts: int, max_attempts: int) -> bool:
    """Whether a run claimed ``attempts`` times is parked instead of claimed once more."""
    return attempts >= max_attempts


_PARKED_AFTER, _PARKED_CLAIMS = "parked after ", " claims without reaching a stable state"
_LAST_FAILURE, _NO_WORD = "; last failure: ", " (its workers died without a word)"


def parked_reason(attempts: int, last: str | None) -> str:
    """What the index says of a parked run."""
    why = f"{_LAST_FAILURE}{last}" if last else _NO_WORD
    return f"{_PARKED_AFTER}{attempts}{_PARKED_CLAIMS}{why}"


# -- as SQL (SQLite and PostgreSQL) --------------------------------------------------


def status_write(new: str, now: str, *, row: str = "") -> str:
    """The SET clauses of a status write; ``new`` is the requested status as an SQL
    expression (NULL: no change), ``now`` the time, ``row`` the target row's prefix in
    an upsert. A write of NULL leaves every column it names as it was."""
    status, attempts, queued = f"{row}status", f"{row}attempts", f"{row}queued_at"
    return (
        f"status = CASE WHEN {status} = 'closed' THEN 'closed' ELSE coalesce({new}, {status}) END"
        f", attempts = CASE WHEN {new} IN {_STABLE_SQL} THEN 0"
        f" WHEN {status} = 'parked' AND {new} = 'running' THEN 0 ELSE {attempts} END"
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


def parks_sql(max_attempts: str) -> str:
    """``parks`` as SQL on the row's ``attempts``, ``max_attempts`` an SQL expression."""
    return f"attempts >= {max_attempts}"


def parked_reason_sql() -> str:
    """``parked_reason`` as SQL on the row's ``attempts`` and ``reason`` (the same text)."""
    return (
        f"'{_PARKED_AFTER}' || attempts || '{_PARKED_CLAIMS}' || CASE WHEN coalesce(reason, '')"
        f" = '' THEN '{_NO_WORD}' ELSE '{_LAST_FAILURE}' || reason END"
    )


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
