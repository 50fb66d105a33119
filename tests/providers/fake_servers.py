"""Model providers on 127.0.0.1 that the official SDKs talk to over real HTTP.

``FakeProvider`` speaks OpenAI Chat Completions (``/v1/chat/completions``),
OpenAI Responses (``/v1/responses``) and Anthropic Messages (``/v1/messages``).
Like ``ScriptedGateway`` it answers turn N (the number of assistant turns
already in the request) with ``script[N]``, so a resumed process is answered
the same. It checks each request the way the real API would (roles, tool-call
ids answered by tool results, Anthropic's alternation) and refuses a malformed
one with 400, counts billable generations (with the Idempotency-Key each was
made for) and records every request's headers. Knobs: ``fail_next`` (429 /
500 / 400 ...), ``delay_turn`` (the generation is counted, the answer comes
late), ``garble_next`` (a 200 whose body cannot be parsed, still billed),
``cache`` (prompt-cache tokens, read and written, reported with every answer
the way each API reports them), ``trickle_turn`` (the answer's bytes sent a
few at a time over some seconds), ``hold_stream`` (a stream stops after its
first event until the test lets it go on), ``cut_next_stream`` (a stream's
connection drops mid-way). A request with ``"stream": true`` is answered as
server-sent events in each API's own format (Chat Completions chunks and
``[DONE]``, Responses events, Anthropic Messages events), event by event.

``AsgiServer`` runs an ASGI app (the idempotency proxy) with uvicorn in a thread.

Run as a script, this file is the crash tests' child process: one pass of the
crash agent (``CHILD_SCRIPT``) through an ``OpenAIGateway``, with the outcome as
one JSON line on stdout. Arm ``ASIENTO_CRASH_AT`` to have it kill itself.

    python tests/providers/fake_servers.py child DB RUN_ID BASE_URL
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, NamedTuple

__all__ = [
    "CHILD_SCRIPT",
    "Answer",
    "AsgiServer",
    "CountingProvider",
    "FakeProvider",
    "Raw",
    "Received",
    "Tokens",
    "wait_until",
]

_ANTHROPIC_ID = re.compile(r"^[a-zA-Z0-9_-]+$")


@dataclass(frozen=True)
class Raw:
    """Tool-call arguments sent as this JSON text, byte for byte (``NaN``, 5,000 digits...)."""

    text: str


@dataclass(frozen=True)
class Answer:
    """One scripted model turn: text, and tool calls as (name, arguments) pairs."""

    text: str = ""
    calls: tuple[tuple[str, dict[str, Any] | Raw], ...] = ()


@dataclass(frozen=True)
class Received:
    """One HTTP request as the provider saw it (header names lower-cased)."""

    path: str
    headers: dict[str, str]
    body: Any
    size: int  # bytes of the body: the fake bills len // 4 input tokens
    raw: bytes = b""  # the body as it came, byte for byte
    at: float = field(default_factory=time.monotonic)  # when it arrived (the server's clock)

    @property
    def key(self) -> str | None:
        return self.headers.get("idempotency-key")


class Tokens(NamedTuple):
    """What one generation bills: all its input tokens, its output, and cache reads and writes."""

    input: int
    output: int
    read: int = 0
    written: int = 0


@dataclass
class _Knobs:
    failures: deque[tuple[int, dict[str, str] | None]] = field(default_factory=deque)
    garbage: deque[bytes] = field(default_factory=deque)
    delays: dict[int, float] = field(default_factory=dict)  # turn -> seconds, used once
    trickles: dict[int, float] = field(default_factory=dict)  # turn -> seconds, used once
    holds: deque[tuple[threading.Event, int]] = field(default_factory=deque)
    cuts: deque[int] = field(default_factory=deque)  # a stream drops before its N-th event


class FakeProvider:
    """A scripted provider on 127.0.0.1 (port 0), in a thread; use it as a context manager."""

    def __init__(self, script: Sequence[Answer]) -> None:
        self.script = list(script)
        self.requests: list[Received] = []
        self.generations: list[str | None] = []  # the key of each billable generation
        self.problems: list[str] = []  # wire-format errors it refused with 400
        self.cache = (0, 0)  # (read, written) of the input tokens billed, in every answer
        self._knobs = _Knobs()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def anthropic_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def billed(self, key: str | None = None) -> int:
        """Billable generations, all or for one idempotency key."""
        with self._lock:
            return sum(1 for k in self.generations if key is None or k == key)

    def fail_next(self, n: int, status: int, headers: dict[str, str] | None = None) -> None:
        """Answer the next ``n`` requests with ``status`` (not billed); ``headers`` replace
        the ``retry-after-ms: 5`` a 429 or 5xx otherwise carries."""
        with self._lock:
            self._knobs.failures.extend([(status, headers)] * n)

    def delay_turn(self, turn: int, seconds: float) -> None:
        """Count the next generation of ``turn`` (0 = m1) at once; answer ``seconds`` later."""
        with self._lock:
            self._knobs.delays[turn] = seconds

    def trickle_turn(self, turn: int, seconds: float) -> None:
        """Send the next answer of ``turn`` a few bytes at a time, over ``seconds``."""
        with self._lock:
            self._knobs.trickles[turn] = seconds

    def hold_stream(self, after: int = 0) -> threading.Event:
        """The next stream stops after its event number ``after`` (0: the first) until the
        returned event is set."""
        go_on = threading.Event()
        with self._lock:
            self._knobs.holds.append((go_on, after))
        return go_on

    def cut_next_stream(self, before_event: int) -> None:
        """The next stream's connection drops before its ``before_event``-th event (billed)."""
        with self._lock:
            self._knobs.cuts.append(before_event)

    def garble_next(self, body: bytes, n: int = 1) -> None:
        """Bill the next ``n`` generations but answer 200 with ``body`` instead (a stream's
        whole body, events and all, when a stream was asked for)."""
        with self._lock:
            self._knobs.garbage.extend([body] * n)

    def __enter__(self) -> FakeProvider:
        self._thread.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # -- one request -------------------------------------------------------------------

    def answer(self, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, dict, Body]:
        """Status, headers and body for one request (runs in the server's thread)."""
        body = _json(raw)
        with self._lock:
            self.requests.append(Received(path, headers, body, len(raw), raw))
            if self._knobs.failures:
                return _failure(*self._knobs.failures.popleft())
        route = _ROUTES.get(path)
        if route is None:
            return _status(404, f"no route {path}")
        check, turn_of, render = route
        problem = check(body) if isinstance(body, dict) else "the body is not a JSON object"
        if problem:
            self.problems.append(problem)
            return _status(400, problem)
        turn = turn_of(body)
        if turn >= len(self.script):
            return _status(400, f"the script has {len(self.script)} turns; turn {turn} asked")
        return self._generate(body, raw, headers, turn, render)

    def _generate(
        self, body: dict, raw: bytes, headers: dict[str, str], turn: int, render: Callable
    ) -> tuple[int, dict, Body]:
        with self._lock:
            self.generations.append(headers.get("idempotency-key"))
            n = len(self.generations)
            delay = self._knobs.delays.pop(turn, 0.0)
            trickle = self._knobs.trickles.pop(turn, 0.0)
            garbage = self._knobs.garbage.popleft() if self._knobs.garbage else None
        if delay:
            self._closing.wait(delay)
        answer = self.script[turn]
        usage = Tokens(
            len(raw) // 4, 5 + 10 * len(answer.calls) + len(answer.text) // 4, *self.cache
        )
        out, id_header = render(n, body.get("model", ""), answer, usage)
        if body.get("stream") is True and garbage is not None:  # a whole stream, ill-formed
            return 200, {id_header: f"req_{n}", "content-type": "text/event-stream"}, garbage
        if body.get("stream") is True:
            events = _STREAMS[render](out)
            return (
                200,
                {id_header: f"req_{n}", "content-type": "text/event-stream"},
                self._sse(events),
            )
        content = garbage if garbage is not None else _dumps(out).encode()
        if trickle:
            content = self._trickled(content, trickle)
        return 200, {id_header: f"req_{n}", "content-type": "application/json"}, content

    def _trickled(self, content: bytes, seconds: float) -> Iterator[bytes]:
        pieces = max(1, round(seconds / 0.1))  # no read waits longer than about 0.1 s
        size = -(-len(content) // pieces)
        for start in range(0, len(content), size):
            yield content[start : start + size]
            if self._closing.wait(seconds / pieces):
                return

    def _sse(self, events: Iterator[bytes]) -> Iterator[bytes]:
        """An answer as the events of its stream, each sent as it comes (held if asked)."""
        with self._lock:
            hold = self._knobs.holds.popleft() if self._knobs.holds else None
            cut = self._knobs.cuts.popleft() if self._knobs.cuts else None
        for i, event in enumerate(events):
            if cut is not None and i == cut:
                raise _CutStream  # the connection drops without the chunked terminator
            yield event
            if hold is not None and i == hold[1]:
                hold[0].wait(timeout=30)


def _handler(provider: FakeProvider) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # else each answer waits ~40 ms for a delayed ACK

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            headers = {k.lower(): v for k, v in self.headers.items()}
            status, out_headers, content = provider.answer(self.path, headers, raw)
            try:
                self.send_response(status)
                for name, value in out_headers.items():
                    self.send_header(name, value)
                if isinstance(content, bytes):
                    self.send_header("content-length", str(len(content)))
                    self.end_headers()
                    self.wfile.write(content)
                else:
                    self._send_chunked(content)
            except OSError:
                pass  # the client is gone (killed): the generation is billed all the same
            except _CutStream:
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)

        def _send_chunked(self, pieces: Iterator[bytes]) -> None:
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for piece in pieces:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


