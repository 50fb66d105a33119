"""Streamed requests without a key: passed through to upstream, never claimed or kept.

With no key there is nothing to deduplicate by (keyed streams are recorded: see
``_recording``). Such a stream takes no claim, so it can leave no claim behind,
and its events reach the client as upstream sends them. Every such response
says so with ``Asiento-Gateway: passthrough-stream``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping

import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

PASSTHROUGH_HEADER = "asiento-gateway"
PASSTHROUGH = "passthrough-stream"


def wants_stream(body: bytes) -> bool:
    """Whether the request asks for a stream (a JSON object with ``"stream": true``)."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(parsed, dict) and parsed.get("stream") is True


class PassedThrough(StreamingResponse):
    """Upstream's answer relayed as it arrives; upstream is closed however the relay ends."""

    def __init__(
        self,
        upstream: httpx.Response,
        dropped: frozenset[str],
        *,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        headers = _kept(upstream.headers, dropped) | {PASSTHROUGH_HEADER: PASSTHROUGH}
        super().__init__(upstream.aiter_bytes(), upstream.status_code, headers=headers)
        self._upstream, self._on_close = upstream, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A client that goes away ends the relay; closing the stream tells upstream.
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._upstream.aclose()
            finally:
                if self._on_close is not None:
                    await self._on_close()  # the quota's place in flight is given back


def _kept(headers: Mapping[str, str], dropped: frozenset[str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in dropped}
