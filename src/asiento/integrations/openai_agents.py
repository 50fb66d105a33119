"""OpenAI Agents SDK agents, durable on asiento's journal: ``durable_run``.

    result = await durable_run(agent, "refund order 42", run_id="refund-42", store=store,
                               idempotent_tools={"lookup_order"})

runs ``agent`` with the SDK's own ``Runner.run``, with every model request and
every function-tool call going through the run's journal, as a native run's do:

- model request n is step ``m{n}`` (in request order, across handoffs); a recorded
  answer is replayed without asking the model; a new request carries the step's
  idempotency key as its ``Idempotency-Key`` header (``asiento gateway`` honours it);
- the k-th function call of ``m{n}``'s answer is step ``m{n}.t{k}``, whatever order
  the SDK runs parallel calls in; a tool call writes its intent and submitted marker
  before it runs, and the replay table decides what a resumed run does with it (a
  tool not named in ``idempotent_tools`` whose outcome is unknown is
  ``UncertainEffect``); a handoff is a step too;
- a closed run returns its recorded output and runs nothing.

The SDK exports traces to OpenAI by default: ``durable_run`` turns tracing off for
its runs (``tracing=True`` keeps the SDK's setting). What cannot be made durable
is refused with a ``UsageError`` naming it (see docs/integrations/openai-agents.md).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import json
import logging
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import Any, NoReturn

from agents import Agent, Handoff, Model, ModelProvider, RunConfig, Runner
from agents import handoff as make_handoff
from agents.items import ModelResponse as SdkResponse
from agents.retry import ModelRetryAdvice, ModelRetryAdviceRequest
from agents.tool import FunctionTool
from agents.tool_context import ToolContext

from .. import outcomes, step_ids
from .._canonical import fingerprint, key_header, model_key
from .._crash import crash_point
from .._names import names
from ..errors import AsientoError, ReplayDivergence, UncertainEffect, UsageError
from ..events import Decision, Lease, Phase, RunStatus, Step, StepEvent
from ..journal.base import Checkpointer
from ..model import ModelRequest, ModelResponse
from ..payloads import SUBMITTED, Approval, Final, Intent, ModelResult, Outcome, Resolution
from ..replay import Action, StepState, decide, index, step_state
from ..session import RunStats, Session
from ..telemetry.tracing import (
    OFF,
    Off,
    PassTrace,
    Telemetry,
    provider_of,
    step_traceparent,
    telemetry_of,
)
from ..tools import check_seconds
from . import _oa_wire as wire
from ._commits import HeldCommits
from ._traced import traced_pass
from ._worker import pass_end, shown

__all__ = ["DurableResult", "durable_run"]

log = logging.getLogger("asiento")


@dataclass(frozen=True, slots=True, kw_only=True)
class DurableResult:
    """How a durable run ended.

    ``final_output`` is the SDK's final output; a run closed by an earlier pass
    (``replayed``) gives it back as recorded JSON (a structured output as its dict).
    ``result`` is the SDK's ``RunResult`` of this pass, None when it did not finish.
    ``awaiting`` is the step a person must approve or deny (``asiento approve``) before
    the run goes on; the run is suspended on disk and ``final_output`` is None.
    ``abandoned``: a person closed the run (``asiento abandon``); ``final_output`` says why.
    """

    run_id: str
    final_output: Any
    replayed: bool
    result: Any = None
    awaiting: str | None = None
    abandoned: bool = False


async def durable_run(
    agent: Agent[Any],
    input: str,
    *,
    run_id: str,
    store: Checkpointer,
    idempotent_tools: Collection[str] = (),
    run_config: RunConfig | None = None,
    context: Any = None,
    max_turns: int = 10,
    lease_ttl: float = 30.0,
    lease: Lease | None = None,
    tracing: bool = False,
    telemetry: bool | Telemetry | None = None,
) -> DurableResult:
    """Run ``agent`` on ``input`` with ``Runner.run``, durably, as run ``run_id`` of ``store``.

    Call it again with the same arguments after a crash: recorded model answers and
    tool outcomes are replayed, only what is missing is asked or run. Tools named in
    ``idempotent_tools`` may run again after a crash; every other function tool runs
    at most once, or the run stops with ``UncertainEffect``. ``lease`` is one a claim
    gave (``store.claim``, for runs queued with ``asiento.submit``): the run is driven
    under it, as a worker drives a native run. ``tracing`` keeps the SDK's own tracing on;
    ``telemetry`` traces the run with asiento's OpenTelemetry spans, as
    ``Agent(telemetry=...)`` does a native one (docs/observability.md).
    """
    if not isinstance(agent, Agent):
        raise UsageError(f"durable_run() takes an agents.Agent, got {type(agent).__name__}")
    if not isinstance(input, str):
        raise UsageError("durable_run(input=...) takes the task as a str")
    check_seconds(lease_ttl, "durable_run(lease_ttl=...)")  # named as the caller wrote it
    session = Session(run_id, _SdkModels(), store, lease_ttl=lease_ttl, lease=lease)
    traced = telemetry_of(telemetry, "durable_run")
    tools = names(idempotent_tools, where="durable_run(idempotent_tools=...)")
    options = _Options(tools, run_config, context, max_turns, tracing, traced)
    return await _pass(agent, input, session, options)


@dataclass(frozen=True, slots=True)
class _Options:
    """What ``durable_run`` takes beside the agent and the run: the same for every pass."""

    idempotent_tools: frozenset[str]
    run_config: RunConfig | None
    context: Any
    max_turns: int
    tracing: bool
    telemetry: Telemetry | None = None


async def _pass(
    agent: Agent[Any], input: str, session: Session, options: _Options
) -> DurableResult:
    """One pass of the run under ``session``'s lease (taken, or a worker's claim)."""
    run_id, store = session.run_id, session.store
    closed = await store.final(run_id)
    if closed is not None:
        await session.settle_closed()
        return _closed(run_id, closed)
    async with session.driving() as held:
        run = _Run(run_id, store, held, options.idempotent_tools, session.stats)
        events = await run.load()
        durable = run.agent(agent)
        run.check_tools_known()
        config = run.config(options.run_config or RunConfig(), tracing=options.tracing)
        async with traced_pass(options.telemetry, agent.name, session, held, events) as traced:
            run.trace = traced.trace
            ended = await _drive(
                run,
                durable,
                input,
                session,
                context=options.context,
                max_turns=options.max_turns,
                config=config,
            )
            if ended.awaiting:
                traced.status = "awaiting_approval"
            return ended


class WorkerAgent:
    """An OpenAI Agents SDK agent as ``asiento worker`` drives it: ``App(agents={"refunds":
    WorkerAgent(agent)}, gateway=...)``; each claimed run is one ``durable_run`` pass under
    the claim's lease.

    The worker's process rebuilds the agent: the same instructions, tools, handoffs and
    model settings as the process that started the run (else ``ReplayDivergence``). The
    app's gateway is not used: the SDK asks its own models, through the journal.
    """

    def __init__(
        self,
        agent: Agent[Any],
        *,
        idempotent_tools: Collection[str] = (),
        run_config: RunConfig | None = None,
        context: Any = None,
        max_turns: int = 10,
        tracing: bool = False,
        telemetry: bool | Telemetry | None = None,
    ) -> None:
        if not isinstance(agent, Agent):
            raise UsageError(f"WorkerAgent() takes an agents.Agent, got {type(agent).__name__}")
        self.agent = agent
        traced = telemetry_of(telemetry, "WorkerAgent")
        tools = names(idempotent_tools, where="WorkerAgent(idempotent_tools=...)")
        self.options = _Options(tools, run_config, context, max_turns, tracing, traced)

    async def run(self, task: str, *, session: Session) -> AsyncIterator[Step]:
        """The pass's end as the worker counts it: a ``FinalStep``, or the ``ApprovalStep``
        of the step that waits for a person."""
        result = await _pass(self.agent, task, session, self.options)
        async for step in pass_end(
            session,
            [result.awaiting] if result.awaiting else [],
            text=shown(result.final_output),
            replayed=result.replayed,
            abandoned=result.abandoned,
        ):
            yield step


async def _drive(
    run: _Run,
    agent: Agent[Any],
    input: str,
    session: Session,
    *,
    context: Any,
    max_turns: int,
    config: RunConfig,
) -> DurableResult:
    """One ``Runner.run`` of the wrapped agent, to its end or to a stop for a person."""
    try:
        result = await Runner.run(
            agent, input, context=context, max_turns=max_turns, run_config=config
        )
    except _Stop as stop:
        if stop.error is not None:
            raise stop.error from None
        return DurableResult(
            run_id=run.run_id, final_output=None, replayed=False, awaiting=stop.awaiting
        )
    else:  # the last answer, held, rides the closing commit (one commit a run fewer)
        await run.close(result.final_output, session)
    finally:
        await run.keep_paid_answer()
    return DurableResult(
        run_id=run.run_id, final_output=result.final_output, replayed=False, result=result
    )


def _closed(run_id: str, final: StepEvent) -> DurableResult:
    """A closed run answers from its final record: nothing runs."""
    return DurableResult(
        run_id=run_id,
        final_output=_recorded_output(final),
        replayed=True,
        abandoned=Final.from_json(final.payload).abandoned,
    )


def _recorded_output(final: StepEvent) -> Any:
    payload = final.payload
    if "output" in payload:
        return payload["output"]
    return Final.from_json(payload).text


class _SdkModels:
    """The session's gateway: the SDK reaches its models itself, through the journal."""

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        raise UsageError("an OpenAI Agents SDK run asks its models through the SDK")


