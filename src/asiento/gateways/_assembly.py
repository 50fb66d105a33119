"""A model call's answer as a gateway records it: a plain call's body, or a stream's, rebuilt.

``called`` and ``streamed`` are the one path of a plain and a streamed call:
sent through the rate-limit policy, the SDK's errors made asiento's (in
``_sdk_errors``, for both), the answer parsed strictly.

Each provider streams its own events. An assembler reads them one by one (as
dicts, the way the official SDKs parse them), says which ``StreamPart`` each
adds, and at the end gives the answer's body in the shape the non-streamed call
returns, so the gateway parses it with the same parser and records exactly what
a plain call would have: a streamed run and a plain run have the same journal.
A stream that ends before its last event has no body: it was cut.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Protocol

from ..model import ModelResponse
from ..streaming import StreamPart, TextPart, ToolCallPart
from ._errors import Parser, answer_from, answered, read_answer, status_error, unavailable
from .quota import Quota
from .rate_limit import RateLimitPolicy, holding, send, settled


async def called(
    attempt: Callable[[], Awaitable[tuple[Any, bytes]]],
    parse: Parser,
    *,
    quota: Quota,
    policy: RateLimitPolicy,
    tokens: int,
    provider: str,
    key: str,
    refused: type[Exception],
    lost: tuple[type[Exception], ...],
) -> ModelResponse:
    """One plain call: ``attempt()`` sent through the policy, its answer parsed strictly.

    ``attempt()`` gives the SDK's raw response (its ``request_id`` and ``headers``)
    and the body it read. The SDK's errors become asiento's as in ``streamed``.
    """
    with _sdk_errors(provider, key, refused=refused, lost=lost):
        sent = await send(
            attempt, quota=quota, policy=policy, tokens=tokens, provider=provider, key=key
        )
    raw, content = sent.value
    answer = read_answer(parse, content, provider=provider, key=key, request_id=raw.request_id)
    return answered(settled(kept_if_replayed(answer, raw.headers), sent))


async def streamed(
    open_stream: Callable[[], Awaitable[Any]],
    assembler: Assembler,
    parse: Parser,
    *,
    quota: Quota,
    policy: RateLimitPolicy,
    tokens: int,
    provider: str,
    key: str,
    refused: type[Exception],
    lost: tuple[type[Exception], ...],
) -> AsyncIterator[StreamPart | ModelResponse]:
    """One streamed call: its parts as they come, then its answer, parsed as a plain one.

    ``open_stream()`` opens the SDK's stream (a 429 there is retried by the policy,
    the same key and body); the quota's place is held until the stream is read. The
    SDK's errors become asiento's: ``refused`` (its status error) says whose fault by
    the status, ``lost`` (its connection errors, and the transport's raised mid-stream)
    is ``ModelUnavailable``.
    """
    with _sdk_errors(provider, key, refused=refused, lost=lost):
        async with holding(
            open_stream, quota=quota, policy=policy, tokens=tokens, provider=provider, key=key
        ) as sent:
            stream = sent.value
            async with stream:  # closes the HTTP response however the reading ends
                async for event in stream:
                    for part in assembler.feed(event.model_dump()):
                        yield part
            body = assembler.body()
            headers = getattr(getattr(stream, "response", None), "headers", None)
    if body is None:
        raise unavailable(provider, key, "the stream ended before its last event (cut short)")
    request_id = _request_id(headers)
    answer = answer_from(parse, body, provider=provider, key=key, request_id=request_id)
    yield answered(settled(kept_if_replayed(answer, headers), sent))


def kept_if_replayed(answer: ModelResponse, headers: Mapping[str, str] | None) -> ModelResponse:
    """The answer marked ``kept`` when a key-honouring proxy replayed it (no new generation)."""
    if headers and headers.get("idempotent-replayed") == "true":
        return replace(answer, kept=True)
    return answer


@contextmanager
def _sdk_errors(
    provider: str, key: str, *, refused: type[Exception], lost: tuple[type[Exception], ...]
) -> Iterator[None]:
    """The SDK's errors as asiento's: ``refused`` (its status error) says whose fault by the
    status; ``lost`` (the connection's errors) is ``ModelUnavailable``."""
    try:
        yield
    except refused as exc:
        raise status_error(provider, key, exc) from exc
    except lost as exc:
        raise unavailable(provider, key, str(exc)) from exc


def _request_id(headers: Mapping[str, str] | None) -> str | None:
    if not headers:
        return None
    return headers.get("x-request-id") or headers.get("request-id")


class Assembler(Protocol):
    def feed(self, event: Mapping[str, Any]) -> list[StreamPart]:
        """The parts this event adds (none for bookkeeping events)."""
        ...

    def body(self) -> dict[str, Any] | None:
        """The whole answer as a plain call returns it; None if the stream was cut."""
        ...


class ChatAssembler:
    """Chat Completions chunks: text deltas, tool calls by ``index``, usage in the last chunk.

    The end is the chunk with a ``finish_reason`` (the SDK consumes ``[DONE]``).
    """

    def __init__(self) -> None:
        self._head: dict[str, Any] = {}
        self._text: list[str] = []
        self._refusal: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._usage: Any = None
        self._finish: str | None = None

    def feed(self, event: Mapping[str, Any]) -> list[StreamPart]:
        for name in ("id", "model", "created"):
            if event.get(name) is not None:
                self._head.setdefault(name, event[name])
        if event.get("usage") is not None:
            self._usage = event["usage"]
        parts: list[StreamPart] = []
        for choice in event.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self._text.append(delta["content"])
                parts.append(TextPart(delta["content"]))
            if delta.get("refusal"):
                self._refusal.append(delta["refusal"])
                parts.append(TextPart(delta["refusal"]))
            for fragment in delta.get("tool_calls") or ():
                parts.append(self._call(fragment))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return parts

    def _call(self, fragment: Mapping[str, Any]) -> ToolCallPart:
        index = fragment.get("index") or 0
        call = self._calls.setdefault(
            index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        function = fragment.get("function") or {}
        if fragment.get("id"):
            call["id"] = fragment["id"]
        if function.get("name"):
            call["function"]["name"] += function["name"]
        arguments = function.get("arguments") or ""
        call["function"]["arguments"] += arguments
        return ToolCallPart(
            index=index,
            arguments=arguments,
            call_id=fragment.get("id") or None,
            name=function.get("name") or None,
        )

    def body(self) -> dict[str, Any] | None:
        if self._finish is None:
            return None
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self._text) or None,
            "refusal": "".join(self._refusal) or None,
        }
        if self._calls:
            message["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        choice = {"index": 0, "message": message, "finish_reason": self._finish}
        return self._head | {"choices": [choice], "usage": self._usage}


class ResponsesAssembler:
    """Responses events: the last (``response.completed`` / ``.incomplete``) holds the answer."""

    _LAST = ("response.completed", "response.incomplete")

    def __init__(self) -> None:
        self._final: dict[str, Any] | None = None
        self._calls: dict[int, int] = {}  # output_index -> the call's index among calls

    def feed(self, event: Mapping[str, Any]) -> list[StreamPart]:
        kind = event.get("type")
        if kind in self._LAST:
            self._final = dict(event.get("response") or {})
            return []
        if kind == "response.output_text.delta" and event.get("delta"):
            return [TextPart(event["delta"])]
        if kind == "response.refusal.delta" and event.get("delta"):
            return [TextPart(event["delta"])]
        item = event.get("item") or {}
        if kind == "response.output_item.added" and item.get("type") == "function_call":
            index = self._calls[event.get("output_index", 0)] = len(self._calls)
            return [
                ToolCallPart(
                    index=index,
                    arguments=item.get("arguments") or "",
                    call_id=item.get("call_id") or None,
                    name=item.get("name") or None,
                )
            ]
        if kind == "response.function_call_arguments.delta" and event.get("delta"):
            index = self._calls.get(event.get("output_index", 0), 0)
            return [ToolCallPart(index=index, arguments=event["delta"])]
        return []

    def body(self) -> dict[str, Any] | None:
        return self._final


class MessagesAssembler:
    """Anthropic Messages events: content blocks built from their deltas, ``message_stop`` last.

    A tool_use block's input comes as pieces of JSON text; it is kept as the joined
    text, which the parser decodes as it decodes OpenAI's argument strings.
    """

    def __init__(self) -> None:
        self._message: dict[str, Any] = {}
        self._blocks: dict[int, dict[str, Any]] = {}
        self._inputs: dict[int, list[str]] = {}
        self._calls: dict[int, int] = {}  # block index -> the call's index among calls
        self._stopped = False

    def feed(self, event: Mapping[str, Any]) -> list[StreamPart]:
        kind = event.get("type")
        if kind == "message_start":
            self._message = dict(event.get("message") or {})
        elif kind == "content_block_start":
            return self._start(event.get("index", 0), dict(event.get("content_block") or {}))
        elif kind == "content_block_delta":
            return self._delta(event.get("index", 0), event.get("delta") or {})
        elif kind == "message_delta":
            self._message.update(
                {k: v for k, v in (event.get("delta") or {}).items() if v is not None}
            )
            usage = dict(self._message.get("usage") or {})
            usage.update({k: v for k, v in (event.get("usage") or {}).items() if v is not None})
            self._message["usage"] = usage
        elif kind == "message_stop":
            self._stopped = True
        return []

    def _start(self, index: int, block: dict[str, Any]) -> list[StreamPart]:
        self._blocks[index] = block
        if block.get("type") == "text" and block.get("text"):
            return [TextPart(block["text"])]
        if block.get("type") == "tool_use":
            self._inputs[index] = []
            call = self._calls[index] = len(self._calls)
            name = block.get("name")
            return [ToolCallPart(index=call, call_id=block.get("id") or None, name=name)]
        return []

    def _delta(self, index: int, delta: Mapping[str, Any]) -> list[StreamPart]:
        block = self._blocks.setdefault(index, {"type": "text", "text": ""})
        if delta.get("type") == "text_delta" and delta.get("text"):
            block["text"] = (block.get("text") or "") + delta["text"]
            return [TextPart(delta["text"])]
        if delta.get("type") == "input_json_delta" and delta.get("partial_json"):
            self._inputs.setdefault(index, []).append(delta["partial_json"])
            return [ToolCallPart(index=self._calls.get(index, 0), arguments=delta["partial_json"])]
        return []

    def body(self) -> dict[str, Any] | None:
        if not self._stopped:
            return None
        content = []
        for index in sorted(self._blocks):
            block = dict(self._blocks[index])
            if block.get("type") == "tool_use":
                block["input"] = "".join(self._inputs.get(index, ()))
            content.append(block)
        return self._message | {"content": content}
