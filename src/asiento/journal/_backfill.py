"""What migrations compute from the records already written, the same on every backend.

Read in Python, with the parser that reads every record back (``json.loads``), not
with the database's JSON functions: SQLite builds may lack them, and PostgreSQL's
``jsonb`` refuses ``\\u0000`` and lone surrogate escapes, which asiento writes for
text holding them (a tool result, a model's answer). A record this cannot count,
whatever it holds, counts nothing: a migration must never fail on a record.
"""

from __future__ import annotations

import json
from typing import Any

from .. import budget
from ..events import Phase, StepEvent
from ._rules import BUDGET_COLUMNS
from .base import index_limit

# The model results that may carry prompt-cache tokens (every backend's LIKE agrees).
CACHE_RECORDS = (
    "SELECT run_id, payload FROM journal WHERE phase = 'result' AND payload LIKE '%\"cache\"%'"
)

# The records that may name a run's budget (``budget.noted``): its stops and raises, and
# model results that hold a "budget"; each backend adds its own order of writing.
BUDGET_RECORDS = (
    "SELECT run_id, step_id, phase, payload FROM journal"
    " WHERE step_id LIKE 'budget%' OR (phase = 'result' AND payload LIKE '%\"budget\"%')"
)

# What to do about a migration that failed on its own (not busy, full or damaged).
MIGRATION_ADVICE = (
    "Fix what the cause names (if its tables were changed by hand, undo that) and open it "
    "again; until then it still works with the asiento that wrote it. If the cause is not "
    "yours, report this message as an asiento bug"
)

# The largest count a 64-bit integer column holds.
_MAX_COUNT = 2**63 - 1


class CacheTotals:
    """Each run's prompt-cache tokens (read from, written to a cache), summed record by record."""

    def __init__(self) -> None:
        self._totals: dict[str, tuple[int, int]] = {}

    def add(self, run_id: str, payload: str) -> None:
        """Count one record's ``response.cache`` pair, if it is a model result with one."""
        pair = _cache_pair(payload)
        if pair is not None:
            read, written = self._totals.get(run_id, (0, 0))
            self._totals[run_id] = (min(read + pair[0], _MAX_COUNT),
                                    min(written + pair[1], _MAX_COUNT))  # fmt: skip

    def updates(self) -> list[tuple[int, int, str]]:
        """``(read, written, run_id)`` for every run that has any."""
        return [(read, written, run_id) for run_id, (read, written) in self._totals.items()]


def _cache_pair(payload: str) -> tuple[int, int] | None:
    try:
        record = json.loads(payload)
        pair = record["response"]["cache"]
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return None
    if not isinstance(pair, list) or len(pair) != 2:
        return None
    read, written = _count(pair[0]), _count(pair[1])
    return None if read is None or written is None else (read, written)


def _count(value: Any) -> int | None:
    """A token count as the appends read it (``int(value)``), if a bigint column holds it."""
    try:
        count = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return count if 0 <= count <= _MAX_COUNT else None


class RunBudgets:
    """Each run's budget as the index shows it, folded record by record (``budget.after``)."""

    def __init__(self) -> None:
        self._budgets: dict[str, budget.Limits | None] = {}

    def add(self, run_id: str, step_id: str, phase: str, payload: str) -> None:
        """Fold one record in (records of a run in the order they were written)."""
        try:
            event = StepEvent(
                run_id=run_id, step_id=step_id, phase=Phase(phase), payload=json.loads(payload)
            )
        except (ValueError, TypeError, RecursionError):
            return
        note = budget.noted([event])
        if note is not None:
            self._budgets[run_id] = budget.after(self._budgets.get(run_id), note)

    def updates(self) -> list[tuple[Any, ...]]:
        """``(budget_cost, budget_tokens, budget_model_calls, run_id)`` for every run with one."""
        found = []
        for run_id, limits in self._budgets.items():
            if limits is not None:
                values = (index_limit(col, limits.get(name)) for col, name in BUDGET_COLUMNS)
                found.append((*values, run_id))
        return found