class _Stop(BaseException):
    """Carries an asiento error (or a suspension for a person) out of the SDK's tool
    machinery, which turns every ``Exception`` of a tool into text for the model (a
    silent at-least-once)."""

    def __init__(self, error: AsientoError | None = None, *, awaiting: str | None = None) -> None:
        super().__init__(str(error) if error is not None else f"awaiting approval of {awaiting}")
        self.error, self.awaiting = error, awaiting


class _Run(HeldCommits):
    """One pass over one run: the journal as loaded, the step ids handed out so far."""

    def __init__(
        self,
        run_id: str,
        store: Checkpointer,
        lease: Lease,
        idempotent: frozenset[str],
        stats: RunStats,
    ) -> None:
        super().__init__(run_id, store, lease, {})
        self.idempotent, self.stats = idempotent, stats
        self.turn = 0
        self.calls: dict[str, str] = {}  # the SDK's call id -> its step id
        self.handoffs: list[str] = []  # step ids of handoff calls not yet invoked
        self.clones: dict[int, Agent[Any]] = {}
        self.tool_names: set[str] = set()
        self.last_step = ""
        self.running: dict[str, asyncio.Event] = {}  # tool steps executing now
        self.trace: PassTrace | Off = OFF

    async def load(self) -> list[StepEvent]:
        """The run's journal, as this pass begins: its records, indexed."""
        events = await self.store.load(self.run_id)
        self.journal = index(events)
        return events

    # -- the agent graph, wrapped ------------------------------------------------------

    def agent(self, agent: Agent[Any]) -> Agent[Any]:
        """A copy of ``agent`` (and of every agent it hands off to) whose model and
        function tools go through this run's journal; the user's objects stay as they are."""
        known = self.clones.get(id(agent))
        if known is not None:
            return known
        _refuse_undurable(agent)
        clone = agent.clone()
        self.clones[id(agent)] = clone
        if isinstance(agent.model, Model):
            clone.model = _JournaledModel(agent.model, self)
        clone.tools = [self._tool(t) for t in agent.tools]
        clone.handoffs = [self._handoff(h) for h in agent.handoffs]
        return clone

    def config(self, config: RunConfig, *, tracing: bool) -> RunConfig:
        model = config.model
        changes: dict[str, Any] = {
            "model_provider": _JournaledProvider(config.model_provider, self)
        }
        if isinstance(model, Model):
            changes["model"] = _JournaledModel(model, self)
        if not tracing:
            changes["tracing_disabled"] = True
        return dataclasses.replace(config, **changes)

    def check_tools_known(self) -> None:
        unknown = sorted(self.idempotent - self.tool_names)
        if unknown:
            raise UsageError(
                f"durable_run(idempotent_tools=...) names {', '.join(map(repr, unknown))}, "
                f"which no agent of the run has as a function tool (it has "
                f"{', '.join(map(repr, sorted(self.tool_names))) or 'none'})"
            )

    def _tool(self, tool: Any) -> Any:
        if not isinstance(tool, FunctionTool):
            return tool  # hosted tools run inside the model call: its answer records them
        if tool._is_agent_tool:
            raise UsageError(
                f"tool {tool.name!r} is an agent run as a tool (Agent.as_tool): its inner run "
                "would call its model outside the journal; make it a handoff instead"
            )
        idempotent = tool.name in self.idempotent
        if tool.timeout_seconds is not None and not idempotent:
            raise UsageError(
                f"tool {tool.name!r} has timeout_seconds: the SDK cancels it mid-way and tells "
                "the model it failed, while its effect may have happened; drop the timeout or "
                "declare the tool in idempotent_tools"
            )
        self.tool_names.add(tool.name)
        wrapped = copy.copy(tool)
        wrapped.on_invoke_tool = _JournaledTool(tool, self, idempotent=idempotent)
        wrapped.needs_approval = False  # asiento asks, and records the answer in the journal
        return wrapped

    def _handoff(self, handoff: Any) -> Any:
        if isinstance(handoff, Agent):  # the SDK's own default Handoff of it, recorded too
            handoff = make_handoff(handoff)
        if not isinstance(handoff, Handoff):
            raise UsageError(f"handoff {handoff!r} is neither an Agent nor a Handoff")
        wrapped = copy.copy(handoff)
        wrapped.on_invoke_handoff = _JournaledHandoff(handoff, self)
        return wrapped

    # -- model steps -------------------------------------------------------------------

    def next_model_step(self) -> str:
        self.turn += 1
        self.last_step = step_ids.model(self.turn)
        return self.last_step

    def recorded(self, step_id: str, fp: str) -> SdkResponse | None:
        """The recorded answer of ``step_id``, if any; ``ReplayDivergence`` if it was
        recorded for another request than the one the SDK makes now."""
        event = self.journal.get(step_id, {}).get(Phase.RESULT)
        if event is None:
            return None
        if wire.RESPONSE_KEY not in event.payload:
            raise ReplayDivergence(
                self.run_id, step_id, "the step was recorded by another kind of agent"
            )
        recorded_fp = ModelResult.from_json(event.payload).fp
        if recorded_fp != fp:
            raise ReplayDivergence(
                self.run_id,
                step_id,
                f"the SDK now sends a request of fingerprint {fp!r}, "
                f"the journal recorded {recorded_fp!r}",
            )
        response = wire.load_response(event.payload[wire.RESPONSE_KEY])
        self.stats.model_calls_replayed += 1
        self.stats.input_tokens_saved += response.usage.input_tokens
        self.stats.output_tokens_saved += response.usage.output_tokens
        return response

    def record_answer(
        self, step_id: str, fp: str, model: str, response: SdkResponse
    ) -> ModelResult:
        """Record a new answer with the next commit: the intents of the tools it asks for
        (durable before any runs), its handoff, or the final record. A model+tool step
        costs two commits, as a native one does."""
        result = ModelResult(fp=fp, response=wire.summary(response, model))
        payload = result.to_json() | {wire.RESPONSE_KEY: wire.dump_response(response)}
        self.hold(self.event(step_id, Phase.RESULT, payload))
        self.stats.model_calls += 1
        self.stats.input_tokens += response.usage.input_tokens
        self.stats.output_tokens += response.usage.output_tokens
        return result

    def number_calls(self, step_id: str, response: SdkResponse, handoffs: set[str]) -> None:
        """Give each function call of the answer its step id, from its position in it."""
        for k, call in enumerate(wire.function_calls(response), 1):
            tool_step = step_ids.tool(step_id, k)
            self.calls[call.call_id] = tool_step
            if call.name in handoffs:
                self.handoffs.append(tool_step)

    # -- tool steps --------------------------------------------------------------------

    async def tool_step(self, step_id: str, call: _Call) -> Any:
        """Bring one tool call to its outcome through the replay table; the value the
        SDK gets is the recorded one, live or replayed, so both give the model the same."""
        state = step_state(self.journal, step_id)
        records = state.records
        action = decide(records, idempotent=call.idempotent)
        if action is Action.FEED_RESULT:
            self.stats.tool_calls_replayed += 1
            return _value(Outcome.from_json(records[Phase.RESULT].payload))
        if action is Action.FEED_RESOLUTION:
            self.stats.tool_calls_replayed += 1
            return _value(Resolution.from_json(records[Phase.RESOLUTION].payload).as_outcome())
        if action is Action.FEED_DENIAL:
            denial = Approval.from_json(records[Phase.APPROVAL].payload).as_outcome()
            event = self.event(step_id, Phase.RESULT, denial.to_json(), Decision.DENIED)
            await self.append(event)
            return _value(denial)
        if action is Action.UNCERTAIN:
            self.trace.noted("asiento.effect.uncertain", state.current_id, call.name)
            stop = _Stop(UncertainEffect(self.run_id, state.current_id, call.name))
            return await self._stop_for_person(stop, call, state.current_id, Phase.RESOLUTION)
        if action is Action.AWAIT_APPROVAL:
            return await self._stop_for_person(_Stop(awaiting=step_id), call, step_id)
        return await self._execute(state, call, start=action is Action.START)

    async def _execute(self, state: StepState, call: _Call, *, start: bool) -> Any:
        """Intent (for a new step) and submitted durable, then the tool once, then its result."""
        step_id, attempt_id = state.step_id, state.next_id
        events = [self.event(attempt_id, Phase.SUBMITTED, SUBMITTED)]
        if start:
            args = _arguments(call.args_json)
            intent = Intent(tool=call.name, args=args, fp=fingerprint(args)[:32]).to_json()
            if await call.needs_approval(args):
                ask = self.event(step_id, Phase.INTENT, intent, Decision.REQUIRE_APPROVAL)
                self.trace.noted("asiento.approval.requested", step_id, call.name)
                await self.append(ask, status=RunStatus.SUSPENDED)
                await self._halt(_Stop(awaiting=step_id))
            events.insert(0, self.event(step_id, Phase.INTENT, intent, Decision.ALLOW))
        done = self.running[step_id] = asyncio.Event()
        try:
            await self.append(*events)
            crash_point("after_submitted")
            approved = Phase.APPROVAL in state.records
            args = _arguments(call.args_json)
            with self.trace.executing(step_id, attempt_id, call.name, call.ctx.tool_call_id, args):
                outcome = await _outcome_of(call.invoke)
                self.trace.executed(outcome, Decision.APPROVED if approved else Decision.ALLOW)
            self.stats.tool_calls += 1
            crash_point("after_tool")
            decision = Decision.APPROVED if approved else None
            await self.append(self.event(attempt_id, Phase.RESULT, outcome.to_json(), decision))
            crash_point("after_result")
        finally:
            done.set()
            del self.running[step_id]
        return _value(outcome)

    async def _stop_for_person(
        self, stop: _Stop, call: _Call, waits_at: str, phase: Phase = Phase.APPROVAL
    ) -> Any:
        """Mark the run as waiting for a person's record and stop; if that record came
        after this pass read the journal, read it and go on with it instead."""
        await self.settle()
        waiting = await self.store.set_status(
            self.run_id,
            RunStatus.UNCERTAIN if stop.error is not None else RunStatus.SUSPENDED,
            lease=self.lease,
            waits_for=(waits_at, phase),
        )
        if waiting:
            await self._halt(stop)
        self.journal = index(await self.store.load(self.run_id))
        return await self.tool_step(step_ids.base(waits_at), call)

    async def _halt(self, stop: _Stop) -> NoReturn:
        """Stop the run, once the tool steps running beside this one have their outcome
        recorded: the SDK cancels a failed call's siblings, which would leave them uncertain."""
        await asyncio.gather(*(e.wait() for e in list(self.running.values())))
        raise stop

    def step_of(self, call_id: str, name: str) -> str:
        step_id = self.calls.get(call_id)
        if step_id is None:
            raise _Stop(
                UsageError(
                    f"run {self.run_id!r}: tool {name!r} was called (call id {call_id!r}) "
                    "outside any recorded model answer; only the model's calls can be journaled"
                )
            )
        return step_id

    async def close(self, output: Any, session: Session) -> None:
        recorded = wire.jsonable(output)
        text = recorded if isinstance(recorded, str) else json.dumps(recorded, ensure_ascii=False)
        payload = Final(step=self.last_step, text=text).to_json() | {"output": recorded}
        event = self.event(step_ids.FINAL, Phase.RESULT, payload)
        ended = self.trace.end("closed")  # its mark rides the final commit
        await self.append_closing(session, event, *([ended] if ended else []))


