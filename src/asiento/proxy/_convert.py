"""One answer, both ways: a kept stream answered to a plain request, a kept plain answer
to a streamed one.

A run streamed by one process may be resumed by another that does not stream (a worker),
or the other way round; the step's key and request are the same but for ``"stream"``. The
proxy treats them as one request (the fingerprint leaves the streaming options out) and
answers each in the form it asked for: a kept stream is assembled into the body a plain
call returns (the same assemblers as the gateways'), a kept plain answer is sent as the
events of a stream in the API's own format.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from ..gateways._assembly import Assembler, ChatAssembler, MessagesAssembler, ResponsesAssembler

STREAM_OPTIONS = ("stream", "stream_options")  # what a streamed request adds to a plain one

_ASSEMBLERS: dict[str, type[Assembler]] = {
    "/v1/chat/completions": ChatAssembler,
    "/v1/responses": ResponsesAssembler,
    "/v1/messages": MessagesAssembler,
}


def is_stream(headers: Mapping[str, str]) -> bool:
    return "text/event-stream" in headers.get("content-type", "")


def plain_from_stream(path: str, body: bytes) -> bytes | None:
    """A kept stream as the JSON body of a plain answer; None if it cannot be assembled."""
    assembler = _ASSEMBLERS[path]()
    try:
        for event in _events(body):
            assembler.feed(event)
    except (AttributeError, TypeError, ValueError):
        return None
    whole = assembler.body()
    return None if whole is None else json.dumps(whole).encode()


def stream_from_plain(path: str, body: bytes) -> bytes | None:
    """A kept plain answer as the events of its stream; None if it is not a JSON object."""
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(answer, dict):
        return None
    render = {
        "/v1/chat/completions": _chat,
        "/v1/responses": _responses,
        "/v1/messages": _messages,
    }[path]
    return b"".join(render(answer))


def _events(body: bytes) -> Iterator[dict[str, Any]]:
    """The JSON data of each server-sent event (``[DONE]`` and comments left out)."""
    for block in body.decode().replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(
            line[5:].lstrip() for line in block.split("\n") if line.startswith("data:")
        )
        if data and data != "[DONE]":
            event = json.loads(data)
            if isinstance(event, dict):
                yield event


def _data(event: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _named(kind: str, event: Mapping[str, Any]) -> bytes:
    return f"event: {kind}\n".encode() + _data({**event, "type": kind})


def _chat(answer: dict[str, Any]) -> Iterator[bytes]:
    head = {k: answer.get(k) for k in ("id", "created", "model")} | {
        "object": "chat.completion.chunk"
    }
    for choice in answer.get("choices") or ():
        message = dict(choice.get("message") or {})
        calls = [dict(c, index=i) for i, c in enumerate(message.pop("tool_calls", None) or ())]
        delta = {k: v for k, v in message.items() if v is not None} | (
            {"tool_calls": calls} if calls else {}
        )
        part = {"index": choice.get("index", 0), "delta": delta, "finish_reason": None}
        yield _data(head | {"choices": [part]})
        finish = choice.get("finish_reason")
        end = {"index": choice.get("index", 0), "delta": {}, "finish_reason": finish}
        yield _data(head | {"choices": [end]})
    yield _data(head | {"choices": [], "usage": answer.get("usage")})
    yield b"data: [DONE]\n\n"


def _responses(answer: dict[str, Any]) -> Iterator[bytes]:
    number = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> bytes:
        return _named(kind, data | {"sequence_number": next(number)})

    started = answer | {"status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=started)
    for index, item in enumerate(answer.get("output") or ()):
        where = {"output_index": index, "item_id": item.get("id")}
        if item.get("type") == "function_call":
            yield event(
                "response.output_item.added", output_index=index, item=item | {"arguments": ""}
            )
            yield event(
                "response.function_call_arguments.delta", **where, delta=item.get("arguments", "")
            )
        else:
            yield event(
                "response.output_item.added", output_index=index, item=item | {"content": []}
            )
            for n, part in enumerate(item.get("content") or ()):
                if part.get("type") == "output_text":
                    yield event(
                        "response.output_text.delta",
                        **where,
                        content_index=n,
                        delta=part.get("text", ""),
                    )
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.completed", response=answer)


def _messages(answer: dict[str, Any]) -> Iterator[bytes]:
    content = answer.get("content") or []
    started = answer | {"content": [], "stop_reason": None, "stop_sequence": None}
    yield _named("message_start", {"message": started})
    for index, block in enumerate(content):
        yield from _block(index, block)
    stop = {"stop_reason": answer.get("stop_reason"), "stop_sequence": answer.get("stop_sequence")}
    yield _named("message_delta", {"delta": stop, "usage": answer.get("usage") or {}})
    yield _named("message_stop", {})


def _block(index: int, block: Mapping[str, Any]) -> Iterator[bytes]:
    """One content block as its start, its one delta (text, or the input's JSON), its stop."""
    kind, delta, empty = block.get("type"), None, dict(block)
    if kind == "tool_use":
        empty["input"] = {}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block.get("input"))}
    elif kind == "text":
        empty["text"] = ""
        delta = {"type": "text_delta", "text": block.get("text", "")}
    yield _named("content_block_start", {"index": index, "content_block": empty})
    if delta is not None:
        yield _named("content_block_delta", {"index": index, "delta": delta})
    yield _named("content_block_stop", {"index": index})
