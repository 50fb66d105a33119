"""asiento's 429 policy, the one home for it: every gateway's request goes through ``send``.

A 429 (the provider's rate limit) is not left to the SDK: ``take_429s`` marks
it ``x-should-retry: false`` on the SDK's HTTP client, so the SDK hands it over
at once (it still retries 408, 409, 5xx and lost connections, as before).
``send`` then waits, off the event loop's back, for what the provider asked
(``retry-after-ms``, else ``retry-after`` in seconds or as a date), or for an
exponential back-off when it said nothing, never longer than
``RateLimitPolicy.max_wait``, and sends the same request again: the same
idempotency key, the same body (the same parameters, serialised by the same
SDK). Every attempt takes its place in the ``Quota`` again. When
``RateLimitPolicy.retries`` retries are spent, ``RateLimited``.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from .. import shutdown
from ..errors import UsageError
from ..model import ModelResponse
from ..tools import check_count
from ._errors import RateLimited, rate_limited
from .quota import Quota, Reservation

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RateLimitPolicy:
    """How a gateway retries a 429: how many times, and how long it waits at most.

    ``retries`` (default 4) retries after the first 429; each waits what the
    provider's ``retry-after-ms`` / ``retry-after`` says, or ``backoff * 2**n``
    seconds (with jitter) when it says nothing, capped at ``max_wait`` seconds
    (default 60). ``retries=0``: the first 429 is ``RateLimited``.
    """

    retries: int = 4
    backoff: float = 1.0
    max_wait: float = 60.0

    def __post_init__(self) -> None:
        check_count(self.retries, "RateLimitPolicy(retries=...)", least=0)
        for name in ("backoff", "max_wait"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise UsageError(f"RateLimitPolicy({name}=...) must be seconds > 0, got {value!r}")

    def wait(self, retry: int, headers: Mapping[str, str]) -> float:
        """Seconds before retry number ``retry`` (0 = the first): the provider's word, capped."""
        asked = retry_after(headers)
        if asked is None:
            asked = self.backoff * 2**retry * (0.75 + random.random() / 4)  # jitter
        return min(max(asked, 0.0), self.max_wait)


@dataclass(frozen=True, slots=True)
class Sent(Generic[T]):
    """A request's answer, its place in the quota's windows, and the 429s it was retried for."""

    value: T
    reservation: Reservation
    rate_limited: int


async def send(
    attempt: Callable[[], Awaitable[T]],
    *,
    quota: Quota,
    policy: RateLimitPolicy,
    tokens: int,
    provider: str,
    key: str,
) -> Sent[T]:
    """``attempt()`` under the quota, again after each 429, until answered or retries spent."""
    async with holding(
        attempt, quota=quota, policy=policy, tokens=tokens, provider=provider, key=key
    ) as sent:
        return sent


@asynccontextmanager
async def holding(
    attempt: Callable[[], Awaitable[T]],
    *,
    quota: Quota,
    policy: RateLimitPolicy,
    tokens: int,
    provider: str,
    key: str,
) -> AsyncIterator[Sent[T]]:
    """``send``, keeping the quota's place for the body (a stream holds it while it is read)."""
    for retry in range(policy.retries + 1):
        async with quota.slot(tokens) as reservation:
            try:
                value = await attempt()
            except Exception as exc:
                headers = _rate_limit_headers(exc)
                if headers is None:
                    raise
                reservation.refund()
                if retry == policy.retries:
                    raise _exhausted(provider, key, exc, retry) from exc
            else:
                yield Sent(value, reservation, retry)
                return
        pause = asyncio.sleep(policy.wait(retry, headers))
        await shutdown.before_stop(pause, "waiting to retry a 429 (the provider refused it)")
    raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover


def settled(response: ModelResponse, sent: Sent[Any]) -> ModelResponse:
    """The answer with its 429 retries counted, its quota tokens corrected to its usage."""
    sent.reservation.settle(response.usage.input_tokens + response.usage.output_tokens)
    return replace(response, rate_limited=sent.rate_limited) if sent.rate_limited else response


def take_429s(client: Any) -> None:
    """Have the SDK's HTTP client hand each 429 to ``send`` rather than retry it itself.

    The official SDKs obey a response's ``x-should-retry`` header; the hook sets
    it on 429s only. An SDK client without an httpx client keeps retrying 429s
    itself first; ``send`` still retries after it.
    """
    http = getattr(client, "_client", None)
    hooks = getattr(http, "event_hooks", None)
    if not isinstance(hooks, Mapping) or _mark_429 in hooks.get("response", ()):
        return
    http.event_hooks = {**hooks, "response": [*hooks.get("response", ()), _mark_429]}  # type: ignore[union-attr]


async def _mark_429(response: Any) -> None:
    if response.status_code == 429:
        response.headers["x-should-retry"] = "false"


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds the provider asked to wait: ``retry-after-ms``, else ``retry-after``."""
    ms = _number(headers.get("retry-after-ms"))
    if ms is not None:
        return ms / 1000
    value = headers.get("retry-after")
    seconds = _number(value)
    if seconds is not None or value is None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return when.timestamp() - time.time()


def _number(value: str | None) -> float | None:
    try:
        number = float(value) if value is not None else None
    except ValueError:
        return None
    return number if number is not None and number >= 0 and math.isfinite(number) else None


def _rate_limit_headers(exc: Exception) -> Mapping[str, str] | None:
    """The answer's headers when ``exc`` is an SDK's 429 (either SDK), else None."""
    if getattr(exc, "status_code", None) != 429:
        return None
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    return headers if isinstance(headers, Mapping) else {}


def _exhausted(provider: str, key: str, exc: Exception, retries: int) -> RateLimited:
    message = str(getattr(exc, "message", exc))
    return rate_limited(provider, key, message, retries, getattr(exc, "request_id", None))
