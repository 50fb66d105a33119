"""Budgets per run: what a run may spend on its model, and what it spent (one home).

What a run spent is read from its journal (its recorded model results), so a
replayed answer is counted once however often the run is resumed. A streamed
generation that was cut (its marker with no answer, or an answer's ``repaid``) was
paid for too: it counts as a model call (its tokens and cost were never reported). A new model
call is made only while the spent total is below every limit; a replayed answer
is never blocked. The limits in force are the largest of the code's
``Agent(budget=...)`` and of every raise a person recorded for that limit: a
raise only ever raises, and a limit the code leaves unset stays unlimited.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from . import step_ids
from .errors import UsageError
from .events import BudgetStep, Phase, StepEvent
from .payloads import BudgetRaise, BudgetStop, ModelResult

LIMITS = ("max_cost", "max_tokens", "max_model_calls")

# The largest limit a journal's 64-bit columns hold (larger is as good as unlimited, and
# would overflow a float or the index): refused, clearly, rather than half-recorded.
MAX_LIMIT = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Budget:
    """Limits on one run's model spending; ``None`` leaves a limit unset.

    ``max_cost`` is in the currency of the session's prices (a call whose cost is
    unknown counts 0), ``max_tokens`` counts input plus output tokens.
    """

    max_cost: float | None = None
    max_tokens: int | None = None
    max_model_calls: int | None = None

    def __post_init__(self) -> None:
        for name in LIMITS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise UsageError(f"Budget({name}=...) must be a number, got {value!r}")
            if isinstance(value, int) and value > MAX_LIMIT:  # beyond a 64-bit count
                raise UsageError(
                    f"Budget({name}=...) must be at most {MAX_LIMIT} (2**63 - 1), got an"
                    f" integer of {value.bit_length()} bits; nothing was recorded"
                )
            if not math.isfinite(value) or value < 0:
                raise UsageError(f"Budget({name}=...) must be a finite number >= 0, got {value!r}")

    def limits(self) -> dict[str, float | None]:
        return {name: getattr(self, name) for name in LIMITS}

    def raised(self, raises: Mapping[str, float]) -> Budget:
        """This budget with a person's raise: each limit the larger of the two."""
        merged: dict[str, float | None] = {}
        for name, value in self.limits().items():
            new = raises.get(name)
            merged[name] = value if new is None or value is None else max(value, new)
        return Budget(
            max_cost=merged["max_cost"],
            max_tokens=None if merged["max_tokens"] is None else int(merged["max_tokens"]),
            max_model_calls=(
                None if merged["max_model_calls"] is None else int(merged["max_model_calls"])
            ),
        )


@dataclass(slots=True)
class Spent:
    """What a run's recorded model calls cost."""

    cost: float = 0.0
    tokens: int = 0
    model_calls: int = 0

    def add(self, result: ModelResult) -> None:
        self.cost += result.cost or 0.0
        self.tokens += result.response.usage.input_tokens + result.response.usage.output_tokens
        self.model_calls += 1 + result.repaid  # the generations cut before it, paid too

    def with_cut(self, generations: int) -> Spent:
        """This spending and ``generations`` streamed attempts cut before any answer."""
        return Spent(self.cost, self.tokens, self.model_calls + generations)

    def as_limits(self) -> dict[str, float]:
        return {
            "max_cost": self.cost,
            "max_tokens": self.tokens,
            "max_model_calls": self.model_calls,
        }


def reached(budget: Budget, spent: Spent) -> str | None:
    """The first limit ``spent`` has reached (no new call may be made), or None."""
    used = spent.as_limits()
    for name, limit in budget.limits().items():
        if limit is not None and used[name] >= limit:
            return name
    return None


def in_force(budget: Budget | None, journal: Mapping[str, Mapping[Phase, StepEvent]]) -> Budget:
    """The budget in force: the code's, raised by every raise recorded in the journal.

    A raise on a run whose code sets no budget limits nothing new: there is nothing
    to raise (every limit is unset, so unlimited).
    """
    current = budget or Budget()
    number = 1
    while (raised := journal.get(step_ids.budget(number), {}).get(Phase.APPROVAL)) is not None:
        current = current.raised(BudgetRaise.from_json(raised.payload).limits)
        number += 1
    return current


def open_stop(journal: Mapping[str, Mapping[Phase, StepEvent]]) -> str:
    """The id of the budget stop a new stop (or a person's raise) writes to: the first
    ``budget{n}`` with no raise recorded."""
    number = 1
    while Phase.APPROVAL in journal.get(step_ids.budget(number), {}):
        number += 1
    return step_ids.budget(number)


