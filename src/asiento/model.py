"""What crosses the boundary to a model: requests, responses, tool calls.

Plain frozen dataclasses that turn into JSON and back, so the journal holds
data, never live clients.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, overload, runtime_checkable

from . import _unfit_json
from ._canonical import canonical_json
from .errors import UsageError

Role = Literal["user", "assistant", "tool"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """One call the model asked for: a tool name and its JSON arguments.

    A call whose arguments hold values JSON cannot carry (``NaN``, ``Infinity``,
    an integer past Python's digit limit) is kept, not lost: ``problem`` says
    what is wrong, ``raw_arguments`` holds the arguments as the model wrote
    them, and ``arguments`` is empty. Such a call is never run; its step's
    outcome is the problem, fed to the model.
    """

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    id: str = ""
    raw_arguments: str = ""
    problem: str = ""

    def to_json(self) -> dict[str, Any]:
        data = {"name": self.name, "arguments": dict(self.arguments), "id": self.id}
        if self.problem:
            data |= {"raw_arguments": self.raw_arguments, "problem": self.problem}
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ToolCall:
        return cls(
            name=data["name"],
            arguments=data.get("arguments", {}),
            id=data.get("id", ""),
            raw_arguments=data.get("raw_arguments", ""),
            problem=data.get("problem", ""),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """Tokens a model call was billed for, as the provider reported them.

    ``input_tokens`` counts every input token the provider processed, cached or
    not: OpenAI's ``prompt_tokens`` as they come, Anthropic's ``input_tokens``
    plus its cache writes and reads (which Anthropic reports apart). Of those,
    ``cached_input_tokens`` were read from a prompt cache (billed at a discount)
    and ``cache_write_tokens`` were written to one (Anthropic's cache creation,
    billed at a premium); the rest, ``uncached_input_tokens``, at the input price.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0

    @property
    def uncached_input_tokens(self) -> int:
        """Input tokens neither read from nor written to a cache (never below 0)."""
        return max(self.input_tokens - self.cached_input_tokens - self.cache_write_tokens, 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelResponse:
    """The model's answer: text, and the tool calls it asks for (in order).

    ``rate_limited`` counts the 429s the request was sent again for before this
    answer came (recorded only when there were some; older records read as 0).
    ``kept`` says a key-honouring proxy (``asiento gateway``) answered from the
    generation it kept under the key (``Idempotent-Replayed``): nothing new was paid.
    """

    text: str = ""
    tool_calls: Sequence[ToolCall] = ()
    usage: Usage = field(default_factory=Usage)
    model: str = ""
    request_id: str | None = None
    rate_limited: int = 0
    kept: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"text": self.text}
        if self.tool_calls:
            data["tool_calls"] = [c.to_json() for c in self.tool_calls]
        data |= _usage_json(self.usage)
        if self.model:
            data["model"] = self.model
        if self.request_id is not None:
            data["request_id"] = self.request_id
        if self.rate_limited:
            data["rate_limited"] = self.rate_limited
        if self.kept:
            data["kept"] = True
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelResponse:
        return cls(
            text=data.get("text", ""),
            tool_calls=[ToolCall.from_json(c) for c in data.get("tool_calls", ())],
            usage=_usage_from(data),
            model=data.get("model", ""),
            request_id=data.get("request_id"),
            rate_limited=int(data.get("rate_limited", 0)),
            kept=data.get("kept") is True,
        )


def _usage_json(usage: Usage) -> dict[str, Any]:
    """``usage: [input, output]``, as journals always held it, and ``cache: [read, written]``.

    ``cache`` is a key of its own, written only when a cache was reported, so
    readers that know only ``usage`` (older versions, the run index) still load it.
    """
    data: dict[str, Any] = {}
    if usage.input_tokens or usage.output_tokens:
        data["usage"] = [usage.input_tokens, usage.output_tokens]
    if usage.cached_input_tokens or usage.cache_write_tokens:
        data["cache"] = [usage.cached_input_tokens, usage.cache_write_tokens]
    return data


def _usage_from(response: Mapping[str, Any]) -> Usage:
    """The usage of a recorded response; a record without ``cache`` read no cache."""
    inp, out = response.get("usage", (0, 0))
    read, written = response.get("cache", (0, 0))
    return Usage(
        input_tokens=inp, output_tokens=out, cached_input_tokens=read, cache_write_tokens=written
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One message of the conversation derived from the journal."""

    role: Role
    content: str = ""
    tool_calls: Sequence[ToolCall] = ()
    tool_call_id: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            data["tool_calls"] = [c.to_json() for c in self.tool_calls]
        if self.tool_call_id:
            data["tool_call_id"] = self.tool_call_id
        if self.name:
            data["name"] = self.name
        return data


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSchema:
    """A tool as the model sees it: name, description, JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "parameters": dict(self.parameters),
        }


class ConversationPrefix(Sequence[Message]):
    """The first ``length`` messages of a list that only ever grows at its end.

    What a request holds instead of a copy of the conversation: copying it at
    every step would make a step's cost, and the memory of anything that keeps
    requests, grow with the length of the run.
    """

    __slots__ = ("_items", "_length")

    def __init__(self, items: list[Message], length: int) -> None:
        self._items, self._length = items, length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Message, ...]: ...

    def __getitem__(self, index: int | slice) -> Message | tuple[Message, ...]:
        if isinstance(index, slice):
            return tuple(self._items[: self._length][index])
        if not -self._length <= index < self._length:
            raise IndexError("conversation index out of range")
        return self._items[index % self._length]

    def __iter__(self) -> Iterator[Message]:
        return itertools.islice(self._items, self._length)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConversationPrefix | tuple | list):
            return NotImplemented
        return len(other) == self._length and all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other: object) -> tuple[Message, ...]:
        """``request.messages + (message,)`` gives a tuple, as it did when this was one."""
        if not isinstance(other, ConversationPrefix | tuple | list):
            return NotImplemented
        return (*self, *other)

    def __radd__(self, other: object) -> tuple[Message, ...]:
        if not isinstance(other, tuple | list):
            return NotImplemented
        return (*other, *self)

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __reduce__(self) -> tuple[type[tuple[Message, ...]], tuple[tuple[Message, ...]]]:
        return tuple, (tuple(self),)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRequest:
    """Everything a gateway needs to ask the model for the next step.

    ``messages`` is a tuple, or a ``ConversationPrefix`` (the agent's, not copied).
    """

    instructions: str = ""
    messages: Sequence[Message] = ()
    tools: Sequence[ToolSchema] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.messages, ConversationPrefix):
            object.__setattr__(self, "messages", tuple(self.messages))
        object.__setattr__(self, "tools", tuple(self.tools))


