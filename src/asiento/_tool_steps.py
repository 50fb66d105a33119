"""A pass's tool steps: each call the model asked for brought to a known outcome.

The replay table (``replay.decide``) says what a call's records allow; this does it.
A new call is checked, decided by the policy, prepared, and its intent and submitted
marker made durable before it runs, once (``run_ready``); a recorded outcome or a
person's resolution is fed back; a call a crash cut is run again only if idempotent,
else reconciled by its runner or left to a person (``UncertainEffect``). The records
go through the pass (``_Pass.record`` / ``flush``), which owns the commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import context
from ._canonical import fingerprint
from ._crash import crash_point
from .context import StepContext
from .errors import ToolUnavailable, UncertainEffect
from .events import ApprovalStep, Decision, Phase, RunStatus, Step, StepEvent, ToolStep
from .model import Message, ToolCall
from .payloads import Approval, Intent, Outcome, Resolution
from .policy import ask_policy
from .replay import Action, Records, StepState, decide, step_state
from .tools import Found, PrepareFailed, Tool, ToolArgumentsError, ToolTimedOut, Unknown, within

if TYPE_CHECKING:
    from .agent import _Pass


@dataclass(frozen=True, slots=True)
class Ready:
    """A tool step whose intent and submitted marker are durable, about to run."""

    state: StepState
    call: ToolCall
    tool: Tool
    via: str
    kwargs: dict[str, Any] | None
    attempt_id: str
    attempts: int


# What the loop records for a step it made ready and never started: it knows.
NOT_STARTED = Resolution(
    happened=False,
    by="asiento",
    reason="the caller stopped iterating before the tool started; it runs on the next pass",
)


class ToolSteps:
    """The tool steps of one pass (``_Pass``), on its journal, records and trace."""

    def __init__(self, pass_: _Pass) -> None:
        self.pass_ = pass_
        self.ready: Ready | None = None  # a tool step durable and about to run

    async def step(self, step_id: str, call: ToolCall) -> bool:
        """Bring one tool call to a known outcome; False when the run must stop here."""
        tool = self.pass_.agent.tools.get(call.name)
        state = step_state(self.pass_.journal, step_id)
        records = state.records
        action = decide(records, idempotent=tool.idempotent if tool else True)
        if action is Action.FEED_RESULT:
            self.pass_.stats.tool_calls_replayed += self.pass_.first_time(step_id)
            self._feed(call, Outcome.from_json(records[Phase.RESULT].payload))
        elif action is Action.FEED_RESOLUTION:
            self.pass_.stats.tool_calls_replayed += self.pass_.first_time(step_id)
            self._feed(call, Resolution.from_json(records[Phase.RESOLUTION].payload).as_outcome())
        elif action is Action.START:
            return await self._start(step_id, call, tool)
        elif action is Action.EXECUTE:
            assert tool is not None  # an unknown tool gets its result at START
            await self._execute(state, call, tool)
        elif action is Action.FEED_DENIAL:
            self._deny(step_id, call, records)
        elif action is Action.AWAIT_APPROVAL:
            await self._suspend(step_id, call, records[Phase.INTENT])
            return False
        elif tool is None:
            await self._uncertain(state.current_id, call, "")
        else:
            await self._reconcile(state, call, tool)
        return True

    async def _start(self, step_id: str, call: ToolCall, tool: Tool | None) -> bool:
        args = dict(call.arguments)
        frozen = Intent(tool=call.name, args=args, fp=fingerprint(args)[:32])
        problem, kwargs = _argument_problem(call, tool)
        if problem is not None or tool is None:
            self.pass_.record(step_id, Phase.INTENT, frozen)
            self._result(step_id, call, Decision.ALLOW, Outcome.failed(str(problem)))
            return True
        decision = await ask_policy(self.pass_.agent.policy, call)
        if decision is not Decision.DENY:
            try:
                frozen = tool.runner.prepare(tool, self.pass_.run_id, step_id, frozen)
            except PrepareFailed as exc:
                problem = str(exc)
        intent = self.pass_.record(step_id, Phase.INTENT, frozen, decision)
        if problem is not None:
            self._result(step_id, call, decision, Outcome.failed(problem))
        elif decision is Decision.DENY:
            self.pass_.trace.noted("asiento.tool.denied", step_id, call.name, by="policy")
            self._result(step_id, call, decision, Outcome.denied("policy", "denied by policy"))
        elif decision is Decision.REQUIRE_APPROVAL:
            await self._suspend(step_id, call, intent)
            return False
        else:
            if tool.runner.prepares:  # what it prepared is durable before it executes
                await self.pass_.flush()
                crash_point("after_prepare")
            state = StepState(step_id, 1, {Phase.INTENT: intent})
            await self._execute(state, call, tool, kwargs=kwargs)
        return True

    async def _execute(
        self,
        state: StepState,
        call: ToolCall,
        tool: Tool,
        via: str = "publish",
        *,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Make the step's intent and submitted marker durable: it runs next, once.

        The steps recorded so far are yielded in between (the model's answer among
        them), so a caller sees what the model asked for before the tool runs.
        """
        records, attempt_id = state.records, state.next_id
        attempts = state.attempt + (1 if Phase.SUBMITTED in records else 0)
        self.pass_.record(attempt_id, Phase.SUBMITTED, None)
        await self.pass_.flush()
        self.ready = Ready(state, call, tool, via, kwargs, attempt_id, attempts)

    async def run_ready(self) -> None:
        """Run the tool step made ready, once; its outcome is recorded with the next commit."""
        ready, self.ready = self.ready, None
        if ready is None:
            return
        state, call, tool = ready.state, ready.call, ready.tool
        intent = Intent.from_json(state.records[Phase.INTENT].payload)
        run_id, attempt_id = self.pass_.run_id, ready.attempt_id
        where = StepContext(
            run_id=run_id, step_id=state.step_id, attempt_id=attempt_id, tool=call.name
        )
        token = context.enter(where)
        seconds = self.pass_.session.tool_timeout if tool.timeout is None else tool.timeout
        decision = Decision.APPROVED if Phase.APPROVAL in state.records else Decision.ALLOW
        with self.pass_.trace.executing(
            state.step_id, ready.attempt_id, call.name, call.id, call.arguments
        ):
            try:
                executing = tool.runner.execute(
                    tool, intent, ready.kwargs, via=ready.via, attempts=ready.attempts
                )
                outcome = await within(executing, seconds, call.name)
            except ToolUnavailable as exc:  # it never left: the step runs on the next pass
                unsent = Resolution(happened=False, by="asiento", reason=str(exc)[:500])
                self.pass_.record(ready.attempt_id, Phase.RESOLUTION, unsent)
                raise
            except ToolTimedOut as exc:
                if not tool.idempotent:  # it may have happened, or may yet: never run it again
                    why = f"it timed out after {exc.seconds:g} s, and may or may not have happened"
                    await self._uncertain(
                        ready.attempt_id, call, f"{why[0].upper()}{why[1:]}.", why
                    )
                outcome = Outcome.failed(str(exc))
            finally:
                context.leave(token)
            self.pass_.trace.executed(outcome, decision)
        self.pass_.stats.tool_calls += 1
        self.pass_.counted.add(state.step_id)
        crash_point("after_tool")
        self._result(ready.attempt_id, call, decision, outcome, step_id=state.step_id)

    async def _reconcile(self, state: StepState, call: ToolCall, tool: Tool) -> None:
        """Submitted, no outcome, not idempotent: what the tool's runner can settle, or a person.

        The step's age is the store's: on PostgreSQL the server's clock judges when it
        was first submitted, so no client's clock can make an old key look fresh.
        """
        intent = Intent.from_json(state.records[Phase.INTENT].payload)
        age = await self.pass_.store.age(self.pass_.run_id, state.step_id, Phase.SUBMITTED)
        settled = await tool.runner.reconcile(tool, intent, age=age, attempts=state.attempt)
        if isinstance(settled, Unknown):
            await self._uncertain(state.current_id, call, settled.why)
        elif isinstance(settled, Found):
            decision = Decision.APPROVED if Phase.APPROVAL in state.records else Decision.ALLOW
            self._result(state.current_id, call, decision, settled.outcome, step_id=state.step_id)
        else:
            await self._execute(state, call, tool, via=settled.via)

    async def _uncertain(
        self, record_id: str, call: ToolCall, detail: str, why: str | None = None
    ) -> None:
        """Stop for a person: nobody knows whether attempt ``record_id`` happened
        (``why``, when it is news the run page should show)."""
        await self.pass_.flush()
        reason = None if why is None else f"tool {call.name!r} (step {record_id}): {why}"[:1000]
        await self.pass_.wait_for(RunStatus.UNCERTAIN, record_id, Phase.RESOLUTION, reason)
        self.pass_.trace.noted("asiento.effect.uncertain", record_id, call.name)
        raise UncertainEffect(self.pass_.run_id, record_id, call.name, detail)

    def _deny(self, step_id: str, call: ToolCall, records: Records) -> None:
        approval = records.get(Phase.APPROVAL)
        if approval is None:
            self._result(step_id, call, Decision.DENY, Outcome.denied("policy", "denied by policy"))
        else:
            denial = Approval.from_json(approval.payload).as_outcome()
            self._result(step_id, call, Decision.DENIED, denial)

    async def _suspend(self, step_id: str, call: ToolCall, intent: StepEvent) -> None:
        frozen = Intent.from_json(intent.payload)
        steps = _awaiting_approval(self.pass_.run_id, step_id, call, frozen)
        if any(e is intent for e in self.pass_.pending):  # new: nobody can have decided on it yet
            self.pass_.trace.noted("asiento.approval.requested", step_id, call.name)
            self.pass_.waiting.extend(steps)
            await self.pass_.flush(RunStatus.SUSPENDED)
            return
        await self.pass_.flush()
        await self.pass_.wait_for(RunStatus.SUSPENDED, step_id, Phase.APPROVAL)
        self.pass_.out.extend(steps)

    def _result(
        self,
        record_id: str,
        call: ToolCall,
        decision: Decision,
        outcome: Outcome,
        *,
        step_id: str | None = None,
    ) -> None:
        """Record an outcome under ``record_id`` (an attempt of ``step_id``) and feed it."""
        self.pass_.record(record_id, Phase.RESULT, outcome)
        self.pass_.waiting.append(
            ToolStep(
                run_id=self.pass_.run_id,
                step_id=step_id or record_id,
                call=call,
                decision=decision,
                status=outcome.status,
                result=outcome.shown,
            )
        )
        self._feed(call, outcome)

    def _feed(self, call: ToolCall, outcome: Outcome) -> None:
        self.pass_.add(
            Message(role="tool", content=outcome.text(), tool_call_id=call.id, name=call.name)
        )


def _argument_problem(
    call: ToolCall, tool: Tool | None
) -> tuple[str | None, dict[str, Any] | None]:
    """Why a call cannot run at all (unknown tool, arguments JSON cannot carry or that
    do not fit), or the validated keyword arguments to call the tool with."""
    if tool is None:
        return f"unknown tool {call.name!r}", None
    if call.problem:
        return call.problem, None
    try:
        return None, tool.validate(call.arguments)
    except ToolArgumentsError as exc:
        return str(exc), None


def _awaiting_approval(run_id: str, step_id: str, call: ToolCall, frozen: Intent) -> list[Step]:
    """What a caller is shown of a call that waits for a person's approval."""
    return [
        ToolStep(
            run_id=run_id,
            step_id=step_id,
            call=call,
            decision=Decision.REQUIRE_APPROVAL,
            status="awaiting_approval",
        ),
        ApprovalStep(
            run_id=run_id,
            step_id=step_id,
            call=call,
            fingerprint=frozen.fp,
            prepared=frozen.prepared,
        ),
    ]
