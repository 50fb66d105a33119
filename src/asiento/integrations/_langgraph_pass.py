"""One pass of a LangGraph graph on asiento's journal: every chat-model call and every
tool call inside it, wherever a node makes it, is a journaled step.

The graph runs as written. While a pass drives it, ``BaseChatModel.agenerate`` /
``generate`` and ``BaseTool.arun`` / ``run`` (what ``ainvoke``, ``invoke`` and
``ToolNode`` reach; a plain ``@tool`` function's ``ainvoke`` is journaled on the loop
before its thread starts, not from the thread) ask this pass first: a recorded
answer or outcome is handed back and nothing is asked or run again; a new one is
asked with asiento's idempotency key and recorded before the graph goes on. Outside
a pass the patched methods are LangChain's own, untouched.

Model steps are numbered in the order the graph asks them (``m1``, ``m2``...); a
tool call the model asked for is ``m{n}.t{k}`` by its place in the answer, a tool
a node calls directly is the next ``m{n}.t{k}`` after the last model step. Two model
calls at once (parallel nodes, ``Send``) have no deterministic order: refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from langchain_core._api.beta_decorator import LangChainBetaWarning
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.load import dumpd, load
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.tools import BaseTool, StructuredTool, Tool, ToolException
from langchain_core.tools.base import _prep_run_args

from .. import step_ids
from .._canonical import fingerprint, key_header, model_key
from .._crash import crash_point
from ..errors import JournalCorrupt, ReplayDivergence, UncertainEffect, UsageError
from ..events import Decision, Lease, Phase, RunStatus, StepEvent
from ..journal.base import Checkpointer
from ..model import ModelResponse, ToolCall, Usage
from ..outcomes import bounded
from ..payloads import INTERRUPT, Approval, Intent, ModelResult, Outcome, Resolution
from ..policy import Policy, ask_policy
from ..replay import Action, Indexed, StepState, check_approval, decide, index, step_state
from ..session import RunStats
from ._commits import HeldCommits
from ._langgraph_digests import Digests, jsonable, request_fingerprint

log = logging.getLogger("asiento")

FRAMEWORK_KEY = "langchain"
_ACTIVE: contextvars.ContextVar[GraphPass | None] = contextvars.ContextVar(
    "asiento_langgraph_pass", default=None
)
# Providers whose chat models send ``extra_headers`` with the request (the key reaches
# ``asiento gateway``); others are asked without it.
_HEADERS_BY = ("langchain_openai", "langchain_anthropic")


_TRACING = ("tags", "metadata", "run_name", "run_id")  # who traces a call, not what it asks


@dataclass(frozen=True, slots=True)
class Asked:
    """How a node asked a chat model, beside the messages: LangChain's callbacks and
    tracing keywords (passed on, not part of the request) and the request's own."""

    callbacks: Any
    traced: dict[str, Any]
    kwargs: dict[str, Any]

    @classmethod
    def split(cls, callbacks: Any, kwargs: dict[str, Any]) -> Asked:
        """``agenerate``'s keywords parted: who traces the call, and what it asks."""
        traced = {k: kwargs[k] for k in _TRACING if k in kwargs}
        return cls(callbacks, traced, {k: v for k, v in kwargs.items() if k not in traced})

    @property
    def node(self) -> str:
        metadata = self.traced.get("metadata") or {}
        return str(metadata.get("langgraph_node", "?"))


class _Suspended(BaseException):
    """A tool call waits for a person's approval: the pass stops there (a BaseException:
    no graph code, ToolNode's error handling included, catches it)."""

    def __init__(self, step_id: str) -> None:
        super().__init__(step_id)
        self.step_id = step_id


class _NotRecorded(BaseException):
    """A replaying pass (``GraphPass(replaying=True)``) reached a step the journal does not
    hold: it asks and runs nothing, and stops (a BaseException, as ``_Suspended``: no graph
    code catches it); ``GraphPass.invoke`` turns it into ``ReplayDivergence``."""

    def __init__(self, step_id: str) -> None:
        super().__init__(step_id)
        self.step_id = step_id


