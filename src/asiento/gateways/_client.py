"""What the SDK gateways share: closing the client they made, as async context managers,
and the headers every request of a step carries."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, Self

from .._canonical import key_header
from ..telemetry.tracing import step_traceparent


def request_headers(idempotency_key: str) -> dict[str, str]:
    """The step's ``Idempotency-Key`` and, in a traced run, its W3C trace context
    (``traceparent``, ``tracestate``: the ``chat`` span as the request's parent)."""
    headers = key_header(idempotency_key)
    traced = step_traceparent()
    if traced:
        headers.update(traced)
    return headers


class OwnedClient:
    """Closes ``self.client`` on ``aclose()`` when the gateway made it (not when it was given)."""

    client: Any
    _owned: bool

    async def aclose(self) -> None:
        """Close the SDK client if this gateway made it."""
        if self._owned:
            await self.client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def transport_errors(client: Any) -> tuple[type[Exception], ...]:
    """The HTTP library's errors under an SDK client: httpx's, and those of the library its
    own HTTP client comes from (newer SDKs use ``httpx2``). A stream cut mid-way raises
    them as they are: the SDK wraps only the errors of sending the request."""
    import httpx  # here: importing asiento loads no HTTP library

    errors: list[type[Exception]] = [httpx.HTTPError]
    for cls in type(getattr(client, "_client", None)).__mro__:
        module = sys.modules.get(cls.__module__.partition(".")[0])
        extra = getattr(module, "HTTPError", None)
        if isinstance(extra, type) and issubclass(extra, Exception) and extra not in errors:
            errors.append(extra)
    return tuple(errors)
