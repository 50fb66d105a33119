"""The run index's rules, written once: what a status write does, and which runs are claimable.

- A closed run stays closed.
- A stable status (closed, suspended, uncertain) ends the run's count of claims;
  a parked run given back to the workers (running again) starts it anew.
- A run is claimable when it is running, was submitted (it has a task) and no live
  lease holds it; the oldest update first. A run claimed ``max_attempts`` times
  without reaching a stable state is parked instead, with the reason recorded.

The memory backend applies these rules as the functions below; SQLite and
PostgreSQL as the SQL fragments below, the same text in both dialects (each
backend only says how it writes a parameter and the time). Every status write of
a SQL backend (an append's, ``set_status``, parking inside ``claim``) goes
through ``status_write``.
"""

from __future__ import annotations

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


def status_write(new: str, *, row: str = "") -> str:
    """The SET clauses of a status write; ``new`` is the requested status as an SQL
    expression (NULL: no change), ``row`` the target row's prefix in an upsert."""
    status, attempts = f"{row}status", f"{row}attempts"
    return (
        f"status = CASE WHEN {status} = 'closed' THEN 'closed' ELSE coalesce({new}, {status}) END"
        f", attempts = CASE WHEN {new} IN {_STABLE_SQL} THEN 0"
        f" WHEN {status} = 'parked' AND {new} = 'running' THEN 0 ELSE {attempts} END"
    )


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


# A closed run takes no new record from an append without a lease (a person's decision).
STILL_OPEN = "status <> 'closed'"
