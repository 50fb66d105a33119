"""What users need to test their own agents: a scripted model, crash points, a crash harness.

``CrashHarness`` (see ``asiento.testing.harness``) kills a user's agent with
SIGKILL at every crash point and at random instants, resumes it, and checks
the invariants of ``asiento.testing.invariants`` from outside the process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .._crash import CRASH_POINTS, ENV_VAR, arm, crash_point
from ..errors import UsageError
from ..model import ModelRequest, ModelResponse

if TYPE_CHECKING:
    from .harness import CrashHarness
    from .invariants import Violation
    from .report import CampaignFailed, Report

__all__ = [
    "CRASH_POINTS",
    "ENV_VAR",
    "CampaignFailed",
    "CrashHarness",
    "Report",
    "ScriptedGateway",
    "Violation",
    "arm",
    "crash_point",
]

_LAZY = {
    "CrashHarness": "harness",
    "Report": "report",
    "CampaignFailed": "report",
    "Violation": "invariants",
}


def __getattr__(name: str) -> object:
    """The harness is imported on first use: a test that only scripts a model stays light."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ScriptedGateway:
    """A deterministic model: the answer to turn N is ``responses[N]``.

    The turn is read from the request (how many assistant messages it already
    holds), not from a counter, so a fresh gateway in a resumed process answers
    each step exactly as the first one did. ``calls`` records every request and
    its idempotency key: each entry is one billable generation.
    """

    def __init__(
        self, responses: Sequence[ModelResponse] | Callable[[ModelRequest], ModelResponse]
    ) -> None:
        self._responses = responses
        self.calls: list[tuple[ModelRequest, str]] = []

    @property
    def keys(self) -> list[str]:
        return [key for _, key in self.calls]

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        self.calls.append((request, idempotency_key))
        crash_point("inside_model_call")
        if callable(self._responses):
            return self._responses(request)
        turn = sum(1 for m in request.messages if m.role == "assistant")
        if turn >= len(self._responses):
            raise UsageError(
                f"ScriptedGateway has {len(self._responses)} responses; turn {turn} asked"
            )
        return self._responses[turn]