class _JournaledProvider(ModelProvider):
    """The run's model provider, each model it gives going through the journal."""

    def __init__(self, inner: ModelProvider, run: _Run) -> None:
        self.inner, self.run = inner, run

    def get_model(self, model_name: str | None) -> Model:
        return _JournaledModel(self.inner.get_model(model_name), self.run, model_name or "")

    async def aclose(self) -> None:
        await self.inner.aclose()


class _JournaledModel(Model):
    """A model whose every request is a journal step: replayed when recorded, else asked
    with the step's idempotency key and recorded before the SDK sees the answer."""

    def __init__(self, inner: Model, run: _Run, name: str = "") -> None:
        self.inner, self.run = inner, run
        self.name = name or str(getattr(inner, "model", "") or type(inner).__name__)

    async def get_response(  # noqa: PLR0917 - the SDK's Model.get_response signature
        self,
        system_instructions: str | None,
        input: Any,
        model_settings: Any,
        tools: Any,
        output_schema: Any,
        handoffs: Any,
        tracing: Any,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: Any,
    ) -> SdkResponse:
        run = self.run
        step_id = run.next_model_step()
        fp = wire.request_fingerprint(
            system_instructions=system_instructions,
            input=input,
            model_settings=model_settings,
            tools=tools,
            output_schema=output_schema,
            handoffs=handoffs,
        )
        response = run.recorded(step_id, fp)
        if response is None:
            await run.settle()  # the answers before this one are durable before it is asked
            key = model_key(run.run_id, step_id, fp)
            headers = {**(model_settings.extra_headers or {}), **key_header(key)}

            def content() -> tuple[Any, str | None]:
                return wire.jsonable(input), system_instructions

            with run.trace.generating(step_id, self.name, provider_of(self.inner), content):
                headers |= step_traceparent()
                response = await self.inner.get_response(
                    system_instructions, input,
                    dataclasses.replace(model_settings, extra_headers=headers),
                    tools, output_schema, handoffs, tracing,
                    previous_response_id=previous_response_id,
                    conversation_id=conversation_id, prompt=prompt,
                )  # fmt: skip
                crash_point("inside_model_call")
                run.trace.answered(run.record_answer(step_id, fp, self.name, response))
        run.number_calls(step_id, response, {h.tool_name for h in handoffs})
        return response

    def get_retry_advice(self, request: ModelRetryAdviceRequest) -> ModelRetryAdvice | None:
        return self.inner.get_retry_advice(request)  # a retry is sent with the same key

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError(
            "durable_run() drives Runner.run; a streamed run (Runner.run_streamed) "
            "is not journaled yet"
        )

    async def close(self) -> None:
        await self.inner.close()


