"""Run an existing ``pydantic_ai.Agent`` durably: ``await durable_run(agent, prompt, ...)``.

The agent's code stays as it is. For the run, its model is wrapped (``_JournaledModel``,
as Pydantic AI's own Temporal and DBOS backends wrap it) and so is each of its
toolsets (``_JournaledToolset``, whose ``call_tool`` goes through the journal):

- model request n is step ``m{n}``: a recorded answer is handed back without calling
  the model (a changed request is ``ReplayDivergence``); a new request carries the
  step's deterministic ``Idempotency-Key``, so ``asiento gateway`` bills a crash
  inside it once; its answer is recorded before the agent sees it;
- tool call k of ``m{n}`` is step ``m{n}.t{k}`` (its place in the recorded answer, so
  parallel calls keep their ids): intent and submitted are durable before it runs,
  and a resumed run follows the replay table, as a native run does: a recorded
  result is fed back, an idempotent tool runs again, any other raises
  ``UncertainEffect`` for a person to resolve;
- a closed run hands back its recorded output without running anything.

The run holds its lease through a ``Session`` and writes through the same
``Checkpointer`` calls as a native run, so ``asiento ls``, ``show``, ``resolve``
and ``abandon`` work on it unchanged. docs/integrations/pydantic-ai.md says what
this cannot make durable.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter
from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults, RunContext, ToolDenied
from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelRetry
from pydantic_ai.messages import ModelMessage
from pydantic_ai.messages import ModelResponse as FrameworkResponse
from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse, infer_model
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings
from pydantic_ai.toolsets import ToolsetTool, WrapperToolset
from pydantic_core import to_jsonable_python

from .. import context, shutdown, step_ids
from .._canonical import canonical_json, fingerprint, key_header, model_key
from .._crash import crash_point
from ..errors import (
    AsientoError,
    LeaseLost,
    ReplayDivergence,
    RunAbandoned,
    UncertainEffect,
    UsageError,
)
from ..events import ApprovalStep, Decision, FinalStep, Lease, Phase, RunStatus, Step, StepEvent
from ..journal.base import Checkpointer
from ..model import ModelRequest, ToolCall
from ..payloads import (
    SUBMITTED,
    Approval,
    Final,
    Intent,
    ModelResult,
    Outcome,
    Resolution,
)
from ..replay import Action, Indexed, decide, index, step_state, tool_drift
from ..session import RunStats, Session
from ._pydantic_ai_records import (
    dump_messages,
    load_messages,
    model_payload,
    recorded_response,
    request_fingerprint,
    tool_calls,
    tool_digests,
)

__all__ = ["DurableResult", "WorkerAgent", "durable_run"]

_OUTPUT_KEY = "pydantic_ai_output"
_MESSAGES_KEY = "pydantic_ai_messages"


@dataclass(frozen=True, slots=True)
class DurableResult:
    """What a durable run of a Pydantic AI agent ended with.

    ``output`` is the agent's output (for a closed run, the recorded one, validated
    again against the agent's ``output_type``); ``replayed`` says the run was closed
    already and nothing ran; ``stats`` counts what this call paid and what the journal
    saved it from paying again. ``awaiting`` names the tool steps that wait for a
    person's approval (``asiento approve`` / ``deny``): the run is suspended there, its
    ``output`` is None, and the next call after the decisions goes on. ``abandoned``: a
    person closed the run (``asiento abandon``); nothing runs and ``output`` is None.
    """

    run_id: str
    output: Any
    messages: list[ModelMessage]
    replayed: bool
    stats: RunStats
    awaiting: tuple[str, ...] = ()
    abandoned: bool = False


async def durable_run(
    agent: Agent[Any, Any],
    prompt: str,
    *,
    run_id: str,
    store: Checkpointer,
    idempotent: Iterable[str] = (),
    trusted_mcp: Iterable[str] = (),
    model: Model | str | None = None,
    deps: Any = None,
    message_history: Sequence[ModelMessage] | None = None,
    lease_ttl: float = 30.0,
    wait: float = 0.0,
    lease: Lease | None = None,
) -> DurableResult:
    """Drive ``agent`` on ``prompt`` as run ``run_id`` of ``store``, to its end.

    Call it again with the same arguments after a crash: what the journal holds is
    replayed, what is missing is done, each effect once or ``UncertainEffect``.
    ``idempotent`` names the tools that are safe to run again when a crash left their
    outcome unknown (every other tool is not, except an MCP tool whose annotations say
    so, from a server whose toolset ``id`` is in ``trusted_mcp``: the MCP table of
    docs/mcp.md). ``lease`` is one a worker claimed.
    """
    if not isinstance(agent, Agent):
        raise UsageError(f"durable_run() takes a pydantic_ai.Agent, got {agent!r}")
    if not isinstance(prompt, str):
        raise UsageError(f"durable_run(prompt=...) must be a str, got {type(prompt).__name__}")
    chosen = model if model is not None else agent.model
    if chosen is None:
        raise UsageError("durable_run(): the agent has no model; pass model=...")
    session = Session(run_id, _FrameworkModel(), store, lease_ttl=lease_ttl, wait=wait, lease=lease)
    options = _Options(chosen, frozenset(idempotent), frozenset(trusted_mcp), deps)
    return await _drive(agent, prompt, session, options, message_history)


@dataclass(frozen=True, slots=True)
class _Options:
    """How a run of the agent is driven, beside the agent itself."""

    model: Model | str
    idempotent: frozenset[str]
    trusted_mcp: frozenset[str]
    deps: Any


async def _drive(
    agent: Agent[Any, Any],
    prompt: str,
    session: Session,
    options: _Options,
    message_history: Sequence[ModelMessage] | None = None,
) -> DurableResult:
    """One pass over the run under ``session``'s lease: replayed, then what is missing."""
    store = session.store
    final = await store.final(session.run_id)
    if final is not None:
        await session.settle_closed()
        return _closed(agent, session, final)
    try:
        async with session.driving() as held:
            journal = index(await store.load(session.run_id))
            run = _Run(session, held, options.idempotent, options.trusted_mcp, journal)
            wrapped = _JournaledModel(infer_model(options.model), run=run)
            toolsets = [_JournaledToolset(t, run=run) for t in agent.toolsets]
            asked: str | None = prompt
            history, decided = message_history, None
            with agent.override(model=wrapped, toolsets=toolsets, tools=[]), _unwrapped():
                while True:  # each round ends at a deferral the journal has decisions for
                    result = await agent.run(
                        asked,
                        deps=options.deps,
                        message_history=history,
                        deferred_tool_results=decided,
                    )
                    if not isinstance(result.output, DeferredToolRequests):
                        break
                    decided, awaiting = await run.decisions(result.output)
                    if decided is None:
                        return DurableResult(
                            run_id=session.run_id,
                            output=None,
                            messages=result.all_messages(),
                            replayed=False,
                            stats=session.stats,
                            awaiting=awaiting,
                        )
                    asked, history = None, result.all_messages()
            messages = result.all_messages()
            await run.close(result.output, messages)
    except LeaseLost as exc:
        abandoned = await _abandonment(session)
        if abandoned is None:
            raise
        raise abandoned from exc
    return DurableResult(
        run_id=session.run_id,
        output=result.output,
        messages=messages,
        replayed=False,
        stats=session.stats,
    )


