"""Streamed model answers: the parts a provider sends, and the deltas ``run(stream=True)`` yields.

Deltas are shown, never journaled: the journal records a model step once its
complete response and usage are durable, so a resumed run never needs them and a
non-streaming resume of a streamed run is the same run. What a caller must know is
which attempt a delta belongs to, so it can drop the text of an attempt that was
cut (a crash, a provider error mid-stream) when the step is asked again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ._canonical import canonical_json
from .model import ModelRequest, ModelResponse


@dataclass(frozen=True, slots=True)
class TextPart:
    """A piece of the answer's text, in the order the provider sent it."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallPart:
    """A fragment of the ``index``-th tool call: its id and name come once, its arguments
    in pieces of JSON text that only make sense joined (the gateway assembles them)."""

    index: int
    arguments: str = ""
    call_id: str | None = None
    name: str | None = None


StreamPart = TextPart | ToolCallPart


@runtime_checkable
class StreamingGateway(Protocol):
    """A gateway that can stream: the parts as they come, then the whole ``ModelResponse``.

    The last item is the assembled response, with its usage; it is what the journal
    records, exactly as ``complete()`` would have returned it. The key and body rules
    are ``complete()``'s.
    """

    def stream(
        self, request: ModelRequest, *, idempotency_key: str
    ) -> AsyncIterator[StreamPart | ModelResponse]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Delta:
    """A part of the answer of model step ``step_id``, shown before the step is durable.

    ``attempt`` is the pass that asked (its lease's fencing token, which grows with
    every pass): deltas of an earlier attempt of the same step belong to an answer that
    was cut and is not the one the journal will hold. ``replayed``: the step was
    already recorded and its whole answer is shown at once, nothing was asked.
    """

    run_id: str
    step_id: str
    attempt: int
    part: StreamPart
    replayed: bool = False

    @property
    def text(self) -> str:
        """The text this delta adds ('' for a tool call fragment)."""
        return self.part.text if isinstance(self.part, TextPart) else ""


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamRestart:
    """Model step ``step_id`` is asked again by attempt ``attempt``: drop what earlier
    attempts of it streamed. Yielded before the new attempt's first delta whenever the run
    was driven before this pass, since an earlier pass may have been cut mid-stream."""

    run_id: str
    step_id: str
    attempt: int


StreamEvent = Delta | StreamRestart


def whole_parts(response: ModelResponse) -> Iterator[StreamPart]:
    """A complete answer as parts: its text in one, then each tool call in one."""
    if response.text:
        yield TextPart(response.text)
    for index, call in enumerate(response.tool_calls):
        arguments = call.raw_arguments if call.problem else canonical_json(call.arguments)
        yield ToolCallPart(index=index, arguments=arguments, call_id=call.id, name=call.name)