Body = bytes | Iterator[bytes]  # an iterator is sent as it yields, chunked


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _dumps(out: Any) -> str:
    """``json.dumps``, with each ``Raw`` value written as its own text."""
    raws: list[str] = []

    def mark(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(out))
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), raw)
    return text


def _arguments(args: dict[str, Any] | Raw) -> str:
    return args.text if isinstance(args, Raw) else json.dumps(args)


def _status(status: int, message: str) -> tuple[int, dict, Body]:
    body = {"error": {"message": message, "type": "invalid_request_error"}}
    return status, {"content-type": "application/json"}, json.dumps(body).encode()


def _failure(status: int, extra: dict[str, str] | None = None) -> tuple[int, dict, Body]:
    code, headers, body = _status(status, f"injected failure {status}")
    if extra is not None:
        headers |= extra
    elif status == 429 or status >= 500:
        headers["retry-after-ms"] = "5"  # the SDKs honour it: retries stay fast in tests
    return code, headers, body


# -- OpenAI Chat Completions ------------------------------------------------------------


def _check_chat(body: dict) -> str | None:
    messages = body.get("messages")
    if not body.get("model") or not isinstance(messages, list) or not messages:
        return "model and a non-empty messages list are required"
    for tool in body.get("tools", []):
        fn = tool.get("function", {})
        if tool.get("type") != "function" or not fn.get("name"):
            return f"bad tool {tool}"
        if fn.get("parameters", {}).get("type") != "object":
            return f"tool {fn.get('name')} parameters must be an object schema"
    return _check_chat_messages(messages)


