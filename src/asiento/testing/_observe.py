"""Watching crash points in the harness's child: count passages, kill, pause, cut.

The core's ``crash_point(name)`` only knows one thing: SIGKILL at an armed
passage. The harness needs more from the same points (count every passage
in a dry run; at a chosen passage, SIGKILL, or cut the database connection),
so the child rebinds every module-level name bound to the core's function to
an ``Observer`` that does all of that. Rebinding (rather than editing the core)
reaches the modules that did ``from asiento.testing import crash_point``
before the harness started, user modules included; it is done once, in the
child only, after the user's app module is imported.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from collections.abc import Callable

from .. import _crash

Hook = Callable[[], None]


class Observer:
    """Counts every crash-point passage; acts at the chosen ones."""

    def __init__(self) -> None:
        self.passages: Counter[str] = Counter()
        self.kill_at: tuple[str, int] | None = None
        self.hooks: dict[tuple[str, int], Hook] = {}

    def reset(self, kill_at: str | None = None) -> None:
        """Forget the counts; arm ``name@N`` (or ``name``) to SIGKILL this process there."""
        self.passages.clear()
        self.hooks.clear()
        self.kill_at = None if not kill_at else parse_spec(kill_at)

    def __call__(self, name: str) -> None:
        self.passages[name] += 1
        here = (name, self.passages[name])
        hook = self.hooks.pop(here, None)
        if hook is not None:
            hook()
        if self.kill_at == here:
            os.kill(os.getpid(), signal.SIGKILL)


def parse_spec(spec: str) -> tuple[str, int]:
    """``name@N`` (or ``name``, the first passage) as (name, N); unknown names are refused."""
    name, _, nth = spec.partition("@")
    if name not in _crash.CRASH_POINTS:
        raise ValueError(f"unknown crash point {name!r}; known: {', '.join(_crash.CRASH_POINTS)}")
    return name, int(nth or 1)


def install(observer: Observer) -> int:
    """Rebind every module attribute bound to the core's ``crash_point``; how many."""
    original = _crash.crash_point
    _crash.arm(None)  # the environment variable must not kill the child behind our back
    rebound = 0
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", {})
        for attr, value in list(names.items()):
            if value is original:
                setattr(module, attr, observer)
                rebound += 1
    return rebound
