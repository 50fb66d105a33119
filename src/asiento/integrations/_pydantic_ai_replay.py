"""Pydantic AI's own telemetry of a durable run: nothing again for what the journal replays.

Pydantic AI's instrumentation (``capabilities=[Instrumentation(...)]``, ``agent.instrument``,
``Agent.instrument_all()``, an ``InstrumentedModel``) opens a ``chat {model}`` span around
every model request and an ``execute_tool {tool}`` span around every tool call *before*
asiento's wrapped model and toolsets are reached, so a resumed pass that replays five
answers emitted five more ``chat`` spans, their token metrics too (pydantic-ai#6974).
Pydantic AI has the answer for durable engines (``pydantic_ai.durable_exec``): a run inside
``replay_scope()`` whose durable units each say whether they ran
(``record_durable_unit(executed=...)``); a span that covered only replayed units is never
ended, so never exported, and a replayed request's metrics are skipped.

Here: each pass's ``agent.run`` is in a ``replay_scope``; a model step reports itself
executed (asked and paid) or replayed (the journal's answer), and a tool step executed (it
ran, or was reconciled with its server) or replayed (its recorded outcome fed back); and
``PassRun`` reports one executed unit in the run's own span, so each pass keeps its
``invoke_agent`` span even when it only replayed (it stopped at an approval again, or at an
uncertain step). A Pydantic AI without ``replay_scope`` (before it had one) gets none of
this: every span is emitted, as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from pydantic_ai.models import Model
from pydantic_ai.models.instrumented import InstrumentedModel

try:
    from pydantic_ai.capabilities import AbstractCapability, Instrumentation
    from pydantic_ai.durable_exec import record_durable_unit, replay_scope
except ImportError:  # pragma: no cover - a Pydantic AI without durable replay telemetry
    _record: Callable[..., None] | None = None
    _scope: Callable[[], contextlib.AbstractContextManager[None]] | None = None
    _Capability: Any = None
else:
    _record, _scope, _Capability = record_durable_unit, replay_scope, AbstractCapability

__all__ = ["replayed_scope", "uninstrumented", "unit"]


def unit(*, executed: bool) -> None:
    """A step of the pass ended: it ran (``executed``) or the journal answered for it."""
    if _record is not None:
        _record(executed=executed)


@contextlib.contextmanager
def replayed_scope() -> Iterator[None]:
    """Pydantic AI's spans and metrics of what is replayed inside are not reported."""
    if _scope is None:
        yield
        return
    with _scope():
        yield


def uninstrumented(model: Model) -> tuple[Model, list[Any]]:
    """``model`` without an ``InstrumentedModel`` around it, and the run capabilities
    that instrument the pass as Pydantic AI would have: the agent unwraps an
    ``InstrumentedModel`` into its ``Instrumentation`` capability, but it sees asiento's
    journaled model, so a wrapped one would give a ``chat`` span for each paid request
    and no run or tool span at all. Then each ``agent.run`` of the pass keeps its run span
    (a Pydantic AI without replay telemetry: ``model`` as it is, and none)."""
    if _Capability is None:
        return model, []
    capabilities: list[Any] = []
    if isinstance(model, InstrumentedModel):
        capabilities.append(Instrumentation(settings=model.instrumentation_settings))
        model = model.wrapped
    capabilities.append(_PassRun())
    return model, capabilities


if _Capability is not None:

    class _PassRun(_Capability):  # type: ignore[misc]
        """Inside the run span (Pydantic AI's ``Instrumentation`` is the outermost layer):
        a pass is a real run of the agent, its span is reported even if every step in it
        was replayed. It adds nothing to the requests (no instructions, tools, settings)."""

        async def wrap_run(self, ctx: Any, *, handler: Any) -> Any:
            unit(executed=True)
            return await handler()
