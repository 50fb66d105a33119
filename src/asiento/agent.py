"""The loop: derive the conversation from the journal, ask only for what is missing.

Every yielded step is durable first. Records are batched so that a model+tool
step costs two commits: (model result + tool intent + submitted) before the
tool runs, and the tool result before the next model call depends on it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Literal, cast, overload

from . import budget as budgets
from . import shutdown, step_ids
from ._canonical import (
    FingerprintChain,
)
from ._crash import crash_point
from ._model_steps import ModelSteps, digests
from ._tool_steps import NOT_STARTED, ToolSteps
from .errors import (
    AsientoError,
    LeaseLost,
    MaxTurnsExceeded,
    UsageError,
)
from .events import (
    ApprovalStep,
    BudgetStep,
    Decision,
    FinalStep,
    Lease,
    Phase,
    RunStatus,
    Savings,
    Step,
    StepEvent,
)
from .model import (
    Message,
    ModelResponse,
)
from .payloads import (
    SUBMITTED,
    Final,
    Payload,
)
from .policy import Policy, allow_all
from .replay import index
from .session import Session, abandonment
from .streaming import (
    StreamEvent,
)
from .telemetry import tracing
from .tools import Tool, check_count

log = logging.getLogger("asiento")


class Agent:
    """Instructions, tools and a policy; ``run()`` drives one run through a ``Session``."""

    def __init__(
        self,
        *,
        instructions: str = "",
        tools: Sequence[Tool] = (),
        policy: Policy | None = None,
        max_turns: int = 50,
        budget: budgets.Budget | None = None,
        name: str = "",
        telemetry: bool | tracing.Telemetry | None = None,
    ) -> None:
        if not isinstance(instructions, str):
            raise UsageError("Agent(instructions=...) must be a str")
        for t in tools:
            if not isinstance(t, Tool):
                raise UsageError(
                    f"Agent(tools=...) takes functions decorated with @tool, got {t!r}"
                )
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise UsageError(f"Agent(tools=...) has two tools with the same name: {names}")
        check_count(max_turns, "Agent(max_turns=...)", least=1)
        if budget is not None and not isinstance(budget, budgets.Budget):
            raise UsageError(f"Agent(budget=...) takes a Budget(...), got {budget!r}")
        if not isinstance(name, str):
            raise UsageError(f"Agent(name=...) must be a str, got {name!r}")
        self.name = name  # how traces name the agent; not part of the run's fingerprint
        self.telemetry = tracing.telemetry_of(telemetry, "Agent")
        self.budget = budget
        self.instructions = instructions
        self.tools = {t.name: t for t in tools}
        self.policy: Policy = policy or allow_all
        self.max_turns = max_turns
        self.schemas = tuple(t.schema for t in tools)
        self.head: dict[str, Any] = {
            "instructions": instructions,
            "tools": [s.to_json() for s in self.schemas],
        }
        # Tools from elsewhere (MCP) add what they depend on to the fingerprint, and m1
        # records their digests; a run of local tools keeps the records it always had.
        sources = {t.name: t.source for t in tools if t.source is not None}
        self.digests: dict[str, str] | None = digests(tools) if sources else None
        if sources:
            self.head["sources"] = sources

    @overload
    def run(
        self, task: str, *, session: Session, stream: Literal[False] = False
    ) -> AsyncIterator[Step]: ...

    @overload
    def run(
        self, task: str, *, session: Session, stream: Literal[True]
    ) -> AsyncIterator[Step | StreamEvent]: ...

    def run(
        self, task: str, *, session: Session, stream: bool = False
    ) -> AsyncIterator[Step] | AsyncIterator[Step | StreamEvent]:
        """Drive the run to its end or to a point that needs a person, yielding each step.

        ``stream=True`` also yields each model step's answer as it is generated
        (``Delta``), and ``StreamRestart`` before a step asked again, so a cut
        attempt's text can be dropped; the ``ModelStep`` follows once it is durable.
        """
        if not isinstance(task, str):
            raise UsageError(f"the task must be a str, got {type(task).__name__}")
        if not isinstance(session, Session):
            raise UsageError("run() needs session=Session(run_id, gateway, store)")
        if not isinstance(stream, bool):
            raise UsageError(f"run(stream=...) takes True or False, got {stream!r}")
        if stream:
            return _Pass(self, task, session, streaming=True).steps()
        return cast("AsyncIterator[Step]", _Pass(self, task, session).steps())


class _OverBudget(Exception):
    """The run's budget is spent before a new model call: the walk stops here."""


class _Decided(Exception):
    """A person decided the step this pass was about to wait for, after the pass read
    the journal: the pass walks the run again from the journal instead of waiting."""


