"""What the harness wraps around a user's agent in the child, to witness it from outside.

- each plain tool appends an fsynced line to the run's effect ledger (run,
  step, attempt, tool, idempotent, pid, and the time it started: ``at``) and
  passes ``inside_tool`` before the user's function runs: the line *is* the
  effect, as far as the oracle knows, so a line is never missing for an effect
  that happened;
- each effect (``Effect`` subclass) does the same before ``publish``;
- the gateway appends a line (run, idempotency key, pid) before every request:
  one line per billable generation, as the model server would count them.

The tools' schemas are untouched, so the request fingerprints do not change.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import _crash
from ..agent import Agent
from ..context import current_step
from ..effects.base import Effect, Published
from ..errors import UsageError
from ..model import Gateway, ModelRequest, ModelResponse
from ..tools import Tool
from ._files import append_line


def instrument(agent: Agent, effects: Path) -> Agent:
    """A copy of ``agent`` whose tools write the effect ledger."""
    tools = [_ledgered(t, effects) for t in agent.tools.values()]
    return Agent(
        instructions=agent.instructions,
        tools=tools,
        policy=agent.policy,
        max_turns=agent.max_turns,
    )


def _note(effects: Path, tool: Tool, kind: str) -> None:
    step = current_step()
    if step is None:  # called outside the loop (by another tool): not a step's effect
        return
    line = {
        "run": step.run_id,
        "step": step.step_id,
        "attempt": step.attempt_id,
        "tool": tool.name,
        "idempotent": tool.idempotent,
        "kind": kind,
        "pid": os.getpid(),
        "at": time.time(),
    }
    append_line(effects, line)
    _crash.crash_point("inside_tool")


def _ledgered(tool: Tool, effects: Path) -> Tool:
    if tool.effect is not None:
        return dataclasses.replace(tool, effect=_ledgered_effect(tool, tool.effect, effects))
    fn = tool.fn
    wrapped: Callable[..., Any]
    if inspect.iscoroutinefunction(fn):

        async def call_async(**kwargs: Any) -> Any:
            _note(effects, tool, "call")
            return await fn(**kwargs)

        wrapped = call_async
    else:

        def call(**kwargs: Any) -> Any:
            _note(effects, tool, "call")
            return fn(**kwargs)

        wrapped = call
    return dataclasses.replace(tool, fn=wrapped)


def _ledgered_effect(tool: Tool, effect: Effect, effects: Path) -> Effect:
    """The same effect object, whose ``publish`` first writes the ledger line."""
    base = type(effect)

    async def publish(self: Effect, payload: Any, idem_key: str) -> Published:
        _note(effects, tool, "publish")
        result: Published = await base.publish(self, payload, idem_key)
        return result

    cls = type(base.__name__, (base,), {"publish": publish, "__module__": base.__module__})
    clone = copy.copy(effect)
    try:
        clone.__class__ = cls
    except TypeError as exc:
        raise UsageError(
            f"the crash harness cannot watch effect {base.__name__} ({exc}); "
            "effects with __slots__ are not supported"
        ) from exc
    return clone


class LedgerGateway:
    """The user's gateway, with one fsynced ledger line per request before it is sent.

    ``pause_at`` (the N-th request of this pass) stops the process with SIGSTOP
    right after the line, having written its pid to ``pause_file``: the lease
    race holds a driver there while another one takes the run over.
    """

    def __init__(
        self,
        inner: Gateway,
        models: Path,
        run_id: str,
        *,
        pause_at: int | None = None,
        pause_file: str | None = None,
    ) -> None:
        self.inner, self.models, self.run_id = inner, models, run_id
        self.pause_at, self.pause_file = pause_at, pause_file
        self.requests = 0

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        self.requests += 1
        line = {"run": self.run_id, "key": idempotency_key, "pid": os.getpid()}
        append_line(self.models, line)
        if self.requests == self.pause_at and self.pause_file:
            stop_here(Path(self.pause_file))
        return await self.inner.complete(request, idempotency_key=idempotency_key)


def stop_here(marker: Path) -> None:
    """Write this process's pid to ``marker``, then stop with SIGSTOP until continued."""
    marker.with_suffix(".tmp").write_text(str(os.getpid()))
    os.replace(marker.with_suffix(".tmp"), marker)  # the parent never reads half of it
    os.kill(os.getpid(), signal.SIGSTOP)