def _check_chat_messages(messages: list[dict]) -> str | None:
    open_ids: set[str] = set()
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            if m.get("tool_call_id") not in open_ids:
                return f"tool message answers unknown call {m.get('tool_call_id')!r}"
            open_ids.discard(m["tool_call_id"])
        elif open_ids:
            return f"tool calls {sorted(open_ids)} have no tool message"
        elif role == "assistant":
            for call in m.get("tool_calls") or []:
                fn = call.get("function", {})
                if call.get("type") != "function" or not call.get("id") or not fn.get("name"):
                    return f"bad assistant tool call {call}"
                if not isinstance(_json(fn.get("arguments", "").encode()), dict):
                    return "tool call arguments must be a JSON object in a string"
                open_ids.add(call["id"])
        elif role not in ("system", "user") or (role == "system" and i != 0):
            return f"role {role!r} is unknown or out of place at message {i}"
    return None


def _chat_turn(body: dict) -> int:
    return sum(1 for m in body["messages"] if m.get("role") == "assistant")


def _render_chat(n: int, model: str, answer: Answer, usage: Tokens) -> tuple[dict, str]:
    calls = [
        {
            "id": f"call_{n}_{i}",
            "type": "function",
            "function": {"name": name, "arguments": _arguments(args)},
        }
        for i, (name, args) in enumerate(answer.calls, 1)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": answer.text or None}
    if calls:
        message["tool_calls"] = calls
    out = {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}
        ],
        "usage": {
            "prompt_tokens": usage.input,  # cache reads and writes included, itemised below
            "completion_tokens": usage.output,
            "total_tokens": usage.input + usage.output,
        },
    }
    if usage.read or usage.written:
        details = {"cached_tokens": usage.read}
        if usage.written:  # newer models only; servers such as vLLM send cached_tokens alone
            details["cache_write_tokens"] = usage.written
        out["usage"]["prompt_tokens_details"] = details
    return out, "x-request-id"