async def _abandonment(session: Session) -> RunAbandoned | None:
    """The error for a lease lost to a person who abandoned the run, if that is what
    happened (abandoning takes the run's fence)."""
    try:
        final = await session.store.final(session.run_id)
    except AsientoError:
        return None
    closed = None if final is None else Final.from_json(final.payload)
    if closed is None or not closed.abandoned:
        return None
    return RunAbandoned(session.run_id, closed.text or "abandoned")


class WorkerAgent:
    """A Pydantic AI agent as ``asiento worker`` drives it: ``App(agents={"refunds":
    WorkerAgent(agent)})``; each claimed run is one ``durable_run`` pass under the claim.

    The worker's process rebuilds the agent: the same instructions, tools, output type
    and model settings as the process that started the run (else ``ReplayDivergence``).
    The app's gateway is not used: the agent asks its own model.
    """

    def __init__(
        self,
        agent: Agent[Any, Any],
        *,
        idempotent: Iterable[str] = (),
        trusted_mcp: Iterable[str] = (),
        model: Model | str | None = None,
        deps: Any = None,
    ) -> None:
        if not isinstance(agent, Agent):
            raise UsageError(f"WorkerAgent() takes a pydantic_ai.Agent, got {agent!r}")
        chosen = model if model is not None else agent.model
        if chosen is None:
            raise UsageError("WorkerAgent(): the agent has no model; pass model=...")
        self.agent = agent
        self.options = _Options(chosen, frozenset(idempotent), frozenset(trusted_mcp), deps)

    async def run(self, task: str, *, session: Session) -> AsyncIterator[Step]:
        """The pass's end as the worker counts it: a ``FinalStep``, or an ``ApprovalStep``
        for each step that waits for a person."""
        result = await _drive(self.agent, task, session, self.options)
        for step_id in result.awaiting:
            intent = next(
                Intent.from_json(e.payload)
                for e in await session.store.load_step(session.run_id, step_id)
                if e.phase is Phase.INTENT
            )
            yield ApprovalStep(
                run_id=session.run_id,
                step_id=step_id,
                call=ToolCall(name=intent.tool, arguments=intent.args),
                fingerprint=intent.fp,
            )
        if not result.awaiting:
            yield FinalStep(
                run_id=session.run_id,
                step_id=step_ids.FINAL,
                text=_shown(result.output),
                replayed=result.replayed,
                abandoned=result.abandoned,
            )


