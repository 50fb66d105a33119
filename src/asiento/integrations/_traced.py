"""A framework's pass, traced as a native one is (docs/observability.md).

``traced_pass`` drives the pass's ``PassTrace`` (``tracing.for_pass``) around the
framework's run: the run's trace context taken from the journal (or recorded there, on
the run's first pass, from the caller's span if there is one), the pass's
``invoke_agent`` span opened before any step and set as the current OpenTelemetry
context while the framework runs, and ended saying how the pass left the run. The
pass's steps add their ``chat`` and ``execute_tool`` spans through the same
``PassTrace``; a closed run's pass ends its span in the final commit
(``PassTrace.end``), as a native one does.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from ..events import Lease, StepEvent
from ..session import Session
from ..telemetry import tracing


@dataclass(slots=True)
class Traced:
    """The pass's trace, and how the pass left the run when it returned (not raised)."""

    trace: tracing.PassTrace | tracing.Off
    status: str = "stopped"


@contextlib.asynccontextmanager
async def traced_pass(
    config: tracing.Telemetry | None,
    agent: str,
    session: Session,
    lease: Lease,
    events: Sequence[StepEvent],
) -> AsyncIterator[Traced]:
    """The pass under ``lease``, traced (``config`` None: ``tracing.OFF``, nothing written);
    ``events``: the run's journal as the pass loaded it."""
    traced = Traced(tracing.for_pass(config, agent, session, lease))
    trace, error = traced.trace, None
    if not trace.on:
        yield traced
        return
    await trace.open(events, session.store, lease)
    try:
        with trace.current():
            yield traced
    except BaseException as exc:
        traced.status, error = tracing.status_of(exc), exc
        raise
    finally:
        await trace.close(traced.status, error, session.store, lease)