def _chat_sse(completion: dict) -> Iterator[bytes]:
    """A chat completion as the chunks of its stream, then ``[DONE]``."""
    for chunk in _chat_chunks(completion):
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def _event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data | {'type': kind})}\n\n".encode()


def _responses_sse(response: dict) -> Iterator[bytes]:
    """A Responses answer as its stream: created, each output item with its deltas, completed."""
    seq = itertools.count()

    def event(kind: str, **data: Any) -> bytes:
        return _event(kind, data | {"sequence_number": next(seq)})

    started = response | {"status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=started)
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            empty = item | {"status": "in_progress", "content": []}
            yield event("response.output_item.added", output_index=index, item=empty)
            part = {"type": "output_text", "text": "", "annotations": []}
            yield event(
                "response.content_part.added",
                item_id=item["id"], output_index=index, content_index=0, part=part,
            )  # fmt: skip
            text = item["content"][0]["text"]
            for piece in _pieces(text):
                yield event(
                    "response.output_text.delta",
                    item_id=item["id"], output_index=index, content_index=0, delta=piece,
                    logprobs=[],
                )  # fmt: skip
            yield event(
                "response.output_text.done",
                item_id=item["id"], output_index=index, content_index=0, text=text, logprobs=[],
            )  # fmt: skip
            yield event(
                "response.content_part.done", item_id=item["id"], output_index=index,
                content_index=0, part=item["content"][0],
            )  # fmt: skip
        else:
            empty = item | {"arguments": "", "status": "in_progress"}
            yield event("response.output_item.added", output_index=index, item=empty)
            for piece in _pieces(item["arguments"]):
                yield event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"], output_index=index, delta=piece,
                )  # fmt: skip
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"], output_index=index, arguments=item["arguments"],
            )  # fmt: skip
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.completed", response=response)


def _messages_sse(message: dict) -> Iterator[bytes]:
    """An Anthropic message as its stream: start, each content block with deltas, stop."""
    usage = message["usage"]
    started = message | {"content": [], "stop_reason": None, "usage": usage | {"output_tokens": 1}}
    yield _event("message_start", {"message": started})
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            yield _event(
                "content_block_start", {"index": index, "content_block": block | {"text": ""}}
            )
            for piece in _pieces(block["text"]):
                delta = {"type": "text_delta", "text": piece}
                yield _event("content_block_delta", {"index": index, "delta": delta})
        else:
            empty = block | {"input": {}}
            yield _event("content_block_start", {"index": index, "content_block": empty})
            for piece in _pieces(json.dumps(block["input"])):
                delta = {"type": "input_json_delta", "partial_json": piece}
                yield _event("content_block_delta", {"index": index, "delta": delta})
        yield _event("content_block_stop", {"index": index})
    stop = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    yield _event("message_delta", {"delta": stop, "usage": usage})
    yield _event("message_stop", {})


def _pieces(text: str, size: int = 7) -> Iterator[str]:
    """Text in the small pieces a model streams."""
    for start in range(0, len(text), size):
        yield text[start : start + size]


class _CutStream(Exception):
    """Raised inside a stream's body to drop the connection mid-stream."""