class _JournaledTool:
    """A function tool's ``on_invoke_tool``, through the run's journal."""

    def __init__(self, tool: FunctionTool, run: _Run, *, idempotent: bool) -> None:
        self.tool, self.run, self.idempotent = tool, run, idempotent

    async def __call__(self, ctx: ToolContext[Any], args_json: str) -> Any:
        step_id = self.run.step_of(ctx.tool_call_id, self.tool.name)
        invoke = self.tool.on_invoke_tool(ctx, args_json)
        call = _Call(self.tool, ctx, args_json, invoke, idempotent=self.idempotent)
        try:
            return await self.run.tool_step(step_id, call)
        except AsientoError as exc:  # the journal's own errors end the run, named
            raise _Stop(exc) from exc
        finally:
            if asyncio.iscoroutine(invoke):
                invoke.close()  # replayed: the tool's coroutine never started


@dataclass(frozen=True, slots=True)
class _Call:
    """One call of a function tool by the SDK: what the journal step needs of it."""

    tool: FunctionTool
    ctx: ToolContext[Any]
    args_json: str
    invoke: Any  # the tool's coroutine, awaited only if the step runs
    idempotent: bool

    @property
    def name(self) -> str:
        return self.tool.name

    async def needs_approval(self, args: dict[str, Any]) -> bool:
        """The tool's own ``needs_approval``, asked once, when the step is new."""
        needs = self.tool.needs_approval
        if isinstance(needs, bool):
            return needs
        answer = needs(self.ctx, args, self.ctx.tool_call_id)
        return bool(await answer if inspect.isawaitable(answer) else answer)