def _closed(agent: Agent[Any, Any], session: Session, final: StepEvent) -> DurableResult:
    """A closed run answers with what it recorded, and nothing runs."""
    payload = final.payload
    closed = Final.from_json(payload)
    if closed.abandoned:
        return DurableResult(
            run_id=session.run_id,
            output=None,
            messages=[],
            replayed=True,
            stats=session.stats,
            abandoned=True,
        )
    if _OUTPUT_KEY not in payload:
        raise UsageError(
            f"run {session.run_id!r} is closed without a Pydantic AI output "
            f"({closed.text!r}); it has nothing to hand back"
        )
    output = payload[_OUTPUT_KEY]
    kind = agent.output_type
    if isinstance(kind, type) and kind is not str:
        output = TypeAdapter(kind).validate_python(output)
    return DurableResult(
        run_id=session.run_id,
        output=output,
        messages=load_messages(payload.get(_MESSAGES_KEY)),
        replayed=True,
        stats=session.stats,
    )


@contextlib.contextmanager
def _unwrapped() -> Iterator[None]:
    """An asiento error raised inside the agent's task group comes out as itself."""
    try:
        yield
    except BaseExceptionGroup as group:
        mine = [e for e in _leaves(group) if isinstance(e, AsientoError)]
        if mine:
            raise mine[0] from group
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


class _FrameworkModel:
    """The ``Session``'s gateway slot: the framework's own model asks, never asiento's."""

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> Any:
        raise UsageError("a Pydantic AI run asks its model through the agent, not a gateway")