def _chat_chunks(completion: dict) -> Iterator[dict]:
    """The stream of a completion: the role, the text, each tool call, then the finish."""
    choice = completion["choices"][0]
    message = choice["message"]
    head = {k: completion[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return head | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    for piece in _pieces(message["content"] or ""):
        yield chunk({"content": piece})
    for i, call in enumerate(message.get("tool_calls") or []):
        function = call["function"]
        head_of_call = call | {"index": i, "function": {"name": function["name"], "arguments": ""}}
        yield chunk({"tool_calls": [head_of_call]})
        for piece in _pieces(function["arguments"]):
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    yield chunk({}, choice["finish_reason"])
    yield head | {"choices": [], "usage": completion["usage"]}


# -- OpenAI Responses -------------------------------------------------------------------


def _check_responses(body: dict) -> str | None:
    items = body.get("input")
    if not body.get("model") or not isinstance(items, list) or not items:
        return "model and a non-empty input list are required"
    for tool in body.get("tools", []):
        if tool.get("type") != "function" or not tool.get("name") or "parameters" not in tool:
            return f"bad tool {tool}"
    called: set[str] = set()
    for item in items:
        kind = item.get("type", "message")
        if kind == "function_call":
            if not item.get("call_id") or not isinstance(_json(item["arguments"].encode()), dict):
                return f"bad function_call {item}"
            called.add(item["call_id"])
        elif kind == "function_call_output":
            if item.get("call_id") not in called:
                return f"function_call_output for unknown call {item.get('call_id')!r}"
        elif item.get("role") not in ("user", "assistant", "system", "developer"):
            return f"bad input item {item}"
    return None


def _responses_turn(body: dict) -> int:
    turns, in_turn = 0, False
    for item in body["input"]:
        assistant = item.get("role") == "assistant" or item.get("type") == "function_call"
        if assistant and not in_turn:
            turns += 1
        in_turn = assistant
    return turns


def _render_responses(n: int, model: str, answer: Answer, usage: Tokens) -> tuple[dict, str]:
    output: list[dict[str, Any]] = []
    if answer.text:
        text = {"type": "output_text", "text": answer.text, "annotations": []}
        output.append(
            {"type": "message", "id": f"msg_{n}", "status": "completed", "role": "assistant",
             "content": [text]}
        )  # fmt: skip
    output.extend(
        {"type": "function_call", "id": f"fc_{n}_{i}", "call_id": f"call_{n}_{i}",
         "name": name, "arguments": _arguments(args), "status": "completed"}
        for i, (name, args) in enumerate(answer.calls, 1)
    )  # fmt: skip
    out = {
        "id": f"resp_{n}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed",
        "model": model,
        "output": output,
        "usage": {
            "input_tokens": usage.input,  # cache reads and writes included, itemised below
            "output_tokens": usage.output,
            "total_tokens": usage.input + usage.output,
        },
    }
    if usage.read or usage.written:
        details = {"cached_tokens": usage.read, "cache_write_tokens": usage.written}
        out["usage"]["input_tokens_details"] = details
    return out, "x-request-id"


# -- Anthropic Messages -----------------------------------------------------------------


def _check_messages(body: dict) -> str | None:
    messages = body.get("messages")
    if not body.get("model") or not isinstance(body.get("max_tokens"), int):
        return "model and max_tokens are required"
    if not isinstance(messages, list) or not messages or messages[0].get("role") != "user":
        return "messages must start with a user message"
    if "system" in body and not isinstance(body["system"], str | list):
        return "system must be text or text blocks"
    for tool in body.get("tools", []):
        if not tool.get("name") or tool.get("input_schema", {}).get("type") != "object":
            return f"bad tool {tool}"
    return _check_turns(messages)


def _check_turns(messages: list[dict]) -> str | None:
    expected: set[str] = set()
    for i, m in enumerate(messages):
        if m.get("role") != ("user" if i % 2 == 0 else "assistant"):
            return f"message {i} breaks the user/assistant alternation"
        content = m.get("content")
        blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
        results = {b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"}
        if results != expected:
            return f"tool_use ids {sorted(expected)} answered by {sorted(results - {None})}"
        expected = set()
        for b in blocks:
            if b.get("type") == "text" and not b.get("text"):
                return "text content blocks must be non-empty"
            if b.get("type") == "tool_use":
                if not _ANTHROPIC_ID.match(b.get("id", "")) or not isinstance(b.get("input"), dict):
                    return f"bad tool_use block {b}"
                expected.add(b["id"])
    return None


def _messages_turn(body: dict) -> int:
    return sum(1 for m in body["messages"] if m.get("role") == "assistant")


def _render_messages(n: int, model: str, answer: Answer, usage: Tokens) -> tuple[dict, str]:
    content: list[dict[str, Any]] = []
    if answer.text:
        content.append({"type": "text", "text": answer.text})
    content.extend(
        {"type": "tool_use", "id": f"toolu_{n}_{i}", "name": name, "input": args}
        for i, (name, args) in enumerate(answer.calls, 1)
    )
    out = {
        "id": f"msg_{n}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": "tool_use" if answer.calls else "end_turn",
        "stop_sequence": None,
        "usage": {
            # Anthropic leaves cache writes and reads out of input_tokens
            "input_tokens": usage.input - usage.read - usage.written,
            "output_tokens": usage.output,
            "cache_creation_input_tokens": usage.written if usage.written else None,
            "cache_read_input_tokens": usage.read if usage.read else None,
        },
    }
    return out, "request-id"


_ROUTES: dict[str, tuple[Callable, Callable, Callable]] = {
    "/v1/chat/completions": (_check_chat, _chat_turn, _render_chat),
    "/v1/responses": (_check_responses, _responses_turn, _render_responses),
    "/v1/messages": (_check_messages, _messages_turn, _render_messages),
}
_STREAMS: dict[Callable, Callable[[dict], Iterator[bytes]]] = {
    _render_chat: _chat_sse,
    _render_responses: _responses_sse,
    _render_messages: _messages_sse,
}


# -- helpers ----------------------------------------------------------------------------


def wait_until(condition: Callable[[], bool], *, timeout: float = 20.0) -> None:
    """Poll ``condition`` every 20 ms; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.02)


class AsgiServer:
    """An ASGI app (the proxy) served by uvicorn on 127.0.0.1 (a free port), in a thread.

    With the HTTP parser and loop ``asiento gateway`` serves the proxy with.
    """

    def __init__(self, app: Any) -> None:
        import uvicorn

        from asiento.proxy.app import server_options

        self.app = app
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        http, loop = server_options()
        config = uvicorn.Config(app, log_level="warning", lifespan="on", http=http, loop=loop)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def __enter__(self) -> AsgiServer:
        self._thread.start()
        wait_until(lambda: self._server.started, timeout=10)
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


# -- a provider that counts what reaches it at once ----------------------------------------


class _Backlogged(ThreadingHTTPServer):
    request_queue_size = 512  # a burst of hundreds of connections is not refused
    daemon_threads = True


class CountingProvider:
    """Answers every chat and messages request "ok"; counts what it holds at once.

    Each request is held (up to ``hold`` seconds) until more than ``crowd`` are in
    flight, so a burst that is not capped shows. ``arrivals`` holds when each
    request came (``time.monotonic``), its path and Idempotency-Key, in order.
    Answers bill 1 input and 1 output token. Use it as a context manager.
    """

    def __init__(self, *, crowd: int = 8, hold: float = 0.02) -> None:
        self.crowd, self.hold = crowd, hold
        self.in_flight = self.most = self.served = 0
        self.arrivals: list[tuple[float, str, str | None]] = []
        self._cond = threading.Condition()
        self.server = _Backlogged(("127.0.0.1", 0), _counting_handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def arrived(self) -> int:
        with self._cond:
            return len(self.arrivals)

    def enter(self, path: str, key: str | None) -> None:
        with self._cond:
            self.arrivals.append((time.monotonic(), path, key))
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.in_flight > self.crowd, timeout=self.hold)

    def leave(self) -> None:
        with self._cond:
            self.in_flight -= 1
            self.served += 1

    def __enter__(self) -> CountingProvider:
        self.thread.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.server.shutdown()
        self.server.server_close()


def _counting_handler(server: CountingProvider) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # else each answer waits ~40 ms for a delayed ACK

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", "0")))
            server.enter(self.path, self.headers.get("idempotency-key"))
            try:
                body = json.dumps(_ok(self.path)).encode()
            finally:
                server.leave()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def _ok(path: str) -> dict[str, Any]:
    if path.endswith("/messages"):
        return {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
    return {
        "id": "c1",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


# -- the crash tests' child process -------------------------------------------------------

#: What the provider answers the child's agent: read /x, then read /y, then done.
CHILD_SCRIPT = (
    Answer(calls=(("read", {"path": "/x"}),)),
    Answer(text="one more", calls=(("read", {"path": "/y"}),)),
    Answer(text="done"),
)


async def _child_pass(db: str, run_id: str, base_url: str) -> dict[str, Any]:
    from asiento import Agent, FinalStep, Session, SqliteCheckpointer, tool
    from asiento.gateways import OpenAIGateway

    @tool(idempotent=True)
    def read(path: str) -> str:
        """Read a file."""
        return f"contents of {path}"

    agent = Agent(instructions="Read what you are asked to.", tools=[read])
    store = SqliteCheckpointer(db)
    gateway = OpenAIGateway("gpt-test", base_url=base_url, api_key="sk-test")
    session = Session(run_id, gateway, store)
    ended = "not closed"
    try:
        async for step in agent.run("read /x and /y", session=session):
            if isinstance(step, FinalStep):
                ended = "already closed" if step.replayed else "closed"
    finally:
        await store.close()
        await gateway.aclose()
    stats = session.stats
    return {
        "ended": ended,
        "model_calls": stats.model_calls,
        "replayed": stats.model_calls_replayed,
    }


if __name__ == "__main__":
    import asyncio
    import sys

    if sys.argv[1:2] != ["child"] or len(sys.argv) != 5:
        sys.exit("usage: fake_servers.py child DB RUN_ID BASE_URL")
    outcome = asyncio.run(_child_pass(*sys.argv[2:5]))
    sys.stdout.write(json.dumps(outcome) + "\n")
