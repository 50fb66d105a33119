"""A deterministic model for tests and demos: the same request always gets the same answer.

Also importable as ``asiento.testing.ScriptedGateway``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .._crash import crash_point
from ..errors import UsageError
from ..model import ModelRequest, ModelResponse


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
