"""Which step is running: tools can read their own run and step ids.

A tool that calls an outside service can build its own idempotency key from
them, so the destination deduplicates a re-run after a crash.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from ._canonical import idem_key


@dataclass(frozen=True, slots=True, kw_only=True)
class StepContext:
    """The step a tool runs in: ``attempt_id`` is ``step_id`` or ``step_id/N`` for a retry."""

    run_id: str
    step_id: str
    attempt_id: str
    tool: str

    def idempotency_key(self, params: object) -> str:
        """``idem_key(run_id, step_id, params)``: the same for every attempt of the step."""
        return idem_key(self.run_id, self.step_id, params)


_current: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
    "asiento_step", default=None
)


def current_step() -> StepContext | None:
    """The step the calling tool runs in, or None outside a tool."""
    return _current.get()


def enter(context: StepContext) -> contextvars.Token[StepContext | None]:
    return _current.set(context)


def leave(token: contextvars.Token[StepContext | None]) -> None:
    _current.reset(token)