class _Pass:
    """One pass over a run: the state derived from the journal, then what is new."""

    def __init__(
        self, agent: Agent, task: str, session: Session, *, streaming: bool = False
    ) -> None:
        self.agent, self.task, self.session = agent, task, session
        self.run_id, self.store, self.stats = session.run_id, session.store, session.stats
        self.chain = FingerprintChain(agent.head)
        self.messages: list[Message] = []
        self.journal: dict[str, dict[Phase, StepEvent]] = {}
        self.cuts: dict[str, list[str]] = {}  # streamed attempts in the journal, by model step
        self.pending: list[StepEvent] = []
        self.waiting: list[Step] = []  # steps whose records are in ``pending``
        self.out: list[Step] = []  # steps whose records are durable
        self.lease: Lease | None = None
        self.counted: set[str] = set()  # steps whose call or replay this pass counted
        self.unrecorded: list[StepEvent] = []  # records an append refused (lease lost)
        self.spent = budgets.Spent()  # what the model steps walked so far spent
        self.trace: tracing.PassTrace | tracing.Off = tracing.OFF
        self.tools = ToolSteps(self)
        self.models = ModelSteps(self, streaming=streaming)

    async def steps(self) -> AsyncGenerator[Step | StreamEvent, None]:
        # A claimed run was running when claimed; its walk's first read sees a final
        # recorded since (an abandon) and closes it: no read of its own for that here.
        final = None if self.session.claimed else await self.store.final(self.run_id)
        if final is not None:
            await self.session.settle_closed()
            yield self._closed(final)
            return
        try:
            async with self.session.driving() as lease:
                self.lease = lease
                self.trace = tracing.for_pass(
                    self.agent.telemetry, self.agent.name, self.session, lease
                )
                status, error = "stopped", None
                try:
                    # aclosing: a caller that stops reading closes every generator below at
                    # once, in order (spans ended, markers written) before the lease goes.
                    async with contextlib.aclosing(self._walks()) as walks:
                        async for step in walks:
                            status = _status_after(step, status)
                            yield step
                except BaseException as exc:
                    status, error = tracing.status_of(exc), exc
                    raise
                finally:
                    await self._keep_what_happened()
                    await self.trace.close(status, error, self.store, lease)
        except LeaseLost as exc:
            abandoned = await abandonment(self.store, self.run_id, self.unrecorded)
            if abandoned is None:
                raise
            raise abandoned from exc

    async def _walks(self) -> AsyncGenerator[Step | StreamEvent, None]:
        """Walk the run; walk it again from the journal when a person decided meanwhile.

        Each new walk follows a decision recorded for the step the previous one was
        about to wait for, so it gets past that step: there are at most as many
        walks as the run has steps.
        """
        while True:
            try:
                async with contextlib.aclosing(self._walk()) as walk:
                    async for step in walk:
                        yield step
                return
            except _OverBudget:
                for step in self._drain():
                    yield step
                return
            except _Decided:
                for step in self._drain():
                    yield step
                self.chain = FingerprintChain(self.agent.head)
                self.messages, self.journal = [], {}

    async def _keep_what_happened(self) -> None:
        """Closed early (the caller stopped iterating, or an error): record what already ran.

        A tool that ran has its result waiting for the next commit; losing it would
        turn a known outcome into an uncertain one. A tool made ready that the caller
        stopped before it started is recorded as not having happened: it runs, once,
        on the next pass.
        """
        if self.tools.ready is not None:
            ready, self.tools.ready = self.tools.ready, None
            self.record(ready.attempt_id, Phase.RESOLUTION, NOT_STARTED)
        if not self.pending:
            return
        try:
            await self.flush()
        except AsientoError as exc:
            log.warning("run %r: could not record the last outcomes: %s", self.run_id, exc)

    def _closed(self, final: StepEvent) -> FinalStep:
        """A closed run answers with its recorded final step, and nothing else happens."""
        closed = Final.from_json(final.payload)
        return FinalStep(
            run_id=self.run_id,
            step_id=closed.step,
            text=closed.text,
            replayed=True,
            abandoned=closed.abandoned,
        )

    async def _walk(self) -> AsyncGenerator[Step | StreamEvent, None]:
        """Replay what the journal holds, then do what is missing, step by step."""
        events = await self.store.load(self.run_id)
        self.journal = index(events)
        self.cuts = step_ids.streamed_by_step(self.journal)  # once a walk, not once a step
        self.spent = budgets.Spent()
        final = self.journal.get(step_ids.FINAL, {}).get(Phase.RESULT)
        if final is not None:  # closed by the session we waited for
            await self.store.set_status(self.run_id, RunStatus.CLOSED, lease=self.lease)
            yield self._closed(final)
            return
        if not self.trace.begun:
            await self.trace.open(events, self.store, self.lease)
        self.add(Message(role="user", content=self.task))
        for turn in range(1, self.agent.max_turns + 1):
            step_id = step_ids.model(turn)
            await self._boundary()
            async with contextlib.aclosing(self.models.answer(step_id)) as answer:
                async for item in answer:
                    if isinstance(item, ModelResponse):
                        response = item
                    else:
                        yield item
            if not response.tool_calls:
                await self._close(step_id, response)
                for step in self._drain():
                    yield step
                return
            for number, call in enumerate(response.tool_calls, 1):
                await self._boundary()
                go_on = await self.tools.step(step_ids.tool(step_id, number), call)
                for step in self._drain():  # durable: yielded before the tool runs
                    yield step
                await self.tools.run_ready()
                if not go_on:
                    return
            await self.flush()
            for step in self._drain():
                yield step
        raise MaxTurnsExceeded(
            f"run {self.run_id!r}: the model still asked for tools after "
            f"{self.agent.max_turns} turns; raise Agent(max_turns=...) to let it go on"
        )

    async def _boundary(self) -> None:
        """Between two steps: stop here if a shutdown was requested, with nothing lost."""
        if not shutdown.requested():
            return
        await self.flush()
        raise shutdown.ShutdownRequested(
            f"run {self.run_id!r} stopped between steps because a shutdown was requested; "
            "every finished step is recorded and the run is resumable"
        )

    # -- model steps ---------------------------------------------------------------

    def first_time(self, step_id: str) -> bool:
        """Whether this pass counts ``step_id`` now (a call paid, or a replay saved)."""
        if step_id in self.counted:
            return False
        self.counted.add(step_id)
        return True

    async def check_budget(self, step_id: str) -> budgets.Budget | None:
        """Before a new (paid) call: stop, suspended and resumable, if the budget is spent;
        else the budget in force (None: the run has none).

        The stop is recorded (``budget{n}``, what was spent against which limit) and the
        run waits for a person's raise there; a raise recorded after this pass read the
        journal is not lost: the conditional status sees it and the pass walks again.
        """
        if self.agent.budget is None:
            return None
        cut = len(self.models.cut_attempts(step_id))
        checked = budgets.check(
            self.agent.budget, self.journal, self.spent, cut=cut, before=step_id
        )
        if isinstance(checked, budgets.Budget):
            return checked
        if not checked.recorded:
            self.record(checked.step_id, Phase.INTENT, checked.record)
        await self.flush()
        waiting = (RunStatus.SUSPENDED, checked.step_id, Phase.APPROVAL, checked.reason)
        await self.wait_for(*waiting)
        log.info("run %r %s", self.run_id, checked.reason)
        self.out.append(checked.shown(self.run_id))
        raise _OverBudget

    async def _close(self, step_id: str, response: ModelResponse) -> None:
        self.record(step_ids.FINAL, Phase.RESULT, Final(step=step_id, text=response.text))
        self.waiting.append(FinalStep(run_id=self.run_id, step_id=step_id, text=response.text))
        ended = self.trace.end("closed")  # its mark rides the final commit
        if ended is not None:
            self.pending.append(ended)
        await self.flush(RunStatus.CLOSED, release=self.session.closing())
        self.session.closed()

    async def wait_for(
        self, status: RunStatus, step_id: str, phase: Phase, reason: str | None = None
    ) -> None:
        """Mark the run as waiting for a person's record, unless that record is there
        already (a person may have decided after this pass read the journal): then
        ``_Decided``, and the pass walks the run again from the journal."""
        if not await self.store.set_status(
            self.run_id, status, reason=reason, lease=self.lease, waits_for=(step_id, phase)
        ):
            raise _Decided

    # -- journal plumbing ----------------------------------------------------------

    def add(self, message: Message) -> None:
        self.messages.append(message)
        self.chain.add(message.to_json())

    def record(
        self, step_id: str, phase: Phase, record: Payload | None, decision: Decision | None = None
    ) -> StepEvent:
        payload = SUBMITTED if record is None else record.to_json()
        event = StepEvent(
            run_id=self.run_id, step_id=step_id, phase=phase, payload=payload, decision=decision
        )
        self.pending.append(event)
        return event

    async def flush(
        self, status: RunStatus | None = None, *, release: Savings | None = None
    ) -> None:
        """Make the pending records durable in one transaction, then release their steps
        (``release``: the closing commit gives the lease up too, ``Session.closing``)."""
        events, self.pending = self.pending, []
        phases = {(e.phase, step_ids.is_tool(e.step_id)) for e in events}
        if (Phase.INTENT, True) in phases:
            crash_point("before_intent")
        if events:
            try:
                closing = {} if release is None else {"release": release}
                await self.store.append(*events, status=status, lease=self.lease, **closing)
            except LeaseLost:
                self.unrecorded += events
                raise
        elif status is not None:
            await self.store.set_status(self.run_id, status, lease=self.lease)
        if (Phase.RESULT, True) in phases:
            crash_point("after_result")
        if (Phase.RESULT, False) in phases:
            crash_point("after_model_result")
        if (Phase.INTENT, True) in phases:
            crash_point("after_intent")
        if (Phase.SUBMITTED, True) in phases:
            crash_point("after_submitted")
        self.out.extend(self.waiting)
        self.waiting.clear()

    def _drain(self) -> list[Step]:
        out, self.out = self.out, []
        return out


def _status_after(step: Step | StreamEvent, status: str) -> str:
    """How the pass leaves the run, as the steps it yielded say (traces)."""
    if isinstance(step, FinalStep):
        return "closed"
    if isinstance(step, ApprovalStep):
        return "awaiting_approval"
    if isinstance(step, BudgetStep):
        return "over_budget"
    return status
