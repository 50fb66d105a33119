"""``OpenAIGateway``: OpenAI (Chat Completions or Responses) and OpenAI-compatible servers.

Built on the official ``openai`` SDK, imported only when a gateway is made.
Every attempt (the SDK's own retries, and asiento's retries of a 429:
``rate_limit``) carries the step's key in the ``Idempotency-Key`` header.
OpenAI ignores the header; the journal and ``asiento gateway`` honour it.
In a traced run (``Agent(telemetry=...)``) every attempt also carries the
``chat`` span's W3C ``traceparent`` (and ``tracestate``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ..errors import UsageError
from ..model import Message, ModelRequest, ModelResponse, ToolCall, ToolSchema, Usage
from ..streaming import StreamPart
from ._assembly import (
    Assembler,
    ChatAssembler,
    ResponsesAssembler,
    called,
    streamed,
)
from ._client import OwnedClient, request_headers, transport_errors
from ._errors import invalid, nonempty, sdk_missing, tool_call, usage_fields
from .quota import Quota
from .rate_limit import RateLimitPolicy, take_429s

if TYPE_CHECKING:
    from openai import AsyncOpenAI

Api = Literal["chat", "responses"]


class OpenAIGateway(OwnedClient):
    """Reach a model through the OpenAI API, or any server that speaks it (``base_url``).

    ``api="chat"`` uses Chat Completions (what OpenAI-compatible servers such as
    vLLM, llama.cpp, Ollama and LiteLLM speak); ``api="responses"`` uses the
    Responses API (``store=False``: the journal, not the provider, keeps the
    conversation). ``options`` are extra ``create()`` parameters (temperature,
    max_completion_tokens, ...). Pass ``client`` to use an ``AsyncOpenAI`` of
    your own (its retries and timeout then apply); otherwise one is made from
    ``base_url``, ``api_key`` (default: the SDK's ``OPENAI_API_KEY``),
    ``max_retries`` and ``timeout``, and ``aclose()`` closes it. ``quota`` (one
    ``Quota`` shared by many gateways) limits the requests across them;
    ``rate_limits`` says how a 429 is retried (``RateLimitPolicy``; the SDK's
    ``max_retries`` no longer applies to 429s).
    """

    def __init__(
        self,
        model: str,
        *,
        api: Api = "chat",
        client: AsyncOpenAI | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        max_retries: int = 2,
        timeout: float = 600.0,
        options: Mapping[str, Any] | None = None,
        quota: Quota | None = None,
        rate_limits: RateLimitPolicy | None = None,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise UsageError("OpenAIGateway(model) must be a non-empty str, such as 'gpt-4o'")
        if api not in ("chat", "responses"):
            raise UsageError(f"OpenAIGateway(api=...) is 'chat' or 'responses', got {api!r}")
        self.model, self.api = model, api
        self.options = dict(options or {})
        self._owned = client is None
        self.quota = quota or Quota()
        self.rate_limits = rate_limits or RateLimitPolicy()
        self.client = client or _make_client(base_url, api_key, max_retries, timeout)
        take_429s(self.client)
        url = str(self.client.base_url)
        official = "api.openai.com" in url
        self.provider = "OpenAI" if official else f"the OpenAI-compatible server at {url}"

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        """Ask under the quota, a 429 retried by asiento's policy and the rest by the SDK
        (the same key every time); parse strictly."""
        import openai

        chat = self.api == "chat"
        params = self._chat_params(request) if chat else self._responses_params(request)
        headers = request_headers(idempotency_key)
        create = (
            self.client.chat.completions.with_raw_response.create
            if chat
            else self.client.responses.with_raw_response.create
        )

        async def attempt() -> tuple[Any, bytes]:
            raw = await create(**params, extra_headers=headers)
            return raw, raw.http_response.content

        return await called(
            attempt,
            parse_chat if chat else parse_responses,
            quota=self.quota,
            policy=self.rate_limits,
            tokens=self.quota.reckon(params),
            provider=self.provider,
            key=idempotency_key,
            refused=openai.APIStatusError,
            lost=(openai.APIConnectionError,),
        )

    def stream(
        self, request: ModelRequest, *, idempotency_key: str
    ) -> AsyncIterator[StreamPart | ModelResponse]:
        """``complete()`` streamed: the parts as the API sends them, then the same answer.

        The answer is assembled from the stream's events into the body a plain call
        returns and parsed by the same parser; usage comes from the stream's last
        events (Chat Completions is asked for it with ``stream_options``).
        """
        import openai

        lost: tuple[type[Exception], ...] = (openai.APIError, *transport_errors(self.client))
        assembler: Assembler
        if self.api == "chat":
            params = self._chat_params(request) | {
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            create, assembler, parse = (
                self.client.chat.completions.create,
                ChatAssembler(),
                parse_chat,
            )
        else:
            params = self._responses_params(request) | {"stream": True}
            create, assembler, parse = (
                self.client.responses.create,
                ResponsesAssembler(),
                parse_responses,
            )

        headers = request_headers(idempotency_key)

        async def open_stream() -> Any:
            return await create(**params, extra_headers=headers)

        return streamed(
            open_stream,
            assembler,
            parse,
            quota=self.quota,
            policy=self.rate_limits,
            tokens=self.quota.reckon(params),
            provider=self.provider,
            key=idempotency_key,
            refused=openai.APIStatusError,
            lost=lost,
        )

    def _chat_params(self, request: ModelRequest) -> dict[str, Any]:
        params: dict[str, Any] = {"model": self.model, "messages": chat_messages(request)}
        if request.tools:
            params["tools"] = chat_tools(request.tools)
        return params | self.options

    def _responses_params(self, request: ModelRequest) -> dict[str, Any]:
        params: dict[str, Any] = {
            "model": self.model,
            "input": responses_input(request.messages),
            "store": False,
        }
        if request.instructions:
            params["instructions"] = request.instructions
        if request.tools:
            params["tools"] = responses_tools(request.tools)
        return params | self.options

    def __repr__(self) -> str:
        return f"OpenAIGateway({self.model!r}, api={self.api!r}, base_url={self.client.base_url!s})"


def _make_client(
    base_url: str | None, api_key: str | None, max_retries: int, timeout: float
) -> AsyncOpenAI:
    try:
        import openai
    except ImportError:
        raise sdk_missing("openai", "openai") from None
    try:
        return openai.AsyncOpenAI(
            api_key=api_key, base_url=base_url, max_retries=max_retries, timeout=timeout
        )
    except openai.OpenAIError as exc:
        raise UsageError(f"cannot make the OpenAI client: {exc}") from exc


# -- Chat Completions -------------------------------------------------------------------


def chat_messages(request: ModelRequest) -> list[dict[str, Any]]:
    """The conversation in Chat Completions form; instructions become the system message."""
    out: list[dict[str, Any]] = []
    if request.instructions:
        out.append({"role": "system", "content": request.instructions})
    for message in request.messages:
        out.append(_chat_message(message))
    return out


def _chat_message(message: Message) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    if message.role == "assistant" and message.tool_calls:
        calls = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _dumps(call.arguments)},
            }
            for call in message.tool_calls
        ]
        return {"role": "assistant", "content": message.content or None, "tool_calls": calls}
    return {"role": message.role, "content": message.content}


def chat_tools(tools: Sequence[ToolSchema]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": dict(t.parameters),
            },
        }
        for t in tools
    ]


def parse_chat(
    body: Mapping[str, Any], *, provider: str, key: str, request_id: str | None
) -> ModelResponse:
    """A Chat Completion as a ``ModelResponse``; what cannot be recorded raises."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise invalid(provider, key, "the answer has no choices", request_id)
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise invalid(provider, key, "the first choice has no message", request_id)
    text = message.get("content") or message.get("refusal") or ""
    if not isinstance(text, str):
        raise invalid(provider, key, "the message content is not text", request_id)
    calls = [_chat_call(c, provider, key, request_id) for c in message.get("tool_calls") or ()]
    return ModelResponse(
        text=text,
        tool_calls=calls,
        usage=openai_usage(body.get("usage"), "prompt", "completion"),
        model=nonempty(body.get("model")) or "",
        request_id=request_id,
    )


def _chat_call(call: Any, provider: str, key: str, request_id: str | None) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(provider, key, "a tool call has no function name", request_id)
    return tool_call(
        provider,
        key,
        request_id,
        name=function["name"],
        raw=function.get("arguments", ""),
        call_id=nonempty(call.get("id")) or "",
    )


# -- Responses ---------------------------------------------------------------------------


def responses_input(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The conversation as Responses input items (messages, function calls, their outputs)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            out.append(
                {"type": "function_call_output", "call_id": m.tool_call_id, "output": m.content}
            )
            continue
        if m.content or not m.tool_calls:
            out.append({"role": m.role, "content": m.content})
        out.extend(
            {
                "type": "function_call",
                "call_id": c.id,
                "name": c.name,
                "arguments": _dumps(c.arguments),
            }
            for c in m.tool_calls
        )
    return out


def responses_tools(tools: Sequence[ToolSchema]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "name": t.name,
            "description": t.description,
            "parameters": dict(t.parameters),
            "strict": False,
        }
        for t in tools
    ]


def parse_responses(
    body: Mapping[str, Any], *, provider: str, key: str, request_id: str | None
) -> ModelResponse:
    """A Responses answer as a ``ModelResponse``; what cannot be recorded raises."""
    output = body.get("output")
    if not isinstance(output, list):
        raise invalid(provider, key, "the answer has no output list", request_id)
    texts: list[str] = []
    calls: list[ToolCall] = []
    for item in output:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "message":
            texts.extend(_output_texts(item.get("content"), provider, key, request_id))
        elif kind == "function_call":
            calls.append(_responses_call(item, provider, key, request_id))
    return ModelResponse(
        text="".join(texts),
        tool_calls=calls,
        usage=openai_usage(body.get("usage"), "input", "output"),
        model=nonempty(body.get("model")) or "",
        request_id=request_id,
    )


def _output_texts(content: Any, provider: str, key: str, request_id: str | None) -> list[str]:
    if not isinstance(content, list):
        raise invalid(provider, key, "an output message has no content list", request_id)
    return [
        str(part.get("text", ""))
        for part in content
        if isinstance(part, dict) and part.get("type") == "output_text"
    ]


def _responses_call(item: dict[str, Any], provider: str, key: str, rid: str | None) -> ToolCall:
    if not isinstance(item.get("name"), str):
        raise invalid(provider, key, "a function call has no name", rid)
    return tool_call(
        provider,
        key,
        rid,
        name=item["name"],
        raw=item.get("arguments", ""),
        call_id=nonempty(item.get("call_id")) or "",
    )


def openai_usage(usage: Any, inp: str, out: str) -> Usage:
    """OpenAI's usage: ``{inp}_tokens`` counts cache reads and writes, itemised in its details.

    Chat Completions names them ``prompt`` / ``completion``, Responses ``input`` / ``output``.
    """
    total, output, read, written = usage_fields(
        usage,
        f"{inp}_tokens",
        f"{out}_tokens",
        f"{inp}_tokens_details.cached_tokens",
        f"{inp}_tokens_details.cache_write_tokens",
    )
    return Usage(
        input_tokens=total,
        output_tokens=output,
        cached_input_tokens=read,
        cache_write_tokens=written,
    )


def _dumps(args: Mapping[str, Any]) -> str:
    return json.dumps(dict(args), ensure_ascii=False)