@dataclass(frozen=True, slots=True)
class Stop:
    """A run's stop on its budget before step ``before``: what the pass records and says."""

    step_id: str  # budget{n}, where a person's raise goes
    record: BudgetStop
    reason: str
    recorded: bool  # the stop is in the journal already (an earlier pass stopped here)

    def shown(self, run_id: str) -> BudgetStep:
        """The step a caller is shown for the stop."""
        stop = self.record
        return BudgetStep(
            run_id=run_id,
            step_id=self.step_id,
            limit=stop.limit,
            spent=stop.spent,
            budget=stop.budget,
        )


def check(
    declared: Budget,
    journal: Mapping[str, Mapping[Phase, StepEvent]],
    spent: Spent,
    *,
    cut: int,
    before: str,
) -> Budget | Stop:
    """Before a new (paid) call: the budget in force, or the stop when it is spent
    (``cut``: streamed generations cut before this step, paid too)."""
    budget = in_force(declared, journal)
    spent = spent.with_cut(cut)
    limit = reached(budget, spent)
    if limit is None:
        return budget
    stop_id = open_stop(journal)
    record = BudgetStop(limit=limit, spent=spent.as_limits(), budget=budget.limits(), before=before)
    reason = f"stopped on its budget before {before}: {describe(limit, spent, budget)}"
    return Stop(stop_id, record, reason, recorded=Phase.INTENT in journal.get(stop_id, {}))


def describe(limit: str, spent: Spent, budget: Budget) -> str:
    """``max_model_calls: spent 3 of 3``, for a person."""
    used = spent.as_limits()[limit]
    shown = f"{used:.6g}"
    return f"{limit}: spent {shown} of {budget.limits()[limit]}"


# -- the budget the run index shows: folded from the journal's records --------------------
#
# Three kinds of record name a run's budget: a model result of a budgeted run (the
# limits in force when a pass made its first new call, ``ModelResult.budget``), a stop
# (``BudgetStop.budget``, the limits it stopped on) and a person's raise (``BudgetRaise``,
# which raises the limits before it, never lowers them). The index keeps the budget the
# last of them leaves (``after``); an append brings a ``Noted`` (``noted``), which each
# backend applies in its own append (SQL: ``journal._rules.budget_write``).

Limits = dict[str, float | None]


@dataclass(frozen=True, slots=True)
class Noted:
    """What one batch of records says of the budget: the limits it records (raised by the
    raises after them in the batch), else the raises of limits recorded before it."""

    limits: Limits | None = None
    raises: Mapping[str, float] | None = None


def noted(events: Iterable[StepEvent]) -> Noted | None:
    """What these records (one append, in order) change in the run's budget, if anything."""
    limits: Limits | None = None
    raises: dict[str, float] | None = None
    for event in events:
        recorded = _limits_in(event)
        if recorded is not None:
            limits, raises = recorded, None
        elif (raised := _raise_in(event)) is not None:
            if limits is not None:
                limits = _raised(limits, raised)
            else:
                raises = _merged(raises or {}, raised)
    if limits is None and raises is None:
        return None
    return Noted(limits=limits, raises=raises)


def after(current: Limits | None, note: Noted | None) -> Limits | None:
    """The budget the index shows after a batch, from the one it showed before."""
    if note is None:
        return current
    if note.limits is not None:
        return dict(note.limits)
    return None if current is None else _raised(current, note.raises or {})


def _limits_in(event: StepEvent) -> Limits | None:
    """The limits a model result or a stop records, if it records any."""
    try:
        if event.phase is Phase.RESULT and step_ids.is_model(event.step_id):
            found = event.payload.get("budget")
            return None if found is None else _limits(found)
        if event.phase is Phase.INTENT and step_ids.is_budget(event.step_id):
            return _limits(BudgetStop.from_json(event.payload).budget)
    except (TypeError, ValueError, AttributeError):
        return None  # a record this cannot read names no budget
    return None


def _raise_in(event: StepEvent) -> dict[str, float] | None:
    if event.phase is not Phase.APPROVAL or not step_ids.is_budget(event.step_id):
        return None
    try:
        limits = BudgetRaise.from_json(event.payload).limits
    except (TypeError, ValueError, AttributeError):
        return None
    return {name: float(value) for name, value in limits.items() if name in LIMITS}


def _limits(found: object) -> Limits:
    if not isinstance(found, Mapping):
        raise TypeError("not a mapping of limits")
    return {name: None if found.get(name) is None else float(found[name]) for name in LIMITS}


def _raised(limits: Limits, raises: Mapping[str, float]) -> Limits:
    """``Budget.raised`` on plain limits: each the larger; an unset limit stays unset."""
    return {
        name: value if value is None or raises.get(name) is None else max(value, raises[name])
        for name, value in limits.items()
    }


def _merged(first: Mapping[str, float], then: Mapping[str, float]) -> dict[str, float]:
    return {name: max(first.get(name, value), value) for name, value in then.items()} | {
        name: value for name, value in first.items() if name not in then
    }
