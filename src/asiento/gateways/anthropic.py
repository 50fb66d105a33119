"""``AnthropicGateway``: Claude through the Messages API, on the official ``anthropic`` SDK.

The SDK is imported only when a gateway is made. Every attempt (the SDK's own
retries, and asiento's retries of a 429: ``rate_limit``) carries the step's key
in the ``Idempotency-Key`` header; Anthropic ignores it, the journal and
``asiento gateway`` honour it.
In a traced run (``Agent(telemetry=...)``) every attempt also carries the
``chat`` span's W3C ``traceparent`` (and ``tracestate``).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..model import Message, ModelRequest, ModelResponse, ToolCall, ToolSchema, Usage
from ..streaming import StreamPart
from ._assembly import MessagesAssembler, called, streamed
from ._client import OwnedClient, request_headers, transport_errors
from ._errors import invalid, nonempty, sdk_missing, tool_call, usage_fields
from .quota import Quota
from .rate_limit import RateLimitPolicy, take_429s

if TYPE_CHECKING:
    from anthropic import AsyncAnthropic

_UNSAFE_ID = re.compile(r"[^a-zA-Z0-9_-]")


class AnthropicGateway(OwnedClient):
    """Reach Claude through the Messages API.

    Instructions go in ``system``; the tool results of one turn travel together
    in one user message, as the API requires. ``max_tokens`` is required by the
    API; ``options`` are extra ``create()`` parameters (temperature, ...). Pass
    ``client`` to use an ``AsyncAnthropic`` of your own; otherwise one is made
    from ``base_url``, ``api_key`` (default: the SDK's ``ANTHROPIC_API_KEY``),
    ``max_retries`` and ``timeout``, and ``aclose()`` closes it. ``quota`` (one
    ``Quota`` shared by many gateways) limits the requests across them;
    ``rate_limits`` says how a 429 is retried (``RateLimitPolicy``; the SDK's
    ``max_retries`` no longer applies to 429s).
    """

    def __init__(
        self,
        model: str,
        *,
        max_tokens: int = 4096,
        client: AsyncAnthropic | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        max_retries: int = 2,
        timeout: float = 600.0,
        options: Mapping[str, Any] | None = None,
        quota: Quota | None = None,
        rate_limits: RateLimitPolicy | None = None,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise UsageError("AnthropicGateway(model) must be a non-empty str")
        if max_tokens < 1:
            raise UsageError("AnthropicGateway(max_tokens=...) must be at least 1")
        self.model, self.max_tokens = model, max_tokens
        self.options = dict(options or {})
        self._owned = client is None
        self.quota = quota or Quota()
        self.rate_limits = rate_limits or RateLimitPolicy()
        self.client = client or _make_client(base_url, api_key, max_retries, timeout)
        take_429s(self.client)
        url = str(self.client.base_url)
        self.provider = "Anthropic" if "api.anthropic.com" in url else f"Anthropic at {url}"

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        """Ask under the quota, a 429 retried by asiento's policy and the rest by the SDK
        (the same key every time); parse strictly."""
        import anthropic

        params = self._params(request)
        headers = request_headers(idempotency_key)

        async def attempt() -> tuple[Any, bytes]:
            raw = await self.client.messages.with_raw_response.create(
                **params, extra_headers=headers
            )
            return raw, await raw.read()

        return await called(
            attempt,
            parse_message,
            quota=self.quota,
            policy=self.rate_limits,
            tokens=self.quota.reckon(params),
            provider=self.provider,
            key=idempotency_key,
            refused=anthropic.APIStatusError,
            lost=(anthropic.APIConnectionError,),
        )

    def stream(
        self, request: ModelRequest, *, idempotency_key: str
    ) -> AsyncIterator[StreamPart | ModelResponse]:
        """``complete()`` streamed: the parts as the API sends them, then the same answer.

        The message is assembled from its events (``message_start``, the content
        blocks' deltas, ``message_delta`` with the usage) into the body a plain call
        returns and parsed by the same parser.
        """
        import anthropic

        lost: tuple[type[Exception], ...] = (anthropic.APIError, *transport_errors(self.client))
        params = self._params(request) | {"stream": True}
        headers = request_headers(idempotency_key)

        async def open_stream() -> Any:
            return await self.client.messages.create(**params, extra_headers=headers)

        return streamed(
            open_stream,
            MessagesAssembler(),
            parse_message,
            quota=self.quota,
            policy=self.rate_limits,
            tokens=self.quota.reckon(params),
            provider=self.provider,
            key=idempotency_key,
            refused=anthropic.APIStatusError,
            lost=lost,
        )

    def _params(self, request: ModelRequest) -> dict[str, Any]:
        params: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "messages": anthropic_messages(request.messages),
        }
        if request.instructions:
            params["system"] = request.instructions
        if request.tools:
            params["tools"] = anthropic_tools(request.tools)
        return params | self.options

    def __repr__(self) -> str:
        return f"AnthropicGateway({self.model!r}, base_url={self.client.base_url!s})"


def _make_client(
    base_url: str | None, api_key: str | None, max_retries: int, timeout: float
) -> AsyncAnthropic:
    try:
        import anthropic
    except ImportError:
        raise sdk_missing("anthropic", "anthropic") from None
    try:
        client = anthropic.AsyncAnthropic(
            api_key=api_key, base_url=base_url, max_retries=max_retries, timeout=timeout
        )
    except anthropic.AnthropicError as exc:
        raise UsageError(f"cannot make the Anthropic client: {exc}") from exc
    if client.api_key is None and client.auth_token is None and client.credentials is None:
        # The SDK would only fail at the first request, with a TypeError.
        raise UsageError(
            "the Anthropic client has no credentials: set ANTHROPIC_API_KEY or pass api_key="
        )
    return client


def anthropic_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The conversation as Messages turns: text and tool_use blocks, grouped tool_result blocks."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": safe_id(m.tool_call_id),
                "content": m.content,
            }
            if out and out[-1].get("results"):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block], "results": True})
        elif m.role == "assistant":
            out.append({"role": "assistant", "content": _assistant_blocks(m)})
        else:
            out.append({"role": "user", "content": m.content})
    return [{k: v for k, v in turn.items() if k != "results"} for turn in out]


def _assistant_blocks(message: Message) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    blocks.extend(
        {"type": "tool_use", "id": safe_id(c.id), "name": c.name, "input": dict(c.arguments)}
        for c in message.tool_calls
    )
    return blocks


def safe_id(call_id: str) -> str:
    """A tool-use id the API accepts (letters, digits, ``_`` and ``-``), the same both ways."""
    return _UNSAFE_ID.sub("_", call_id)


def anthropic_tools(tools: Sequence[ToolSchema]) -> list[dict[str, Any]]:
    return [
        {"name": t.name, "description": t.description, "input_schema": dict(t.parameters)}
        for t in tools
    ]


def parse_message(
    body: Mapping[str, Any], *, provider: str, key: str, request_id: str | None
) -> ModelResponse:
    """A Messages answer as a ``ModelResponse``: its text blocks and tool_use blocks."""
    content = body.get("content")
    if not isinstance(content, list):
        raise invalid(provider, key, "the answer has no content list", request_id)
    texts: list[str] = []
    calls: list[ToolCall] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            calls.append(_tool_use(block, provider, key, request_id))
    if calls and body.get("stop_reason") == "max_tokens":
        detail = "a tool call was cut short by max_tokens; raise AnthropicGateway(max_tokens=...)"
        raise invalid(provider, key, detail, request_id)
    return ModelResponse(
        text="".join(texts),
        tool_calls=calls,
        usage=anthropic_usage(body.get("usage")),
        model=nonempty(body.get("model")) or "",
        request_id=request_id,
    )


def anthropic_usage(usage: Any) -> Usage:
    """Messages usage, with ``input_tokens`` made the whole input.

    Anthropic's ``input_tokens`` leaves out the tokens written to the prompt
    cache (``cache_creation_input_tokens``) and read from it
    (``cache_read_input_tokens``); both are added back and kept apart.
    """
    fresh, output, written, read = usage_fields(
        usage,
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    )
    return Usage(
        input_tokens=fresh + written + read,
        output_tokens=output,
        cached_input_tokens=read,
        cache_write_tokens=written,
    )


def _tool_use(block: dict[str, Any], provider: str, key: str, rid: str | None) -> ToolCall:
    if not isinstance(block.get("name"), str) or not block["name"]:
        raise invalid(provider, key, "a tool_use block has no name", rid)
    return tool_call(
        provider,
        key,
        rid,
        name=block["name"],
        raw=block.get("input", {}),
        call_id=nonempty(block.get("id")) or "",
    )
