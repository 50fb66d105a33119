"""Graceful shutdown: SIGTERM lets the step in flight finish, then the run stops.

``install()`` makes SIGTERM and SIGINT request a stop instead of killing the
process mid-step. The loop checks the request only between steps: a tool that
started finishes its publish and its confirm, nothing new starts, the lease is
released, and ``run()`` raises ``ShutdownRequested``. The run stays resumable.
Processes that stop this way should exit with ``EXIT_CODE`` (75, EX_TEMPFAIL:
"try again later"), as the ``asiento`` commands do.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from .errors import RunError

EXIT_CODE = 75

_requested = threading.Event()


class ShutdownRequested(RunError):
    """The run stopped between two steps because a shutdown was requested; resume it later."""


def install(signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Turn ``signals`` into stop requests (main thread only, as Python requires)."""
    for sig in signals:
        signal.signal(sig, _on_signal)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _requested.set()


def request() -> None:
    """Ask every run in this process to stop at its next step boundary."""
    _requested.set()


def requested() -> bool:
    return _requested.is_set()


def reset() -> None:
    """Forget a previous request (tests, or a process that goes on after a stop)."""
    _requested.clear()
