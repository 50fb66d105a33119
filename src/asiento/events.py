"""The journal record and the steps ``Agent.run`` yields.

A ``StepEvent`` is one row of the journal, keyed ``(run_id, step_id, phase)``.
The steps (``ModelStep``, ``ToolStep``, ``ApprovalStep``, ``FinalStep``) are
what a caller sees; each is yielded as soon as the records behind it are durable (a
``ModelStep`` before the tool it asked for runs: see docs/replay.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from . import _clock
from .model import ModelResponse, ToolCall


class Phase(StrEnum):
    """Where a step stands; one record per phase, never two."""

    INTENT = "intent"
    APPROVAL = "approval"
    SUBMITTED = "submitted"
    RESULT = "result"
    RESOLUTION = "resolution"


class Decision(StrEnum):
    """What a policy (or a person) decided for a tool call."""

    ALLOW = "allow"
    DENY = "deny"
    REQUIRE_APPROVAL = "require_approval"
    APPROVED = "approved"
    DENIED = "denied"


class RunStatus(StrEnum):
    """A run as the listing shows it."""

    RUNNING = "running"
    SUSPENDED = "suspended"
    UNCERTAIN = "uncertain"
    CLOSED = "closed"
    PARKED = "parked"


@dataclass(frozen=True, slots=True, kw_only=True)
class StepEvent:
    """One journal record. ``payload`` is JSON; ``decision`` is set where someone decided."""

    run_id: str
    step_id: str
    phase: Phase
    payload: Mapping[str, Any] = field(default_factory=dict)
    decision: Decision | None = None
    created_at: float = field(default_factory=_clock.now)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunInfo:
    """One run in a listing: its status, its steps, its lease, and what its model calls cost.

    ``events`` counts the run's journal records; ``tool_steps`` the tool calls the
    model asked for (one ``intent`` record each; a retry of a step is another
    attempt of the same step, not a new one). Of ``input_tokens``,
    ``cached_input_tokens`` were read from a prompt cache and ``cache_write_tokens``
    written to one (as ``Usage`` counts them, summed over the run's paid calls).

    ``budget_cost``, ``budget_tokens`` and ``budget_model_calls`` are the run's budget
    as its journal last recorded it (a budgeted run's first new model call of each
    pass, a stop on the budget, a person's raise: docs/budgets.md); against it, what it
    spent is ``cost``, ``input_tokens + output_tokens`` and ``model_calls``. None: that
    limit is unset, or no budget was recorded (``budgeted`` is False).

    ``lease_host`` and ``lease_pid``: where the lease's holder runs (``Holder.host``, its
    process id there), so a person can tell which worker drives the run; None when
    nobody holds it.

    ``attempts``: the claims counted against the run since its last stable state; a
    claim whose lease lapsed while none of its tools was in flight is not among them
    but among its ``lapses`` (in a row, with no new record in between: docs/fleet.md).
    """

    run_id: str
    status: RunStatus
    events: int
    created_at: float
    updated_at: float
    lease_owner: str | None = None
    lease_expires: float | None = None
    fence: int = 0
    model_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    replayed_calls: int = 0
    saved_input_tokens: int = 0
    saved_output_tokens: int = 0
    task: str | None = None
    agent: str | None = None
    attempts: int = 0
    reason: str | None = None
    cost: float = 0.0
    saved_cost: float = 0.0
    tool_steps: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    budget_cost: float | None = None
    budget_tokens: int | None = None
    budget_model_calls: int | None = None
    lease_host: str | None = None
    lease_pid: int | None = None
    lapses: int = 0

    @property
    def steps(self) -> int:
        """The run's steps: its model steps (one per model call paid) and its tool steps."""
        return self.model_calls + self.tool_steps

    @property
    def budgeted(self) -> bool:
        """Whether the journal recorded a budget with at least one limit for the run."""
        limits = (self.budget_cost, self.budget_tokens, self.budget_model_calls)
        return any(limit is not None for limit in limits)


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    """A submitted run a worker claimed: its lease, its task and which agent drives it.

    ``attempts``: the claims counted against the run, this one included.
    ``in_flight``: the record id of the run's tool step that was in flight when its
    previous claim's lease lapsed (its worker died, or stopped renewing), for which that
    claim was counted; None when the previous claim ended otherwise.
    """

    lease: Lease
    task: str
    agent: str
    attempts: int
    in_flight: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """A session's hold on a run. ``token`` grows at every takeover (the fencing token)."""

    run_id: str
    token: int
    owner: str
    expires: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Savings:
    """What one pass replayed from the journal instead of paying for it again."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0

    def __sub__(self, before: Savings) -> Savings:
        """What was saved since ``before`` (one pass's share of a session's)."""
        return Savings(
            calls=self.calls - before.calls,
            input_tokens=self.input_tokens - before.input_tokens,
            output_tokens=self.output_tokens - before.output_tokens,
            cost=self.cost - before.cost,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStep:
    """The model answered (``replayed`` never: recorded answers are not re-announced)."""

    run_id: str
    step_id: str
    response: ModelResponse
    idempotency_key: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolStep:
    """A tool call reached a known outcome, or is waiting for a person.

    ``status`` is ``ok``, ``error``, ``denied`` or ``awaiting_approval``.
    """

    run_id: str
    step_id: str
    call: ToolCall
    decision: Decision
    status: str
    result: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ApprovalStep:
    """The run is suspended on disk until a person approves or denies ``step_id``.

    ``fingerprint`` identifies the exact frozen arguments a person is asked about;
    ``prepared`` is the frozen payload an effect would publish, if it is one.
    """

    run_id: str
    step_id: str
    call: ToolCall
    fingerprint: str
    prepared: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FinalStep:
    """The model answered without tool calls (or a person abandoned the run); it is closed.

    ``replayed`` is true when the run was already closed and nothing was called;
    ``abandoned`` when a person closed it without an answer (``text`` says why).
    """

    run_id: str
    step_id: str
    text: str
    replayed: bool = False
    abandoned: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetStep:
    """The run stopped before a new model call: its budget is spent (``limit`` says which).

    The run is suspended, not closed: a person raises the budget (``asiento budget``,
    ``asiento.raise_budget``) and the run goes on from here.
    """

    run_id: str
    step_id: str
    limit: str
    spent: Mapping[str, float]
    budget: Mapping[str, float | None]


Step = ModelStep | ToolStep | ApprovalStep | FinalStep | BudgetStep