class _JournaledHandoff:
    """A handoff's ``on_invoke_handoff``: recorded as a step of the run, the agent it
    hands to wrapped like the first one."""

    def __init__(self, handoff: Handoff[Any, Any], run: _Run) -> None:
        self.handoff, self.run = handoff, run

    async def __call__(self, ctx: Any, args_json: str) -> Agent[Any]:
        target = await self.handoff.on_invoke_handoff(ctx, args_json)
        if self.run.handoffs:
            step_id = self.run.handoffs.pop(0)
            if Phase.RESULT not in self.run.journal.get(step_id, {}):
                await self._record(step_id, args_json, target.name)
        return self.run.agent(target)

    async def _record(self, step_id: str, args_json: str, target: str) -> None:
        args = _arguments(args_json)
        name = self.handoff.tool_name
        intent = Intent(tool=name, args=args, fp=fingerprint(args)[:32])
        run = self.run
        await run.append(
            run.event(step_id, Phase.INTENT, intent.to_json(), Decision.ALLOW),
            run.event(step_id, Phase.SUBMITTED, SUBMITTED),
            run.event(step_id, Phase.RESULT, Outcome.ok({"handoff": target}).to_json()),
        )


def _refuse_undurable(agent: Agent[Any]) -> None:
    """What would run outside the journal, silently at least once: refused, named."""
    if agent.mcp_servers:
        raise UsageError(
            f"agent {agent.name!r} has mcp_servers: their tools run outside the journal; "
            "use asiento's MCP tools (asiento.mcp) in a native Agent instead"
        )
    local = [
        type(t).__name__
        for t in agent.tools
        if not isinstance(t, FunctionTool) and type(t).__name__ in _LOCAL_TOOLS
    ]
    if local:
        raise UsageError(
            f"agent {agent.name!r} has {', '.join(local)}: tools that act on this machine "
            "outside the journal; wrap what they do in a function tool"
        )


# The SDK's tools that run code locally (not at the provider) and are not function tools.
_LOCAL_TOOLS = frozenset(
    {"ComputerTool", "LocalShellTool", "ShellTool", "ApplyPatchTool", "CustomTool"}
)


async def _outcome_of(invoke: Any) -> Outcome:
    """Run the tool's coroutine; what it returns (or raises) is its outcome."""
    try:
        value = await invoke
    except Exception as exc:
        return Outcome.failed(f"{type(exc).__name__}: {exc}")
    return outcomes.bounded(wire.jsonable(value))


def _value(outcome: Outcome) -> Any:
    """What the SDK gets back from the tool: the recorded value, or the failure as text."""
    if outcome.status == "ok":
        return outcome.value
    return f"An error occurred while running the tool: {outcome.shown}"


def _arguments(args_json: str) -> dict[str, Any]:
    try:
        args = json.loads(args_json or "{}")
    except ValueError:
        return {"raw_arguments": args_json}
    return args if isinstance(args, dict) else {"arguments": args}
