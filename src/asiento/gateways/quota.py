"""``Quota``: limits on a provider that every gateway given the same object shares.

Gateways are made per run by factories; a ``Quota`` made once and passed to each
of them caps the requests in flight across all runs of the process. asyncio
primitives belong to one event loop, so the semaphore is kept per loop.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ..errors import UsageError


class Quota:
    """How many requests may be in flight at once (``None``: no cap, today's behaviour)."""

    def __init__(self, max_concurrent: int | None = None) -> None:
        if max_concurrent is not None and (
            not isinstance(max_concurrent, int)
            or isinstance(max_concurrent, bool)
            or max_concurrent < 1
        ):
            raise UsageError(
                f"Quota(max_concurrent=...) must be None or an int >= 1, got {max_concurrent!r}"
            )
        self.max_concurrent = max_concurrent
        self._semaphores: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, asyncio.Semaphore
        ] = weakref.WeakKeyDictionary()

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the ``max_concurrent`` places for the duration of one request."""
        if self.max_concurrent is None:
            yield
            return
        loop = asyncio.get_running_loop()
        semaphore = self._semaphores.get(loop)
        if semaphore is None:
            semaphore = self._semaphores[loop] = asyncio.Semaphore(self.max_concurrent)
        async with semaphore:
            yield

    def __repr__(self) -> str:
        return f"Quota(max_concurrent={self.max_concurrent!r})"