class _ReadOnly:
    """A store a replaying pass reads, and never writes: every write is ``_NotRecorded``."""

    def __init__(self, store: Checkpointer) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def append(self, *events: StepEvent, **_: Any) -> None:
        raise _NotRecorded(events[0].step_id if events else "?")

    async def set_status(self, run_id: str, status: RunStatus, **_: Any) -> bool:
        raise _NotRecorded(f"status {status}")


class GraphPass(HeldCommits):
    """The steps of one pass: what the journal holds, what this pass asks and runs."""

    def __init__(
        self,
        run_id: str,
        store: Checkpointer,
        lease: Lease,
        journal: Indexed,
        *,
        idempotent: frozenset[str],
        graph_digest: str,
        stats: RunStats,
        policy: Policy | None = None,
        replaying: bool = False,
    ) -> None:
        """``replaying``: the run is closed and this pass only replays it (for the graph's
        checkpointer): a step the journal lacks is ``ReplayDivergence``, never
        asked or run."""
        if replaying:
            store = cast("Checkpointer", _ReadOnly(store))
        super().__init__(run_id, store, lease, journal)
        self.replaying = replaying
        self.idempotent, self.graph_digest, self.stats = idempotent, graph_digest, stats
        self.policy = policy
        self.digests = Digests()  # what request_fingerprint hashed, for this pass
        self.turns = 0
        self.calls: dict[str, str] = {}  # a tool call's id -> its step id
        self.direct: dict[str, int] = {}  # a model step -> tool steps numbered after its calls
        self.asking = False
        self.last_text = ""
        self.loop = asyncio.get_running_loop()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    # -- model steps -------------------------------------------------------------------

    async def generate(
        self,
        model: BaseChatModel,
        prompts: Sequence[Sequence[BaseMessage]],
        stop: list[str] | None,
        asked: Asked,
    ) -> LLMResult:
        if self.asking:
            raise UsageError(
                f"run {self.run_id!r}: two chat-model calls at once (parallel nodes, Send, or "
                "a batch from two tasks): their order is not deterministic, so a resumed run "
                "could not tell which answer is whose; make the model calls sequential"
            )
        generations: list[list[ChatGeneration]] = []
        outputs: list[dict[str, Any] | None] = []
        self.asking = True
        try:
            for prompt in prompts:
                found, output = await self._step(model, list(prompt), stop, asked)
                generations.append(found)
                outputs.append(output)
        finally:
            self.asking = False
        merged = model._combine_llm_outputs(outputs)
        return LLMResult(generations=cast("list[list[Any]]", generations), llm_output=merged)

    async def _step(
        self, model: BaseChatModel, prompt: list[BaseMessage], stop: list[str] | None, asked: Asked
    ) -> tuple[list[ChatGeneration], dict[str, Any] | None]:
        self.turns += 1
        step_id = step_ids.model(self.turns)
        fp = request_fingerprint(model, prompt, stop, asked.kwargs, self.digests)[:32]
        recorded = self.journal.get(step_id, {}).get(Phase.RESULT)
        if recorded is not None:
            generations = self._replayed(step_id, fp, recorded, asked.node)
            output = None
        else:
            if self.replaying:
                raise _NotRecorded(step_id)
            await self.settle()  # an answer no tool followed: durable before the next ask
            key = model_key(self.run_id, step_id, fp)
            sent = dict(asked.kwargs) | asked.traced
            if type(model).__module__.split(".")[0] in _HEADERS_BY:
                sent["extra_headers"] = dict(sent.get("extra_headers") or {}) | key_header(key)
            result = await _ORIGINAL_AGENERATE(model, [prompt], stop, asked.callbacks, **sent)
            crash_point("inside_model_call")
            generations = [_chat(g) for g in result.generations[0]]
            output = result.llm_output
            self._count(generations)
            tools = {"graph": self.graph_digest} if step_id == step_ids.model(1) else None
            payload = model_payload(fp, generations, tools)
            if generations:  # the answer the next prompt holds: dumped once, not again
                self.digests.seed(generations[0].message, payload[FRAMEWORK_KEY][0]["message"])
            self.hold(self.event(step_id, Phase.RESULT, payload))
        self._note_calls(step_id, generations)
        return generations, output

    def _replayed(self, step_id: str, fp: str, recorded: Any, node: str) -> list[ChatGeneration]:
        result = ModelResult.from_json(recorded.payload)
        if step_id == step_ids.model(1) and result.tools is not None:
            was = result.tools.get("graph")
            if was is not None and was != self.graph_digest:
                raise ReplayDivergence(
                    self.run_id,
                    step_id,
                    "the graph changed since the run began (its nodes, edges or branches): "
                    f"recorded {was[:12]}…, now {self.graph_digest[:12]}…",
                )
        if result.fp != fp:
            raise ReplayDivergence(
                self.run_id,
                step_id,
                f"node {node!r} asks the model something else than it did (its prompt, its "
                f"messages, the model or its bound tools changed): recorded request "
                f"{result.fp[:12]}…, now {fp[:12]}…",
            )
        self.stats.model_calls_replayed += 1
        self.stats.input_tokens_saved += result.response.usage.input_tokens
        self.stats.output_tokens_saved += result.response.usage.output_tokens
        return recorded_generations(recorded.payload, f"run {self.run_id!r} step {step_id!r}")

    def _count(self, generations: Sequence[ChatGeneration]) -> None:
        self.stats.model_calls += 1
        usage = _usage(generations)
        self.stats.input_tokens += usage.input_tokens
        self.stats.output_tokens += usage.output_tokens

    def _note_calls(self, step_id: str, generations: Sequence[ChatGeneration]) -> None:
        message = generations[0].message if generations else None
        if isinstance(message, AIMessage):
            self.last_text = message.text
            for number, call in enumerate(message.tool_calls, 1):
                if call.get("id"):
                    self.calls[str(call["id"])] = step_ids.tool(step_id, number)
            self.direct[step_id] = len(message.tool_calls)

    # -- tool steps --------------------------------------------------------------------

    def tool_step_id(self, tool_call_id: str | None) -> str:
        """A call the model asked for has its place in the answer; a direct call the next."""
        if tool_call_id is not None and tool_call_id in self.calls:
            return self.calls[tool_call_id]
        last = step_ids.model(max(self.turns, 1))
        self.direct[last] = self.direct.get(last, 0) + 1
        return step_ids.tool(last, self.direct[last])

    async def tool_step(
        self, tool: BaseTool, tool_input: Any, tool_call_id: str | None, run: Any
    ) -> Any:
        """The tool's output: recorded, or run once now (``run``: the tool's own ``arun``)."""
        step_id = self.tool_step_id(tool_call_id)
        return await self._tool_step(step_id, tool, tool_input, tool_call_id, run)

    async def _tool_step(
        self, step_id: str, tool: BaseTool, tool_input: Any, tool_call_id: str | None, run: Any
    ) -> Any:
        state = step_state(self.journal, step_id)
        action = decide(state.records, idempotent=tool.name in self.idempotent)
        if action is Action.FEED_RESULT:
            self.stats.tool_calls_replayed += 1
            outcome = Outcome.from_json(state.records[Phase.RESULT].payload)
            return _fed(outcome, tool.name, tool_call_id)
        if action is Action.FEED_RESOLUTION:  # a person said what happened
            self.stats.tool_calls_replayed += 1
            resolution = Resolution.from_json(state.records[Phase.RESOLUTION].payload)
            return _fed(resolution.as_outcome(), tool.name, tool_call_id)
        if action is Action.UNCERTAIN:
            await self.settle()
            why = f"tool {tool.name!r} (step {state.current_id}) may or may not have run"
            if not await self.store.set_status(
                self.run_id,
                RunStatus.UNCERTAIN,
                reason=why,
                lease=self.lease,
                waits_for=(state.current_id, Phase.RESOLUTION),
            ):  # a person resolved it after this pass read the journal: read it again
                self.journal = index(await self.store.load(self.run_id))
                return await self._tool_step(step_id, tool, tool_input, tool_call_id, run)
            raise UncertainEffect(self.run_id, state.current_id, tool.name, "")
        if action is Action.AWAIT_APPROVAL:
            await self.settle()
            if not await self.store.set_status(
                self.run_id,
                RunStatus.SUSPENDED,
                lease=self.lease,
                waits_for=(step_id, Phase.APPROVAL),
            ):  # a person decided after this pass read the journal: read it again
                self.journal = index(await self.store.load(self.run_id))
                return await self._tool_step(step_id, tool, tool_input, tool_call_id, run)
            raise _Suspended(step_id)
        if action is Action.FEED_DENIAL:  # a person denied it: recorded, and the model told
            denial = Approval.from_json(state.records[Phase.APPROVAL].payload).as_outcome()
            await self.append(self.event(step_id, Phase.RESULT, denial.to_json(), Decision.DENIED))
            return _fed(denial, tool.name, tool_call_id)
        return await self._execute(
            state, action, tool, tool_input, tool_call_id=tool_call_id, run=run
        )

    async def _execute(
        self,
        state: StepState,
        action: Action,
        tool: BaseTool,
        tool_input: Any,
        *,
        tool_call_id: str | None,
        run: Any,
    ) -> Any:
        """A new call (the policy asked first) or one to run again: durable, run, recorded."""
        step_id = state.step_id
        args = tool_input if isinstance(tool_input, dict) else {"input": tool_input}
        attempt_id = state.next_id
        new = []
        if action is Action.START:
            crash_point("before_intent")
            intent = Intent(tool=tool.name, args=dict(args), fp=fingerprint(args)[:32])
            decision = await self._decision(tool.name, args)
            new.append(self.event(step_id, Phase.INTENT, intent.to_json(), decision))
            if decision is Decision.DENY:
                denied = Outcome.denied("policy", "denied by policy")
                await self.append(*new, self.event(step_id, Phase.RESULT, denied.to_json()))
                return _fed(denied, tool.name, tool_call_id)
            if decision is Decision.REQUIRE_APPROVAL:
                await self.append(*new, status=RunStatus.SUSPENDED)
                raise _Suspended(step_id)
        new.append(self.event(attempt_id, Phase.SUBMITTED, {}))
        await self.append(*new)
        crash_point("after_submitted")
        try:
            output = await run()
        except Exception as exc:
            await self.append(
                self.event(attempt_id, Phase.RESULT, Outcome.failed(str(exc)).to_json())
            )
            raise
        crash_point("after_tool")
        self.stats.tool_calls += 1
        try:
            stored = _stored(output, tool.name)
        except UsageError as exc:  # it ran: its step is failed, never run again blindly
            failed = Outcome.failed(str(exc)).to_json()
            await self.append(self.event(attempt_id, Phase.RESULT, failed))
            raise
        if isinstance(output, BaseMessage):  # the ToolMessage the next prompt holds
            self.digests.seed(output, stored[FRAMEWORK_KEY])
        outcome = bounded(stored)
        await self.append(self.event(attempt_id, Phase.RESULT, outcome.to_json()))
        crash_point("after_result")
        return output if outcome.status == "ok" else _fed(outcome, tool.name, tool_call_id)

    async def _decision(self, name: str, args: Mapping[str, Any]) -> Decision | None:
        """The policy's word on a new call (None: no policy, it runs)."""
        if self.policy is None:
            return None
        return await ask_policy(self.policy, ToolCall(name=name, arguments=dict(args)))

    async def invoke(self, graph: Any, value: Any, config: Any) -> tuple[Any, str | None]:
        """The graph's state after ``value`` (its input, or a ``Command`` resuming it), or
        the step where a tool call waits for a person's approval (the state then None).

        The graph keeps its own checkpoint only for an ``interrupt()`` to resume from,
        within this pass: ``durability="exit"``, never one a super-step."""
        try:
            return await graph.ainvoke(value, config, durability="exit"), None
        except _Suspended as stop:
            await self.settle()
            return None, stop.step_id
        except _NotRecorded as missing:
            raise self._unrecorded(missing) from None

    def _unrecorded(self, missing: _NotRecorded) -> ReplayDivergence:
        """What a replaying pass that reached a step the journal lacks raises."""
        why = "the closed run's journal does not hold this step"
        return ReplayDivergence(self.run_id, missing.step_id, why)

    # -- a person: interrupt() ------------------------------------------------------------

    async def person(self, interrupts: Sequence[Any]) -> tuple[str, dict[str, Any] | None]:
        """The step of the graph's ``interrupt()`` and a person's answer to it (None: the
        run waits for it, suspended, as for an approval: ``asiento approve`` / ``deny``)."""
        try:
            return await self._person(interrupts)
        except _NotRecorded as missing:
            raise self._unrecorded(missing) from None

    async def _person(self, interrupts: Sequence[Any]) -> tuple[str, dict[str, Any] | None]:
        if len(interrupts) != 1:
            raise UsageError(
                f"run {self.run_id!r}: {len(interrupts)} interrupts at once (parallel nodes): "
                "their order is not deterministic; interrupt from one node at a time"
            )
        asked = {"value": jsonable(interrupts[0].value)}
        fp = fingerprint(asked)[:32]
        step_id = self.tool_step_id(None)
        records = self.journal.get(step_id, {})
        intent = records.get(Phase.INTENT)
        if intent is None:
            frozen = Intent(tool=INTERRUPT, args=asked, fp=fp)
            event = self.event(step_id, Phase.INTENT, frozen.to_json(), Decision.REQUIRE_APPROVAL)
            await self.append(event, status=RunStatus.SUSPENDED)
            return step_id, None
        if Intent.from_json(intent.payload).fp != fp:
            raise ReplayDivergence(
                self.run_id,
                step_id,
                "the graph interrupts with another value than the one a person was shown",
            )
        approval = records.get(Phase.APPROVAL)
        if approval is None:
            await self.settle()
            if await self.store.set_status(
                self.run_id,
                RunStatus.SUSPENDED,
                lease=self.lease,
                waits_for=(step_id, Phase.APPROVAL),
            ):
                return step_id, None
            self.journal = index(await self.store.load(self.run_id))  # decided meanwhile
            approval = self.journal[step_id][Phase.APPROVAL]
        check_approval(intent, approval)
        decided = Approval.from_json(approval.payload)
        return step_id, {"approved": decided.approved, "by": decided.by, "reason": decided.reason}

    def call_soon(self, coroutine: Any) -> Any:
        """Run one of this pass's steps from a sync node's thread, on the pass's loop."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


# -- records ---------------------------------------------------------------------------


def model_payload(
    fp: str, generations: Sequence[ChatGeneration], tools: Mapping[str, str] | None
) -> dict[str, Any]:
    """A model step's record: asiento's view of the answer, and LangChain's own."""
    result = ModelResult(fp=fp, response=_asiento_view(generations), tools=tools)
    dumped = [
        {"message": dumpd(g.message), "generation_info": g.generation_info} for g in generations
    ]
    return result.to_json() | {FRAMEWORK_KEY: dumped}


