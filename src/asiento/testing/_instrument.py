"""What the harness wraps around a user's agent in the child, to witness it from outside.

- each tool step appends an fsynced line to the run's effect ledger (run,
  step, attempt, tool, idempotent, pid, and the time it started: ``at``) and
  passes ``inside_tool`` before its runner executes it (a plain function's
  call, an effect's publish, any other kind's): the line *is* the effect, as far
  as the oracle knows, so a line is never missing for an effect that happened;
- the gateway appends a line (run, idempotency key, pid) before every request:
  one line per billable generation, as the model server would count them.

The tools' schemas are untouched, so the request fingerprints do not change.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import _crash
from ..agent import Agent
from ..context import current_step
from ..model import Gateway, ModelRequest, ModelResponse
from ..payloads import Intent, Outcome
from ..tools import Reconciled, Runner, Tool
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
    """The same tool, whose every execution first writes its line to the effect ledger."""
    kind = "call" if tool.effect is None else "publish"
    return dataclasses.replace(tool, runner=_LedgeredRunner(tool.runner, effects, kind))


class _LedgeredRunner:
    """A tool's runner that writes the ledger line (and passes ``inside_tool``) before
    each execution: a plain function's call, an effect's publish, any other kind's."""

    def __init__(self, inner: Runner, effects: Path, kind: str) -> None:
        self.inner, self.effects, self.kind = inner, effects, kind
        self.prepares = inner.prepares

    @property
    def effect(self) -> Any:
        return getattr(self.inner, "effect", None)

    def prepare(self, tool: Tool, run_id: str, step_id: str, intent: Intent) -> Intent:
        return self.inner.prepare(tool, run_id, step_id, intent)

    async def execute(
        self,
        tool: Tool,
        intent: Intent,
        kwargs: Mapping[str, Any] | None,
        *,
        via: str,
        attempts: int,
    ) -> Outcome:
        _note(self.effects, tool, self.kind)
        return await self.inner.execute(tool, intent, kwargs, via=via, attempts=attempts)

    async def reconcile(
        self, tool: Tool, intent: Intent, *, age: float | None, attempts: int
    ) -> Reconciled:
        return await self.inner.reconcile(tool, intent, age=age, attempts=attempts)


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
