"""Graceful shutdown: SIGTERM lets the step in flight finish, then the run stops.

``install()`` makes SIGTERM and SIGINT request a stop instead of killing the
process mid-step. The loop checks the request only between steps: a tool that
started finishes its publish and its confirm, nothing new starts, the lease is
released, and ``run()`` raises ``ShutdownRequested``. The run stays resumable.
Processes that stop this way should exit with ``EXIT_CODE`` (75, EX_TEMPFAIL:
"try again later"), as the ``asiento`` commands do. A worker waits for its steps
in flight at most ``App.shutdown_grace`` seconds from the request (``grace_left``),
then cuts them: a step that never returns never keeps a stopping worker alive.

A wait that has started nothing (a place in a ``Quota``, the pause before a 429's
retry) is not a step in flight: ``before_stop`` ends it at once on a request, so
a process under a tight quota still stops in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
import weakref
from collections.abc import Awaitable
from types import FrameType
from typing import TypeVar

from .errors import RunError

EXIT_CODE = 75

T = TypeVar("T")

_requested = threading.Event()
_requested_at: list[float] = []  # time.monotonic() of the first request, once made
# Per event loop, an asyncio twin of ``_requested`` for the waits of ``before_stop``.
_stops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Event] = (
    weakref.WeakKeyDictionary()
)
_stops_lock = threading.Lock()


class ShutdownRequested(RunError):
    """The run stopped between two steps because a shutdown was requested; resume it later."""


def install(signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Turn ``signals`` into stop requests (main thread only, as Python requires)."""
    for sig in signals:
        signal.signal(sig, _on_signal)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    request()


def request() -> None:
    """Ask every run in this process to stop at its next step boundary."""
    if not _requested_at:
        _requested_at.append(time.monotonic())
    _requested.set()
    with _stops_lock:
        stops = list(_stops.items())
    for loop, stop in stops:
        with contextlib.suppress(RuntimeError):  # a loop closed meanwhile
            loop.call_soon_threadsafe(stop.set)


async def before_stop(waiting: Awaitable[T], doing: str) -> T:
    """``waiting``'s result, unless a shutdown is requested first: then it is cancelled
    and ``ShutdownRequested`` raised. Only for waits that started nothing (``doing``
    says which, for the error): whoever waits has sent nothing and holds nothing."""
    task = asyncio.ensure_future(waiting)
    if requested():
        task.cancel()
        raise ShutdownRequested(f"a shutdown was requested while {doing}")
    loop = asyncio.get_running_loop()
    with _stops_lock:
        stop = _stops.get(loop)
        if stop is None:
            stop = _stops[loop] = asyncio.Event()
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ShutdownRequested(f"a shutdown was requested while {doing}")
    return task.result()  # done first, or together with the request: it holds its result


def requested() -> bool:
    return _requested.is_set()


def grace_left(grace: float) -> float | None:
    """Seconds left of a ``grace`` that began at the shutdown request; None if none."""
    if not _requested_at or not _requested.is_set():
        return None
    return grace - (time.monotonic() - _requested_at[0])


def reset() -> None:
    """Forget a previous request (tests, or a process that goes on after a stop)."""
    _requested.clear()
    _requested_at.clear()
    with _stops_lock:
        for stop in _stops.values():
            stop.clear()  # a flag, waking nobody: safe from any thread
