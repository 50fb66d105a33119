"""Named crash points: no-ops in production, a SIGKILL when a test arms one.

A test arms a point in a child process with the environment variable
``ASIENTO_CRASH_AT=name`` (or ``name@N`` for its N-th passage); the child then
kills itself with SIGKILL exactly there, as a power cut or an OOM kill would.
"""

from __future__ import annotations

import os
import signal

CRASH_POINTS: tuple[str, ...] = (
    "before_intent",
    "after_prepare",
    "after_intent",
    "after_submitted",
    "inside_tool",
    "after_tool",
    "after_publish",
    "after_result",
    "inside_model_call",
    "after_model_result",
    "during_approval",
    "inside_commit",
)

ENV_VAR = "ASIENTO_CRASH_AT"

_state: dict[str, tuple[str, int] | None] = {"armed": None}
_seen: dict[str, int] = {}


def arm(spec: str | None) -> None:
    """Arm ``name`` or ``name@N`` in this process; ``None`` disarms."""
    _seen.clear()
    if not spec:
        _state["armed"] = None
        return
    name, _, nth = spec.partition("@")
    if name not in CRASH_POINTS:
        raise ValueError(f"unknown crash point {name!r}; known: {', '.join(CRASH_POINTS)}")
    _state["armed"] = (name, int(nth or 1))


def crash_point(name: str) -> None:
    """Die here with SIGKILL if this point is armed and its passage has come."""
    armed = _state["armed"]
    if armed is None or armed[0] != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] >= armed[1]:
        os.kill(os.getpid(), signal.SIGKILL)


arm(os.environ.get(ENV_VAR))