class _Run:
    """One pass over a Pydantic AI run: the journal as loaded, and what this pass adds."""

    def __init__(
        self,
        session: Session,
        lease: Lease,
        idempotent: frozenset[str],
        trusted: frozenset[str],
        journal: Indexed,
    ) -> None:
        self.session, self.lease, self.idempotent = session, lease, idempotent
        self.trusted = trusted
        self.run_id, self.store, self.stats = session.run_id, session.store, session.stats
        self.journal = journal
        self.turns = 0  # model requests made or replayed so far: the next is m{turns + 1}
        self.tool_steps: dict[str, str] = {}  # tool call id -> its step id
        self.tool_args: dict[str, dict[str, Any]] = {}  # tool call id -> the model's arguments

    async def append(self, *events: StepEvent, status: RunStatus | None = None) -> None:
        await self.store.append(*events, status=status, lease=self.lease)
        for event in events:
            self.journal.setdefault(event.step_id, {})[event.phase] = event

    def event(
        self, step_id: str, phase: Phase, payload: Any, decision: Decision | None = None
    ) -> StepEvent:
        return StepEvent(
            run_id=self.run_id, step_id=step_id, phase=phase, payload=payload, decision=decision
        )

    def boundary(self, step_id: str) -> None:
        """Before a step: stop here if a shutdown was requested (every record is durable:
        this integration writes each one before it goes on)."""
        if shutdown.requested():
            raise shutdown.ShutdownRequested(
                f"run {self.run_id!r} stopped before {step_id} because a shutdown was "
                "requested; every finished step is recorded and the run is resumable"
            )

    # -- model steps ---------------------------------------------------------------

    async def model_step(
        self,
        messages: list[ModelMessage],
        settings: ModelSettings | None,
        parameters: ModelRequestParameters,
        ask: Callable[[ModelSettings], Awaitable[FrameworkResponse]],
    ) -> FrameworkResponse:
        self.turns += 1
        step_id = step_ids.model(self.turns)
        self.boundary(step_id)
        fp = request_fingerprint(messages, settings, parameters)[:32]
        recorded = self.journal.get(step_id, {}).get(Phase.RESULT)
        if recorded is not None:
            response = self._replayed(step_id, fp, recorded, parameters)
        else:
            key = model_key(self.run_id, step_id, fp)
            keyed: dict[str, Any] = dict(settings or {})
            keyed["extra_headers"] = dict(keyed.get("extra_headers") or {}) | key_header(key)
            response = await ask(ModelSettings(**keyed))  # type: ignore[typeddict-item]
            crash_point("inside_model_call")
            self.stats.model_calls += 1
            self.stats.input_tokens += response.usage.input_tokens
            self.stats.output_tokens += response.usage.output_tokens
            tools = tool_digests(parameters) if step_id == step_ids.model(1) else None
            payload = model_payload(fp, response, tools)
            await self.append(self.event(step_id, Phase.RESULT, payload))
            crash_point("after_model_result")
        for number, (call_id, args) in enumerate(tool_calls(response), 1):
            self.tool_steps[call_id] = step_ids.tool(step_id, number)
            self.tool_args[call_id] = args
        return response

    def _replayed(
        self, step_id: str, fp: str, recorded: StepEvent, parameters: ModelRequestParameters
    ) -> FrameworkResponse:
        result = ModelResult.from_json(recorded.payload)
        if result.fp != fp:
            drift = None
            if result.tools is not None:
                drift = tool_drift(result.tools, tool_digests(parameters))
            raise ReplayDivergence(
                self.run_id,
                step_id,
                drift
                or f"the recorded request has fingerprint {result.fp[:12]}…, the resumed agent "
                f"would send {fp[:12]}… (its instructions, settings or history changed)",
            )
        response = recorded_response(recorded.payload, f"run {self.run_id!r} step {step_id!r}")
        self.stats.model_calls_replayed += 1
        self.stats.input_tokens_saved += result.response.usage.input_tokens
        self.stats.output_tokens_saved += result.response.usage.output_tokens
        return response

    # -- tool steps ----------------------------------------------------------------

    def is_idempotent(self, name: str, tool: ToolsetTool[Any] | None) -> bool:
        """Declared by the user, or by a trusted MCP server's annotations (docs/mcp.md)."""
        if name in self.idempotent:
            return True
        metadata = tool.tool_def.metadata if tool is not None else None
        if not isinstance(metadata, dict) or "annotations" not in metadata:
            return False  # not an MCP tool
        from ..mcp import treatment  # an MCP tool: the mcp extra is there

        trusted = tool is not None and tool.toolset.id in self.trusted
        return treatment(metadata["annotations"], trusted=trusted).idempotent

    async def tool_step(
        self,
        name: str,
        call_id: str | None,
        run: Callable[[], Awaitable[Any]],
        tool: ToolsetTool[Any] | None = None,
    ) -> Any:
        step_id = self.tool_steps.get(call_id or "")
        if step_id is None:
            raise UsageError(
                f"run {self.run_id!r}: Pydantic AI called tool {name!r} (call id {call_id!r}) "
                "outside any model answer this run recorded; asiento cannot journal it, and "
                "running it unjournaled would repeat it after a crash"
            )
        self.boundary(step_id)
        state = step_state(self.journal, step_id)
        records = state.records
        action = decide(records, idempotent=self.is_idempotent(name, tool))
        if action is Action.FEED_RESULT:
            self.stats.tool_calls_replayed += 1
            return _fed(Outcome.from_json(records[Phase.RESULT].payload))
        if action is Action.FEED_RESOLUTION:
            self.stats.tool_calls_replayed += 1
            return _fed(Resolution.from_json(records[Phase.RESOLUTION].payload).as_outcome())
        if action is Action.FEED_DENIAL:
            approval = records.get(Phase.APPROVAL)
            denial = (
                Approval.from_json(approval.payload).as_outcome()
                if approval is not None
                else Outcome.denied("policy", "denied by policy")
            )
            return denial.text()
        if action is Action.UNCERTAIN:
            if not await self.store.set_status(
                self.run_id,
                RunStatus.UNCERTAIN,
                lease=self.lease,
                waits_for=(state.current_id, Phase.RESOLUTION),
            ):  # a person resolved it after this pass read the journal: read it again
                self.journal = index(await self.store.load(self.run_id))
                return await self.tool_step(name, call_id, run, tool)
            raise UncertainEffect(
                self.run_id,
                state.current_id,
                name,
                "it was submitted and no outcome was recorded; it is not declared idempotent "
                "(durable_run(idempotent=...))",
            )
        if action is Action.AWAIT_APPROVAL:  # never written by this integration
            raise UsageError(
                f"run {self.run_id!r} step {step_id!r} waits for an approval; the Pydantic AI "
                "integration does not map approvals yet"
            )
        events: list[StepEvent] = []
        if action is Action.START:
            intent = self._intent(name, call_id or "")
            events.append(self.event(step_id, Phase.INTENT, intent.to_json(), Decision.ALLOW))
        attempt_id = state.next_id
        events.append(self.event(attempt_id, Phase.SUBMITTED, SUBMITTED))
        starting = action is Action.START
        if starting:
            crash_point("before_intent")
        await self.append(*events)
        if starting:
            crash_point("after_intent")
        crash_point("after_submitted")
        return await self._execute(step_id, attempt_id, name, run)

    def _intent(self, name: str, call_id: str) -> Intent:
        """The call frozen as the recorded answer asked for it: what a person approves."""
        frozen = to_jsonable_python(self.tool_args.get(call_id, {}))
        return Intent(tool=name, args=frozen, fp=fingerprint(frozen)[:32])

    async def decisions(
        self, requests: DeferredToolRequests
    ) -> tuple[DeferredToolResults | None, tuple[str, ...]]:
        """Pydantic AI deferred calls for approval: each is an asiento step awaiting one.

        New ones get their intent (``require_approval``, bound to the arguments'
        fingerprint) and the run is suspended on the first undecided step. When every
        one is decided, the decisions as Pydantic AI's ``DeferredToolResults``; the
        approved calls then run through ``tool_step``, which checks the approval again.
        """
        if requests.calls:
            names = ", ".join(c.tool_name for c in requests.calls)
            raise UsageError(
                f"run {self.run_id!r}: the agent deferred external tool calls ({names}); the "
                "Pydantic AI integration journals approvals, not calls answered outside the "
                "run, which it could not make exactly-once"
            )
        new: list[StepEvent] = []
        results = DeferredToolResults()
        awaiting: list[str] = []
        for call in requests.approvals:
            step_id = self.tool_steps.get(call.tool_call_id)
            if step_id is None:
                raise UsageError(
                    f"run {self.run_id!r}: tool call {call.tool_call_id!r} awaits approval but "
                    "no recorded answer holds it"
                )
            records = step_state(self.journal, step_id).records
            if Phase.INTENT not in records:
                intent = self._intent(call.tool_name, call.tool_call_id)
                event = self.event(
                    step_id, Phase.INTENT, intent.to_json(), Decision.REQUIRE_APPROVAL
                )
                new.append(event)
                records = {Phase.INTENT: event}
            action = decide(records, idempotent=call.tool_name in self.idempotent)
            if action is Action.AWAIT_APPROVAL:
                awaiting.append(step_id)
            elif action is Action.FEED_DENIAL:
                denial = Approval.from_json(records[Phase.APPROVAL].payload).as_outcome()
                results.approvals[call.tool_call_id] = ToolDenied(denial.text())
            else:
                results.approvals[call.tool_call_id] = True
        if new:
            await self.append(*new, status=RunStatus.SUSPENDED if awaiting else None)
        if not awaiting:
            return results, ()
        if not new and not await self.store.set_status(
            self.run_id,
            RunStatus.SUSPENDED,
            lease=self.lease,
            waits_for=(awaiting[0], Phase.APPROVAL),
        ):
            # A person decided after this pass read the journal: read it again. Each
            # round follows a new decision, so there are at most as many as steps.
            self.journal = index(await self.store.load(self.run_id))
            return await self.decisions(requests)
        return None, tuple(awaiting)

    async def _execute(
        self, step_id: str, attempt_id: str, name: str, run: Callable[[], Awaitable[Any]]
    ) -> Any:
        where = context.StepContext(
            run_id=self.run_id, step_id=step_id, attempt_id=attempt_id, tool=name
        )
        token = context.enter(where)
        try:
            value = await run()
        except ModelRetry as exc:  # the tool knows it did nothing: the model is asked again
            await self.append(self.event(attempt_id, Phase.RESULT, _retry(exc).to_json()))
            raise
        except (ApprovalRequired, CallDeferred) as exc:
            unsent = Resolution(
                happened=False, by="asiento", reason=f"the tool deferred itself: {exc!r}"[:500]
            )
            await self.append(self.event(attempt_id, Phase.RESOLUTION, unsent.to_json()))
            raise
        finally:
            context.leave(token)
        self.stats.tool_calls += 1
        crash_point("after_tool")
        outcome = Outcome.ok(to_jsonable_python(value))
        await self.append(self.event(attempt_id, Phase.RESULT, outcome.to_json()))
        crash_point("after_result")
        return value

    async def close(self, output: Any, messages: Sequence[ModelMessage]) -> None:
        final = Final(step=step_ids.model(self.turns), text=_shown(output)).to_json() | {
            _OUTPUT_KEY: to_jsonable_python(output),
            _MESSAGES_KEY: dump_messages(messages),
        }
        await self.append(self.event(step_ids.FINAL, Phase.RESULT, final), status=RunStatus.CLOSED)


