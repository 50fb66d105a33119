"""``Quota``: limits on a provider that every gateway given the same object shares.

Gateways are made per run by factories; a ``Quota`` made once and passed to each
of them caps, across all runs of the process, the requests in flight
(``max_concurrent``), the requests started per minute (``requests_per_minute``)
and the tokens per minute (``tokens_per_minute``). All default to ``None``: off.

The per-minute limits are counted over a sliding ``window`` (60 s by default):
at most ``requests_per_minute * window / 60`` requests start in any ``window``
seconds. A request's tokens are not known before it is answered, so it reserves
an estimate (``estimate_tokens``: its body's characters / 4, plus the most
output tokens it allows) and the reservation is corrected to the usage the
provider reports once it answers; a 429 gives its tokens back (the provider
did not process it). A request waits on the event loop (``asyncio.sleep``),
never blocking it; waiters are served in arrival order; a waiter cancelled
before it is admitted has taken nothing, and a shutdown request ends every wait
with ``ShutdownRequested`` (a waiter has sent nothing: its run stops before the
step, resumable).

asyncio primitives belong to one event loop, so the semaphore and the queue of
waiters are kept per loop; the windows are shared by every loop of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from .. import shutdown
from ..errors import UsageError
from ..telemetry import metrics

#: The request fields that bound a model's output tokens (Anthropic, Chat Completions, Responses).
OUTPUT_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
CHARS_PER_TOKEN = 4
_WAITING = "waiting in a Quota (nothing was sent)"


def estimate_tokens(params: Mapping[str, Any]) -> int:
    """What a request is reckoned to cost before it is sent: input plus the most output.

    Input: the characters of its JSON body / 4 (what providers' own rate limiters
    reckon). Output: the largest of ``max_tokens``, ``max_completion_tokens`` and
    ``max_output_tokens`` it sets, 0 when it sets none (then only the input is
    reserved, and the reservation grows to the real usage after the answer).
    """
    text = json.dumps(params, ensure_ascii=False, default=str)
    limits = [v for k in OUTPUT_LIMIT_FIELDS if isinstance(v := params.get(k), int)]
    return -(-len(text) // CHARS_PER_TOKEN) + max(limits, default=0)


class Reservation:
    """What one admitted request holds in the windows: corrected once it is answered."""

    __slots__ = ("_entry", "_quota")

    def __init__(self, entry: list[float] | None, quota: Quota) -> None:
        self._entry, self._quota = entry, quota

    def settle(self, tokens: int) -> None:
        """The request really cost ``tokens`` (its usage): hold that instead of the estimate."""
        if self._entry is None:
            return
        with self._quota._lock:
            freed = self._entry[1] > tokens
            self._entry[1] = max(tokens, 0)
        if freed:
            self._quota._wake()

    def refund(self) -> None:
        """The provider refused the request (429): its tokens are given back."""
        self.settle(0)


class _Window:
    """A sliding window of ``seconds``: when each admitted request started and its tokens."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.entries: deque[list[float]] = deque()  # [started (monotonic), tokens]

    def wait(self, now: float, requests: float | None, tokens: float | None, need: int) -> float:
        """Seconds until a request of ``need`` tokens fits (0: now); forgets what left."""
        while self.entries and self.entries[0][0] <= now - self.seconds:
            self.entries.popleft()
        if not self.entries:
            return 0.0  # an empty window admits anything, even one request over the limit
        if requests is not None and len(self.entries) + 1 > requests:
            return self._until_left(now)
        if tokens is not None and sum(e[1] for e in self.entries) + need > tokens:
            return self._until_left(now)
        return 0.0

    def _until_left(self, now: float) -> float:
        return max(self.entries[0][0] + self.seconds - now, 0.001)


