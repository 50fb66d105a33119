"""What users need to test their own agents: a scripted model, crash points, a crash harness.

``CrashHarness`` (see ``asiento.testing.harness``) kills a user's agent with
SIGKILL at every crash point and at random instants, resumes it, and checks
the invariants of ``asiento.testing.invariants`` from outside the process.
``asiento.testing.conformance`` is the journal conformance suite a backend of
your own runs under pytest (it imports pytest, so it is not imported here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._crash import CRASH_POINTS, ENV_VAR, arm, crash_point
from ..gateways.scripted import ScriptedGateway, StreamingScriptedGateway

if TYPE_CHECKING:
    from .harness import CrashHarness
    from .invariants import Violation
    from .report import CampaignFailed, Report

__all__ = [
    "CRASH_POINTS",
    "ENV_VAR",
    "CampaignFailed",
    "CrashHarness",
    "Report",
    "ScriptedGateway",
    "StreamingScriptedGateway",
    "Violation",
    "arm",
    "crash_point",
]

_LAZY = {
    "CrashHarness": "harness",
    "Report": "report",
    "CampaignFailed": "report",
    "Violation": "invariants",
}


def __getattr__(name: str) -> object:
    """The harness is imported on first use: a test that only scripts a model stays light."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
