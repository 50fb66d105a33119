"""One pass over a Pydantic AI run: its model requests and tool calls through the journal.

``Pass`` is what the wrapped model and toolsets of ``pydantic_ai.py`` call: model
request n is ``m{n}`` (replayed, or asked with its key and recorded), tool call k of
its answer is ``m{n}.t{k}`` (intent and submitted first, then ``replay.decide``), and
Pydantic AI's deferred approvals are asiento approvals.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_ai import DeferredToolRequests, DeferredToolResults, ToolDenied
from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelRetry
from pydantic_ai.messages import ModelMessage
from pydantic_ai.messages import ModelResponse as FrameworkResponse
from pydantic_ai.models import Model, ModelRequestParameters
from pydantic_ai.settings import ModelSettings
from pydantic_ai.toolsets import ToolsetTool
from pydantic_core import ValidationError, to_jsonable_python

from .. import context, outcomes, shutdown, step_ids
from .._canonical import fingerprint, idem_key, key_header, model_key
from .._crash import crash_point
from .._described import described
from ..errors import (
    AsientoError,
    ReplayDivergence,
    ToolAnswerLost,
    UncertainEffect,
    UsageError,
)
from ..events import Decision, Lease, Phase, RunStatus, StepEvent
from ..payloads import SUBMITTED, Approval, Final, Intent, ModelResult, Outcome, Resolution
from ..replay import Action, Indexed, decide, index, step_state, tool_drift
from ..session import Session
from ..telemetry import tracing
from ._commits import HeldCommits
from ._pydantic_ai_records import (
    dump_messages,
    is_mcp_tool,
    model_payload,
    recorded_response,
    request_fingerprint,
    tool_calls,
    tool_digests,
)
from ._pydantic_ai_replay import unit
from ._worker import shown

log = logging.getLogger("asiento")

OUTPUT_KEY = "pydantic_ai_output"
MESSAGES_KEY = "pydantic_ai_messages"


class Pass(HeldCommits):
    """One pass over a Pydantic AI run: the journal as loaded, and what this pass adds."""

    def __init__(
        self,
        session: Session,
        lease: Lease,
        idempotent: frozenset[str],
        trusted: frozenset[str],
        journal: Indexed,
        *,
        honours: Mapping[str, float | None] | None = None,
        trace: tracing.PassTrace | tracing.Off = tracing.OFF,
    ) -> None:
        super().__init__(session.run_id, session.store, lease, journal)
        self.trace = trace
        self.session, self.idempotent, self.stats = session, idempotent, session.stats
        self.trusted = trusted
        self.honours = dict(honours or {})  # MCP toolset id -> its server's key TTL
        self.keyed: set[int] = set()  # the MCP toolsets whose calls carry the key (id())
        self.turns = 0  # model requests made or replayed so far: the next is m{turns + 1}
        self.tool_steps: dict[str, str] = {}  # tool call id -> its step id
        self.tool_args: dict[str, dict[str, Any]] = {}  # tool call id -> the model's arguments
        self.running: dict[str, asyncio.Event] = {}  # tool steps submitting or executing now

    def boundary(self, step_id: str) -> None:
        """Before a step: stop here if a shutdown was requested (a held model answer is
        committed as the pass ends: ``settle``)."""
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
        model: Model | None = None,
    ) -> FrameworkResponse:
        self.turns += 1
        step_id = step_ids.model(self.turns)
        self.boundary(step_id)
        fp = request_fingerprint(messages, settings, parameters)[:32]
        recorded = self.journal.get(step_id, {}).get(Phase.RESULT)
        if recorded is not None:
            response = self._replayed(step_id, fp, recorded, parameters)
            unit(executed=False)  # Pydantic AI's chat span of it is not reported again
        else:
            await self.settle()  # an answer no tool followed (a retry of the output)
            key = model_key(self.run_id, step_id, fp)
            keyed: dict[str, Any] = dict(settings or {})
            headers = dict(keyed.get("extra_headers") or {}) | key_header(key)
            trace = self._step_trace(step_id)
            with trace.generating(
                step_id, *_model_names(model), lambda: (dump_messages(messages), None)
            ):
                carried = tracing.step_traceparent() or self.trace.framework_traceparent()
                keyed["extra_headers"] = headers | carried
                response = await ask(ModelSettings(**keyed))  # type: ignore[typeddict-item]
                crash_point("inside_model_call")
                self.stats.model_calls += 1
                self.stats.input_tokens += response.usage.input_tokens
                self.stats.output_tokens += response.usage.output_tokens
                unit(executed=True)
                tools = tool_digests(parameters) if step_id == step_ids.model(1) else None
                payload = model_payload(fp, response, tools)
                trace.answered(ModelResult.from_json(payload))
            self.hold(self.event(step_id, Phase.RESULT, payload))
        for number, (call_id, args) in enumerate(tool_calls(response), 1):
            self.tool_steps[call_id] = step_ids.tool(step_id, number)
            self.tool_args[call_id] = args
        return response

    def _step_trace(self, step_id: str) -> tracing.PassTrace | tracing.Off:
        """The trace a step's own span goes to: none when Pydantic AI's instrumentation has
        its span of the step open already (its ``chat`` or ``execute_tool``: the step's)."""
        return tracing.OFF if self.trace.framework_step(step_id) else self.trace

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

    def is_idempotent(self, name: str, tool: ToolsetTool[Any] | None, leaf: Any) -> bool:
        """Declared by the user, or by a trusted MCP server's annotations (docs/mcp.md);
        ``leaf``: the tool's MCP toolset (``_mcp_leaf``), whose id is the one trusted."""
        if name in self.idempotent:
            return True
        if tool is None or not is_mcp_tool(tool):
            return False
        from ..mcp import treatment  # an MCP tool: the mcp extra is there

        trusted = (leaf.id if leaf is not None else tool.toolset.id) in self.trusted
        annotations = (tool.tool_def.metadata or {})["annotations"]
        return treatment(annotations, trusted=trusted).idempotent

    @staticmethod
    def _mcp_leaf(tool: ToolsetTool[Any] | None) -> Any:
        """The MCP toolset ``tool``'s calls reach, or None (not an MCP tool, or behind a
        toolset asiento cannot see through)."""
        if tool is None or not is_mcp_tool(tool):
            return None
        from ._pydantic_ai_mcp import mcp_leaf

        return mcp_leaf(tool)

    async def tool_step(
        self,
        name: str,
        call_id: str | None,
        run: Callable[[], Awaitable[Any]],
        tool: ToolsetTool[Any] | None = None,
    ) -> Any:
        """One tool call as a journaled step. A stop (uncertain, a shutdown) waits for the
        sibling calls of the same answer already under way: Pydantic AI cancels them when
        this one raises, and one cut between its submission and its result would be one
        more uncertain step (a payment cut mid-way)."""
        try:
            return await self._tool_step(name, call_id, run, tool)
        except (UncertainEffect, shutdown.ShutdownRequested):
            await asyncio.gather(*(done.wait() for done in list(self.running.values())))
            raise

    async def _tool_step(
        self,
        name: str,
        call_id: str | None,
        run: Callable[[], Awaitable[Any]],
        tool: ToolsetTool[Any] | None,
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
        approved = Decision.APPROVED if Phase.APPROVAL in records else Decision.ALLOW
        mcp = self._mcp_leaf(tool)
        action = decide(records, idempotent=self.is_idempotent(name, tool, mcp))
        leaf = mcp if mcp is not None and id(mcp) in self.keyed else None  # carries the key
        key = None if leaf is None else _frozen_key(self.run_id, step_id, records)
        if action is Action.FEED_RESULT:
            self.stats.tool_calls_replayed += 1
            unit(executed=False)  # its execute_tool span is not reported again
            return _fed(Outcome.from_json(records[Phase.RESULT].payload))
        if action is Action.FEED_RESOLUTION:
            self.stats.tool_calls_replayed += 1
            unit(executed=False)
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
            await self.settle()
            settled = await self._reconcile(
                _Running(step_id, state.current_id, name, call_id or "", approved),
                run,
                leaf=leaf,
                key=key,
            )
            if isinstance(settled, _Settled):
                return settled.value
            if not await self.store.set_status(
                self.run_id,
                RunStatus.UNCERTAIN,
                lease=self.lease,
                waits_for=(state.current_id, Phase.RESOLUTION),
            ):  # a person resolved it after this pass read the journal: read it again
                self.journal = index(await self.store.load(self.run_id))
                return await self._tool_step(name, call_id, run, tool)
            self.trace.noted("asiento.effect.uncertain", state.current_id, name)
            raise UncertainEffect(self.run_id, state.current_id, name, settled)
        if action is Action.AWAIT_APPROVAL:  # never written by this integration
            raise UsageError(
                f"run {self.run_id!r} step {step_id!r} waits for an approval; the Pydantic AI "
                "integration does not map approvals yet"
            )
        events: list[StepEvent] = []
        if action is Action.START:
            intent = self._intent(name, call_id or "", step_id if leaf is not None else None)
            key = intent.idem_key
            events.append(self.event(step_id, Phase.INTENT, intent.to_json(), Decision.ALLOW))
        attempt_id = state.next_id
        events.append(self.event(attempt_id, Phase.SUBMITTED, SUBMITTED))
        starting = action is Action.START
        if starting:
            crash_point("before_intent")
        done = self.running[step_id] = asyncio.Event()
        try:
            await self.append(*events)
            if starting:
                crash_point("after_intent")
            crash_point("after_submitted")
            return await self._execute(
                _Running(step_id, attempt_id, name, call_id or "", approved),
                _keyed(key, run),
                mcp,
            )
        finally:
            done.set()
            del self.running[step_id]

    def _intent(self, name: str, call_id: str, keyed_step: str | None = None) -> Intent:
        """The call frozen as the recorded answer asked for it: what a person approves.

        ``keyed_step``: an MCP call carrying the key of that step, frozen here with it."""
        frozen = to_jsonable_python(self.tool_args.get(call_id, {}))
        key = None if keyed_step is None else idem_key(self.run_id, keyed_step, frozen)
        return Intent(tool=name, args=frozen, fp=fingerprint(frozen)[:32], idem_key=key)

    async def _reconcile(
        self, step: _Running, run: Callable[[], Awaitable[Any]], *, leaf: Any, key: str | None
    ) -> _Settled | str:
        """Submitted, no outcome, not idempotent: for an MCP call under the step's key, the
        server's record of it when its toolset is declared to honour keys and the key is
        live; else why not (for ``UncertainEffect``).

        The key's age is the store's, from the step's first submission (as for a native
        run's MCP tools)."""
        if leaf is None or key is None:
            return (
                "it was submitted and no outcome was recorded; it is not declared idempotent "
                "(durable_run(idempotent=...))"
            )
        from ._pydantic_ai_mcp import NotReconciled, may_ask_again, reconcile_call

        if leaf.id not in self.honours:
            return (
                f"it was submitted and no outcome was recorded; it is not declared idempotent, "
                f"and its MCP toolset {leaf.id!r} is not declared to deduplicate by key "
                "(durable_run(honours_keys={toolset id: key TTL}))"
            )
        step_id, attempt_id, name = step.step_id, step.attempt_id, step.name
        age = await self.store.age(self.run_id, step_id, Phase.SUBMITTED)
        try:
            may_ask_again(toolset_id=leaf.id, key_ttl=self.honours[leaf.id], age=age)
        except NotReconciled as exc:
            return str(exc)
        unit(executed=True)  # a call goes to the server: its span is reported
        trace = self._step_trace(step_id)
        args = self.tool_args.get(step.call_id, {})
        try:
            # Sent again: its own span (not the first call's id), however it ends.
            with trace.executing(step_id, attempt_id, name, step.call_id, args, resent=True):
                with self._in_step(step_id, attempt_id, name):
                    value, replayed = await reconcile_call(key, run, toolset_id=leaf.id)
                outcome = outcomes.bounded(to_jsonable_python(value))
                trace.executed(outcome, step.decision, reconciled=replayed)
        except NotReconciled as exc:
            return str(exc)
        except ModelRetry as exc:  # the recorded answer is the tool's error
            await self._keep_retry(attempt_id, exc)
            raise
        if replayed:
            self.stats.tool_calls_replayed += 1
        else:  # the first call never reached the server: this one did the work
            self.stats.tool_calls += 1
        return _Settled(await self._keep(attempt_id, value, outcome))

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
                self.trace.noted("asiento.approval.requested", step_id, call.tool_name)
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
        await self.settle()
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
        self, step: _Running, run: Callable[[], Awaitable[Any]], mcp: Any = None
    ) -> Any:
        unit(executed=True)  # the tool is called: its span is reported, however it ends
        trace = self._step_trace(step.step_id)
        args = self.tool_args.get(step.call_id, {})
        attempt_id, name = step.attempt_id, step.name
        retry: ModelRetry | None = None
        with trace.executing(step.step_id, attempt_id, name, step.call_id, args):
            try:
                value = await self._call(step, run, mcp)
            except ModelRetry as exc:  # recorded as the step's result: the model asks again
                trace.executed(_retry(exc), step.decision)
                retry = exc
            else:
                self.stats.tool_calls += 1
                outcome = outcomes.bounded(to_jsonable_python(value))
                trace.executed(outcome, step.decision)
        if retry is not None:
            raise retry
        return await self._keep(attempt_id, value, outcome)

    async def _call(self, step: _Running, run: Callable[[], Awaitable[Any]], mcp: Any) -> Any:
        """The tool's own call, in its step; what it raises, recorded as a native step would."""
        step_id, attempt_id, name = step.step_id, step.attempt_id, step.name
        try:
            with self._in_step(step_id, attempt_id, name):
                return await run()
        except ModelRetry as exc:  # the tool knows it did nothing: the model is asked again
            await self._keep_retry(attempt_id, exc)
            raise
        except (ApprovalRequired, CallDeferred) as exc:  # the tool did nothing: not yet
            unsent = Resolution(
                happened=False, by="asiento", reason=f"the tool deferred itself: {exc!r}"[:500]
            )
            await self.append(self.event(attempt_id, Phase.RESOLUTION, unsent.to_json()))
            if isinstance(exc, ApprovalRequired):  # approved, the call would run unasked
                raise UsageError(
                    f"run {self.run_id!r}: tool {name!r} asked for approval itself "
                    "(ApprovalRequired), which the journal cannot bind to a person's "
                    f"decision; declare it @agent.tool(requires_approval=True) or pass "
                    f"policy=require_approval_for({name!r}) to durable_run. It did not run."
                ) from exc
            raise
        except Exception as exc:
            ours = isinstance(exc, AsientoError)
            if mcp is not None and not ours:
                # The server's answer could not be read (Pydantic AI would tell the model
                # a ValidationError was its arguments' fault): it may have been applied.
                raise ToolAnswerLost(_unreadable(mcp, name, exc)) from exc
            if isinstance(exc, ValidationError):  # the tool's own: as Pydantic AI tells it,
                retry = ModelRetry(str(exc))  # a retry, recorded, so a replay tells the same
                await self._keep_retry(attempt_id, retry)
                raise retry from exc
            raise

    @contextlib.contextmanager
    def _in_step(self, step_id: str, attempt_id: str, name: str) -> Iterator[None]:
        """The tool's call runs in its step (``context.current_step()``, the MCP key)."""
        where = context.StepContext(
            run_id=self.run_id, step_id=step_id, attempt_id=attempt_id, tool=name
        )
        token = context.enter(where)
        try:
            yield
        finally:
            context.leave(token)

    async def _keep(self, attempt_id: str, value: Any, outcome: Outcome | None = None) -> Any:
        """The call's value recorded as the step's result, between a native step's crash
        points; handed back to the agent."""
        crash_point("after_tool")
        if outcome is None:
            outcome = outcomes.bounded(to_jsonable_python(value))
        await self.append(self.event(attempt_id, Phase.RESULT, outcome.to_json()))
        crash_point("after_result")
        return value if outcome.status == "ok" else _fed(outcome)  # as a replay hands back

    async def _keep_retry(self, attempt_id: str, exc: ModelRetry) -> None:
        await self.append(self.event(attempt_id, Phase.RESULT, _retry(exc).to_json()))

    async def close(self, output: Any, messages: Sequence[ModelMessage]) -> None:
        final = Final(step=step_ids.model(self.turns), text=shown(output)).to_json() | {
            OUTPUT_KEY: to_jsonable_python(output),
            MESSAGES_KEY: dump_messages(messages),
        }
        ended = self.trace.end("closed")  # its mark rides the final commit
        events = [self.event(step_ids.FINAL, Phase.RESULT, final)]
        await self.append_closing(self.session, *events, *([ended] if ended else []))


_RETRY_PREFIX = "model_retry: "


def _unreadable(mcp: Any, name: str, exc: Exception) -> str:
    return (
        f"MCP toolset {mcp.id!r}: the call of tool {name!r} failed after it was sent "
        f"({described(exc)}); its server may have applied it: the step stays submitted "
        "and is settled when the run is resumed"
    )


def _frozen_key(run_id: str, step_id: str, records: Mapping[Phase, StepEvent]) -> str | None:
    """The step's key as its intent froze it (an intent written without one, for an
    approval: the same ``idem_key`` of the frozen arguments); None before the intent."""
    recorded = records.get(Phase.INTENT)
    if recorded is None:
        return None
    frozen = Intent.from_json(recorded.payload)
    return frozen.idem_key or idem_key(run_id, step_id, dict(frozen.args))


def _keyed(key: str | None, run: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
    """``run`` with ``key`` in its MCP request's ``_meta`` (no key: ``run`` itself)."""
    if key is None:
        return run
    from ._pydantic_ai_mcp import call_keyed

    return functools.partial(call_keyed, key, run)


@dataclass(frozen=True, slots=True)
class _Running:
    """A tool step this pass runs: its ids, its tool, whether a person approved it."""

    step_id: str
    attempt_id: str
    name: str
    call_id: str
    decision: Decision


def _model_names(model: Model | None) -> tuple[str, str]:
    """The ``gen_ai.request.model`` and ``gen_ai.provider.name`` of Pydantic AI's ``model``."""
    if model is None:
        return "", "unknown"
    return model.model_name, model.system or tracing.provider_of(model)


@dataclass(frozen=True, slots=True)
class _Settled:
    """A reconciled step's value (a class, so a str value is not taken for a reason)."""

    value: Any


def _retry(exc: ModelRetry) -> Outcome:
    return Outcome.failed(_RETRY_PREFIX + exc.message)


def _fed(outcome: Outcome) -> Any:
    """What a recorded outcome hands back to the agent: the value, or the recorded retry."""
    if outcome.status == "ok":
        return outcome.value
    if outcome.status == "error" and (outcome.error or "").startswith(_RETRY_PREFIX):
        raise ModelRetry((outcome.error or "")[len(_RETRY_PREFIX) :])
    return outcome.text()