_RETRY_PREFIX = "model_retry: "


def _retry(exc: ModelRetry) -> Outcome:
    return Outcome.failed(_RETRY_PREFIX + exc.message)


def _fed(outcome: Outcome) -> Any:
    """What a recorded outcome hands back to the agent: the value, or the recorded retry."""
    if outcome.status == "ok":
        return outcome.value
    if outcome.status == "error" and (outcome.error or "").startswith(_RETRY_PREFIX):
        raise ModelRetry((outcome.error or "")[len(_RETRY_PREFIX) :])
    return outcome.text()


def _shown(output: Any) -> str:
    """The output as ``asiento show`` prints a run's answer: text, or its canonical JSON."""
    return output if isinstance(output, str) else canonical_json(to_jsonable_python(output))


class _JournaledModel(WrapperModel):
    """The agent's model, with every request going through the run's journal."""

    def __init__(self, wrapped: Model, *, run: _Run) -> None:
        super().__init__(wrapped)
        self._run = run

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> FrameworkResponse:
        async def ask(settings: ModelSettings) -> FrameworkResponse:
            return await self.wrapped.request(messages, settings, model_request_parameters)

        return await self._run.model_step(messages, model_settings, model_request_parameters, ask)

    @contextlib.asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        raise UsageError(
            "a durable Pydantic AI run does not stream its model requests yet (run_stream, "
            "iter with node.stream, or an event_stream_handler); a streamed answer would not be "
            "journaled and would be paid again after a crash: use durable_run without streaming"
        )
        yield  # pragma: no cover


@dataclass
class _JournaledToolset(WrapperToolset[Any]):
    """One of the agent's toolsets, each call going through the run's journal first."""

    run: _Run | None = field(default=None, kw_only=True)

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        assert self.run is not None

        async def run() -> Any:
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)

        return await self.run.tool_step(name, ctx.tool_call_id, run, tool)