class Quota:
    """Limits shared by every gateway given this object (``None``: no limit, the default).

    ``max_concurrent``: requests in flight at once. ``requests_per_minute`` and
    ``tokens_per_minute``: started per minute, counted over ``window`` seconds
    (at the same rate: ``requests_per_minute=600, window=1`` admits 10 a second).
    """

    def __init__(
        self,
        max_concurrent: int | None = None,
        *,
        requests_per_minute: int | None = None,
        tokens_per_minute: int | None = None,
        window: float = 60.0,
    ) -> None:
        self.max_concurrent = _limit("max_concurrent", max_concurrent)
        self.requests_per_minute = _limit("requests_per_minute", requests_per_minute)
        self.tokens_per_minute = _limit("tokens_per_minute", tokens_per_minute)
        if isinstance(window, bool) or not isinstance(window, int | float) or not window > 0:
            raise UsageError(f"Quota(window=...) must be a number of seconds > 0, got {window!r}")
        self.window = float(window)
        self._share = self.window / 60.0
        self._state = _Window(self.window)
        self._lock = threading.Lock()  # the windows are shared by the loops of every thread
        self._semaphores: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, asyncio.Semaphore
        ] = weakref.WeakKeyDictionary()
        self._queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self._wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Event] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def limits_rate(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    def reckon(self, params: Mapping[str, Any]) -> int:
        """The tokens a request reserves: ``estimate_tokens``, or 0 when tokens are not limited."""
        return 0 if self.tokens_per_minute is None else estimate_tokens(params)

    @asynccontextmanager
    async def slot(self, tokens: int = 0) -> AsyncIterator[Reservation]:
        """Hold a place in flight and, once one is free, a start in the windows.

        The place in flight is taken first, so a request is counted in the windows
        when it is about to be sent, not while it waits for a place.
        """
        loop = asyncio.get_running_loop()
        asked = time.monotonic()
        if self.max_concurrent is None:
            admitted = await self._admit(loop, tokens)
            self._waited(asked)
            yield admitted
            return
        semaphore = self._semaphores.get(loop)
        if semaphore is None:
            semaphore = self._semaphores[loop] = asyncio.Semaphore(self.max_concurrent)
        await _take(semaphore)
        try:
            admitted = await self._admit(loop, tokens)
            self._waited(asked)
            yield admitted
        finally:
            semaphore.release()

    def _waited(self, asked: float) -> None:
        """A request was admitted: its wait goes to ``asiento.quota.wait`` (when it limits)."""
        if self.max_concurrent is not None or self.limits_rate:
            metrics.quota_waited(time.monotonic() - asked)

    async def _admit(self, loop: asyncio.AbstractEventLoop, tokens: int) -> Reservation:
        """Wait (first come, first served) until the windows have room; nothing held till then."""
        if not self.limits_rate:
            return Reservation(None, self)
        queue = self._queues.get(loop)
        if queue is None:
            queue = self._queues[loop] = asyncio.Lock()
            self._wakers[loop] = asyncio.Event()
        woken = self._wakers[loop]
        await _take(queue)
        try:
            while True:
                admitted = self._try_admit(tokens)
                if not isinstance(admitted, float):
                    return Reservation(admitted, self)
                woken.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(admitted):  # or sooner, when tokens come back
                        await shutdown.before_stop(woken.wait(), _WAITING)
        finally:
            queue.release()

    def _try_admit(self, tokens: int) -> list[float] | float:
        """The request's entry once admitted (appended to the window), else seconds to wait."""
        rpm, tpm = self.requests_per_minute, self.tokens_per_minute
        with self._lock:
            now = time.monotonic()
            delay = self._state.wait(
                now,
                None if rpm is None else rpm * self._share,
                None if tpm is None else tpm * self._share,
                tokens,
            )
            if delay > 0:
                return delay
            entry = [now, float(tokens)]
            self._state.entries.append(entry)
            return entry

    def _wake(self) -> None:
        """Tell the first waiter of every loop that tokens were given back (any thread)."""
        for loop, woken in list(self._wakers.items()):
            with contextlib.suppress(RuntimeError):  # a loop closed meanwhile
                loop.call_soon_threadsafe(woken.set)

    def __repr__(self) -> str:
        return (
            f"Quota(max_concurrent={self.max_concurrent!r}, "
            f"requests_per_minute={self.requests_per_minute!r}, "
            f"tokens_per_minute={self.tokens_per_minute!r}, window={self.window:g})"
        )


async def _take(place: asyncio.Semaphore | asyncio.Lock) -> None:
    """Acquire ``place``; a wait for it (nothing sent yet) ends on a shutdown request."""
    if place.locked():
        await shutdown.before_stop(place.acquire(), _WAITING)
    else:
        await place.acquire()  # free: no task made to watch for a shutdown


def _limit(name: str, value: int | None) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise UsageError(f"Quota({name}=...) must be None or an int >= 1, got {value!r}")
    return value