@runtime_checkable
class Gateway(Protocol):
    """How a model is reached. The key travels to providers that honour one."""

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        """Ask the model; the same key must never be used for a different body."""
        ...


def check_response(response: object, *, where: str) -> ModelResponse:
    """Refuse a gateway answer that could not be recorded and replayed faithfully.

    What is wrong in the gateway's own objects is a ``UsageError``; arguments
    holding values JSON cannot carry are the model's, and make a call with a
    ``problem`` (see ``recordable_call``) that is recorded like any other.
    """
    if not isinstance(response, ModelResponse):
        raise UsageError(
            f"{where}: the gateway returned {type(response).__name__}, expected a ModelResponse"
        )
    if not isinstance(response.text, str):
        raise UsageError(f"{where}: ModelResponse.text must be a str")
    calls = [_checked_call(call, where) for call in response.tool_calls]
    if all(a is b for a, b in zip(calls, response.tool_calls, strict=True)):
        return response
    return replace(response, tool_calls=calls)


def recordable_call(call: ToolCall, *, raw_arguments: str | None = None) -> ToolCall:
    """``call`` as it can be recorded: itself, or, when its arguments hold values JSON
    cannot carry, a call with empty arguments, the raw text and the problem.

    ``raw_arguments`` is the text the model sent, when there was one; otherwise
    the arguments are written out with each unfit value as it was read. Other
    values that are not JSON (a set, a cycle) raise what ``canonical_json`` raised.
    """
    try:
        canonical_json(call.arguments)
        return call
    except (TypeError, ValueError, RecursionError):
        problem = _unfit_json.problem(call.arguments)
        if problem is None:
            raise
    text = raw_arguments if raw_arguments is not None else _unfit_json.render(call.arguments)
    return ToolCall(name=call.name, id=call.id, raw_arguments=text, problem=problem)


def _checked_call(call: object, where: str) -> ToolCall:
    if not isinstance(call, ToolCall) or not isinstance(call.name, str) or not call.name:
        raise UsageError(f"{where}: every tool call needs a non-empty str name, got {call!r}")
    if not isinstance(call.arguments, Mapping):
        raise UsageError(f"{where}: tool call {call.name!r} has non-object arguments")
    try:
        return recordable_call(call)
    except (TypeError, ValueError, RecursionError) as exc:
        raise UsageError(
            f"{where}: tool call {call.name!r} has arguments that are not JSON ({exc}); "
            "nothing of this answer was recorded"
        ) from None