def recorded_generations(payload: Mapping[str, Any], where: str) -> list[ChatGeneration]:
    dumped = payload.get(FRAMEWORK_KEY)
    if not isinstance(dumped, list):
        raise JournalCorrupt(f"{where}: the record holds no LangChain answer to replay")
    try:
        return [
            ChatGeneration(message=revive(g["message"]), generation_info=g.get("generation_info"))
            for g in dumped
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise JournalCorrupt(
            f"{where}: the recorded LangChain answer cannot be read: {exc}"
        ) from exc


def _asiento_view(generations: Sequence[ChatGeneration]) -> ModelResponse:
    message = generations[0].message if generations else AIMessage(content="")
    calls = [
        ToolCall(name=c["name"], arguments=dict(c.get("args") or {}), id=c.get("id") or "")
        for c in getattr(message, "tool_calls", ()) or ()
    ]
    model = str((message.response_metadata or {}).get("model_name", ""))
    return ModelResponse(
        text=message.text, tool_calls=calls, usage=_usage(generations), model=model
    )


def _usage(generations: Sequence[ChatGeneration]) -> Usage:
    message = generations[0].message if generations else None
    usage = getattr(message, "usage_metadata", None) or {}
    return Usage(
        input_tokens=int(usage.get("input_tokens", 0)),
        output_tokens=int(usage.get("output_tokens", 0)),
    )


def _chat(generation: Any) -> ChatGeneration:
    if not isinstance(generation, ChatGeneration):
        raise UsageError(f"a chat model answered {type(generation).__name__}, not a ChatGeneration")
    return generation


def _stored(output: Any, tool: str) -> Any:
    """A tool's output as JSON the journal keeps: LangChain objects by ``dumpd``."""
    if output is None or isinstance(output, str | int | float | bool | list | dict):
        return {"value": output}
    dumped = dumpd(output)
    if dumped.get("type") == "not_implemented":
        raise UsageError(
            f"tool {tool!r} returned a {type(output).__name__}, which LangChain cannot "
            "serialise: a resumed run could not hand it back; return text, JSON or a "
            "ToolMessage (a Command that updates the graph's state is not supported yet)"
        )
    return {FRAMEWORK_KEY: dumped}


def _fed(outcome: Outcome, tool: str, tool_call_id: str | None) -> Any:
    """What the graph is handed for a recorded outcome: the output the tool gave (a
    ``ToolMessage`` for a call the model asked for), or the tool's error."""
    if outcome.status == "denied":  # the model is told, as a native tool's denial
        if tool_call_id is None:
            return outcome.text()
        return ToolMessage(
            content=outcome.text(), tool_call_id=tool_call_id, name=tool, status="error"
        )
    if outcome.status != "ok":
        raise ToolException(outcome.error or outcome.reason or "the tool failed")
    value = outcome.value if isinstance(outcome.value, dict) else None
    if value is not None and FRAMEWORK_KEY in value:
        return revive(value[FRAMEWORK_KEY])
    plain = value.get("value") if value is not None and set(value) == {"value"} else outcome.value
    if tool_call_id is None:
        return plain
    content = plain if isinstance(plain, str) else json.dumps(plain, ensure_ascii=False)
    return ToolMessage(content=content, tool_call_id=tool_call_id, name=tool)


def revive(dumped: Any) -> Any:
    """A LangChain object back from its record (``dumpd``), core classes only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LangChainBetaWarning)  # load() is marked beta
        return load(dumped, allowed_objects="core")


# -- the patches -------------------------------------------------------------------------

_ORIGINAL_AGENERATE = BaseChatModel.agenerate
_ORIGINAL_GENERATE = BaseChatModel.generate
_ORIGINAL_ARUN = BaseTool.arun
_ORIGINAL_RUN = BaseTool.run
_ORIGINAL_STRUCTURED_AINVOKE = StructuredTool.ainvoke
_ORIGINAL_TOOL_AINVOKE = Tool.ainvoke
_ORIGINAL_ASTREAM = BaseChatModel.astream
_ORIGINAL_STREAM = BaseChatModel.stream
_STREAMS = (
    "a node streams a chat model itself (astream/stream) inside a durable LangGraph run: its "
    "answer would not be journaled; call ainvoke (the graph's stream_mode='messages' still "
    "streams tokens)"
)


async def _agenerate(
    self: BaseChatModel,
    messages: list[list[BaseMessage]],
    stop: list[str] | None = None,
    callbacks: Any = None,
    **kwargs: Any,
) -> LLMResult:
    run = _ACTIVE.get()
    if run is None:
        return await _ORIGINAL_AGENERATE(self, messages, stop, callbacks, **kwargs)
    return await run.generate(self, messages, stop, Asked.split(callbacks, kwargs))


def _generate(
    self: BaseChatModel,
    messages: list[list[BaseMessage]],
    stop: list[str] | None = None,
    callbacks: Any = None,
    **kwargs: Any,
) -> LLMResult:
    run = _ACTIVE.get()
    if run is None:
        return _ORIGINAL_GENERATE(self, messages, stop, callbacks, **kwargs)
    asked = run.generate(self, messages, stop, Asked.split(callbacks, kwargs))
    return cast("LLMResult", run.call_soon(asked))


async def _arun(self: BaseTool, tool_input: Any, *args: Any, **kwargs: Any) -> Any:
    run = _ACTIVE.get()
    if run is None:
        return await _ORIGINAL_ARUN(self, tool_input, *args, **kwargs)

    async def execute() -> Any:
        with _outside(run):  # a tool that calls a model runs as LangChain's own
            return await _ORIGINAL_ARUN(self, tool_input, *args, **kwargs)

    return await run.tool_step(self, tool_input, kwargs.get("tool_call_id"), execute)


def _run(self: BaseTool, tool_input: Any, *args: Any, **kwargs: Any) -> Any:
    run = _ACTIVE.get()
    if run is None:
        return _ORIGINAL_RUN(self, tool_input, *args, **kwargs)

    async def execute() -> Any:
        return await asyncio.to_thread(
            contextvars.Context().run, _ORIGINAL_RUN, self, tool_input, *args, **kwargs
        )

    return run.call_soon(run.tool_step(self, tool_input, kwargs.get("tool_call_id"), execute))


def _on_the_loop(original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``ainvoke`` of a tool without a coroutine (a plain ``@tool`` function), as a pass
    wants it: journaled here on the loop, then LangChain's own (``invoke`` on a worker
    thread, outside the pass). Left to itself, LangChain's would reach the patched ``run``
    on that thread, which would come back to the loop to journal the call and leave it
    again to run the function: three round trips between threads a call, not one."""

    async def ainvoke(self: Any, input: Any, config: Any = None, **kwargs: Any) -> Any:
        run = _ACTIVE.get()
        if self.coroutine or run is None:
            return await original(self, input, config, **kwargs)
        tool_input, prepared = _prep_run_args(input, config, **kwargs)

        async def execute() -> Any:
            with _outside(run):
                return await original(self, input, config, **kwargs)

        return await run.tool_step(self, tool_input, prepared.get("tool_call_id"), execute)

    return ainvoke


@contextlib.contextmanager
def _outside(run: GraphPass) -> Iterator[None]:
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _astream(self: BaseChatModel, *args: Any, **kwargs: Any) -> Any:
    if _ACTIVE.get() is not None:
        raise UsageError(_STREAMS)
    return _ORIGINAL_ASTREAM(self, *args, **kwargs)


def _stream(self: BaseChatModel, *args: Any, **kwargs: Any) -> Any:
    if _ACTIVE.get() is not None:
        raise UsageError(_STREAMS)
    return _ORIGINAL_STREAM(self, *args, **kwargs)


def install() -> None:
    """Route LangChain's chat models and tools through the pass driving them (once)."""
    BaseChatModel.agenerate = _agenerate  # type: ignore[method-assign]
    BaseChatModel.generate = _generate  # type: ignore[method-assign]
    BaseChatModel.astream = _astream  # type: ignore[method-assign]
    BaseChatModel.stream = _stream  # type: ignore[method-assign]
    BaseTool.arun = _arun  # type: ignore[method-assign]
    BaseTool.run = _run  # type: ignore[method-assign]
    StructuredTool.ainvoke = _on_the_loop(_ORIGINAL_STRUCTURED_AINVOKE)  # type: ignore[method-assign, assignment]
    Tool.ainvoke = _on_the_loop(_ORIGINAL_TOOL_AINVOKE)  # type: ignore[method-assign, assignment]
