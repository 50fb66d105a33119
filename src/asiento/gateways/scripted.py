"""A deterministic model for tests and demos: the same request always gets the same answer.

Also importable as ``asiento.testing.ScriptedGateway`` (and ``StreamingScriptedGateway``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

from .._canonical import canonical_json
from .._crash import crash_point
from ..errors import UsageError
from ..model import ModelRequest, ModelResponse
from ..streaming import StreamPart, TextPart, ToolCallPart


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
        return self._answer(request)

    def _answer(self, request: ModelRequest) -> ModelResponse:
        if callable(self._responses):
            return self._responses(request)
        turn = sum(1 for m in request.messages if m.role == "assistant")
        if turn >= len(self._responses):
            raise UsageError(
                f"ScriptedGateway has {len(self._responses)} responses; turn {turn} asked"
            )
        return self._responses[turn]


class StreamingScriptedGateway(ScriptedGateway):
    """``ScriptedGateway`` that streams its answers, as a provider would.

    Each answer's text comes in pieces of ``chunk`` characters, then each tool
    call's id and name and its arguments' JSON in pieces, then the whole answer;
    ``pause`` seconds pass before each piece (the time a model takes to generate).
    Every stream started is one entry in ``calls``: one billable generation,
    even if the caller stops reading it.
    """

    def __init__(
        self,
        responses: Sequence[ModelResponse] | Callable[[ModelRequest], ModelResponse],
        *,
        chunk: int = 4,
        pause: float = 0.0,
    ) -> None:
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise UsageError(f"StreamingScriptedGateway(chunk=...) must be an int >= 1: {chunk!r}")
        if not isinstance(pause, int | float) or pause < 0:
            raise UsageError(f"StreamingScriptedGateway(pause=...) must be >= 0: {pause!r}")
        super().__init__(responses)
        self.chunk, self.pause = chunk, pause

    async def stream(
        self, request: ModelRequest, *, idempotency_key: str
    ) -> AsyncIterator[StreamPart | ModelResponse]:
        self.calls.append((request, idempotency_key))
        response = self._answer(request)
        for part in self._parts(response):
            await asyncio.sleep(self.pause)
            yield part
        yield response

    def _parts(self, response: ModelResponse) -> Iterator[StreamPart]:
        for start in range(0, len(response.text), self.chunk):
            yield TextPart(response.text[start : start + self.chunk])
        for index, call in enumerate(response.tool_calls):
            yield ToolCallPart(index=index, call_id=call.id or None, name=call.name)
            arguments = call.raw_arguments if call.problem else canonical_json(call.arguments)
            for start in range(0, len(arguments), self.chunk):
                yield ToolCallPart(index=index, arguments=arguments[start : start + self.chunk])
