"""An HTTP effect over httpx that sends ``Idempotency-Key`` and keeps the body frozen."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import httpx

from .._canonical import key_header
from .base import Effect, EffectRejected, IdempotencyKeyConflict, Published

_TRANSIENT = frozenset({408, 409, 425, 429})


class HttpEffect(Effect):
    """POST the frozen payload to ``url`` with the step's idempotency key.

    Subclass it and define ``prepare`` (its signature is the tool's schema; it
    returns the JSON body). Transient failures (network errors, 408, 409 in
    flight, 425, 429, 5xx) are retried with the same key and the same body
    (with ``honours_keys = False`` only a refused connection and a 429 are
    retried: anything else may have been applied); a
    key reused with other parameters (Stripe's 400 ``idempotency_error``, or a 422
    that names the idempotency key, as in the IETF draft) raises
    ``IdempotencyKeyConflict``; any other 4xx is a refusal, recorded as
    the step's failure. When retries run out the error propagates and the step
    stays submitted, to be reconciled on resume.
    """

    honours_keys: ClassVar[bool] = True
    key_ttl: ClassVar[float | None] = 24 * 3600.0
    method: ClassVar[str] = "POST"
    remote_id_field: ClassVar[str] = "id"
    max_attempts: ClassVar[int] = 4
    backoff: ClassVar[float] = 0.1

    def __init__(
        self, url: str, *, client: httpx.AsyncClient | None = None, timeout: float = 10.0
    ) -> None:
        self.url = url
        self._client = client
        self._timeout = timeout

    async def publish(self, payload: Any, idem_key: str) -> Published:
        headers = key_header(idem_key)
        async with self._session() as client:
            for attempt in range(1, self.max_attempts + 1):
                last = attempt == self.max_attempts
                try:
                    response = await client.request(
                        self.method, self.url, json=payload, headers=headers
                    )
                except httpx.TransportError as exc:
                    if last or not self._may_retry_error(exc):
                        raise
                else:
                    if last or not self._may_retry(response):
                        return self._answer(response, idem_key)
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
        raise AssertionError("unreachable: the last attempt returns or raises")

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[httpx.AsyncClient]:
        """The user's client (never closed by us), or one of our own for this publish."""
        if self._client is not None:
            yield self._client
            return
        async with httpx.AsyncClient(timeout=self._timeout) as client:
            yield client

    @staticmethod
    def _transient(response: httpx.Response) -> bool:
        return response.status_code in _TRANSIENT or response.status_code >= 500

    def _may_retry(self, response: httpx.Response) -> bool:
        """A transient answer is retried under a key; without keys only a plain 429 is."""
        if self.honours_keys:
            return self._transient(response)
        return response.status_code == 429

    def _may_retry_error(self, exc: httpx.TransportError) -> bool:
        """Without keys, only a request that never reached the server is sent again.

        A lost answer may hide an applied effect: the step stays submitted and the
        lookup decides on resume.
        """
        return self.honours_keys or isinstance(exc, httpx.ConnectError)

    def _answer(self, response: httpx.Response, idem_key: str) -> Published:
        if self.key_conflict(response):
            raise IdempotencyKeyConflict(
                f"{self.url} refused idempotency key {idem_key!r}: it was used with other "
                f"parameters ({response.status_code}: {response.text[:200]})"
            )
        if self._transient(response):
            response.raise_for_status()
        if response.is_client_error:
            raise EffectRejected(
                f"{self.url} answered {response.status_code}: {response.text[:500]}"
            )
        response.raise_for_status()
        return self.published(response)

    def key_conflict(self, response: httpx.Response) -> bool:
        """Whether the destination says the key was reused with different parameters.

        Stripe answers 400 with an ``idempotency_error``; the IETF Idempotency-Key
        draft answers 422 with a problem that names the key. A 422 that does not
        mention idempotency is an ordinary validation refusal (FastAPI's, Rails'),
        recorded as the step's failure. Override this for other destinations.
        """
        if response.status_code == 422:
            return "idempoten" in response.text.lower()
        if response.status_code != 400:
            return False
        try:
            error = response.json().get("error", {})
        except ValueError:
            return False
        return isinstance(error, dict) and error.get("type") == "idempotency_error"

    def published(self, response: httpx.Response) -> Published:
        """The remote id and result from a successful answer."""
        data = response.json()
        remote_id = data.get(self.remote_id_field) if isinstance(data, dict) else None
        return Published(remote_id=None if remote_id is None else str(remote_id), result=data)
