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
  ``UncertainEffect`` for a person to resolve; an MCP tool's call carries the step's
  idempotency key, and one of a toolset declared ``honours_keys`` is reconciled by
  asking its server again under that key (``_pydantic_ai_mcp``);
- a closed run hands back its recorded output without running anything.

The run holds its lease through a ``Session`` and writes through the same
``Checkpointer`` calls as a native run, so ``asiento ls``, ``show``, ``resolve``
and ``abandon`` work on it unchanged. docs/integrations/pydantic-ai.md says what
this cannot make durable.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter
from pydantic_ai import Agent, DeferredToolRequests, RunContext
from pydantic_ai.messages import ModelMessage
from pydantic_ai.messages import ModelResponse as FrameworkResponse
from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse, infer_model
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset

from .._names import names
from ..effects.base import key_margin_of
from ..errors import (
    AsientoError,
    LeaseLost,
    UsageError,
)
from ..events import Lease, Step, StepEvent
from ..journal.base import Checkpointer
from ..model import ModelRequest
from ..payloads import (
    Final,
)
from ..replay import index
from ..session import RunStats, Session
from ..telemetry.tracing import Telemetry, telemetry_of
from ..tools import check_seconds
from ._pydantic_ai_pass import MESSAGES_KEY, OUTPUT_KEY, Pass
from ._pydantic_ai_records import (
    load_messages,
)
from ._pydantic_ai_replay import replayed_scope, uninstrumented
from ._traced import traced_pass
from ._worker import abandonment, pass_end, shown

__all__ = ["DurableResult", "WorkerAgent", "durable_run"]


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
    honours_keys: Mapping[str, float | None] | None = None,
    model: Model | str | None = None,
    deps: Any = None,
    message_history: Sequence[ModelMessage] | None = None,
    lease_ttl: float = 30.0,
    wait: float = 0.0,
    lease: Lease | None = None,
    telemetry: bool | Telemetry | None = None,
) -> DurableResult:
    """Drive ``agent`` on ``prompt`` as run ``run_id`` of ``store``, to its end.

    Call it again with the same arguments after a crash: what the journal holds is
    replayed, what is missing is done, each effect once or ``UncertainEffect``.
    ``idempotent`` names the tools that are safe to run again when a crash left their
    outcome unknown (every other tool is not, except an MCP tool whose annotations say
    so, from a server whose toolset ``id`` is in ``trusted_mcp``: the MCP table of
    docs/mcp.md). Every MCP call carries the step's idempotency key in its ``_meta``;
    ``honours_keys`` maps the ids of MCP toolsets whose servers deduplicate by it to
    how long they keep a key (seconds; None: forever), so a call a crash left without
    an outcome is asked again under the same key while the key is live, and the
    server's record of it is the outcome. ``lease`` is one a worker claimed.
    ``telemetry`` traces the run as ``Agent(telemetry=...)`` does a native one
    (docs/observability.md).
    """
    options = _options(
        agent, model, idempotent, trusted_mcp, honours_keys, deps, telemetry, who="durable_run"
    )
    if not isinstance(prompt, str):
        raise UsageError(f"durable_run(prompt=...) must be a str, got {type(prompt).__name__}")
    check_seconds(lease_ttl, "durable_run(lease_ttl=...)")  # named as the caller wrote it
    session = Session(run_id, _FrameworkModel(), store, lease_ttl=lease_ttl, wait=wait, lease=lease)
    return await _drive(agent, prompt, session, options, message_history)


@dataclass(frozen=True, slots=True)
class _Options:
    """How a run of the agent is driven, beside the agent itself."""

    model: Model | str
    idempotent: frozenset[str]
    trusted_mcp: frozenset[str]
    deps: Any
    honours_keys: Mapping[str, float | None] = field(default_factory=dict)
    telemetry: Telemetry | None = None


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
            events = await store.load(session.run_id)
            name = agent.name or "agent"
            async with traced_pass(options.telemetry, name, session, held, events) as traced:
                run = Pass(
                    session,
                    held,
                    options.idempotent,
                    options.trusted_mcp,
                    index(events),
                    honours=options.honours_keys,
                    trace=traced.trace,
                )
                ended = await _runs(agent, prompt, run, options, message_history)
                if ended.awaiting:
                    traced.status = "awaiting_approval"
                return ended
    except LeaseLost as exc:
        raise await abandonment(session, exc)  # noqa: B904 (the error itself, or its cause set)


async def _runs(
    agent: Agent[Any, Any],
    prompt: str,
    run: Pass,
    options: _Options,
    message_history: Sequence[ModelMessage] | None,
) -> DurableResult:
    """The pass's ``agent.run`` calls: one, and one more after each deferral the journal
    has decisions for; to the run's close or a stop for a person."""
    model, capabilities = uninstrumented(infer_model(options.model))
    wrapped = _JournaledModel(model, run=run)
    extra: dict[str, Any] = {"capabilities": capabilities} if capabilities else {}
    toolsets = [_JournaledToolset(_keyed(t, run), run=run) for t in agent.toolsets]
    asked: str | None = prompt
    history, decided = message_history, None
    stats = run.session.stats
    try:
        with (
            agent.override(model=wrapped, toolsets=toolsets, tools=[]),
            _unwrapped(),
            replayed_scope(),  # Pydantic AI's spans: none for what is replayed
        ):
            while True:  # each round ends at a deferral the journal has decisions for
                result = await agent.run(
                    asked,
                    deps=options.deps,
                    message_history=history,
                    deferred_tool_results=decided,
                    **extra,
                )
                if not isinstance(result.output, DeferredToolRequests):
                    break
                decided, awaiting = await run.decisions(result.output)
                if decided is None:
                    return DurableResult(
                        run_id=run.run_id,
                        output=None,
                        messages=result.all_messages(),
                        replayed=False,
                        stats=stats,
                        awaiting=awaiting,
                    )
                asked, history = None, result.all_messages()
        messages = result.all_messages()
        await run.close(result.output, messages)
    finally:
        await run.keep_paid_answer()
    return DurableResult(
        run_id=run.run_id, output=result.output, messages=messages, replayed=False, stats=stats
    )


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
        honours_keys: Mapping[str, float | None] | None = None,
        model: Model | str | None = None,
        deps: Any = None,
        telemetry: bool | Telemetry | None = None,
    ) -> None:
        self.options = _options(
            agent, model, idempotent, trusted_mcp, honours_keys, deps, telemetry, who="WorkerAgent"
        )
        self.agent = agent

    async def run(self, task: str, *, session: Session) -> AsyncIterator[Step]:
        """The pass's end as the worker counts it: a ``FinalStep``, or an ``ApprovalStep``
        for each step that waits for a person."""
        result = await _drive(self.agent, task, session, self.options)
        async for step in pass_end(
            session,
            list(result.awaiting),
            text=shown(result.output),
            replayed=result.replayed,
            abandoned=result.abandoned,
        ):
            yield step


def _options(  # noqa: PLR0917 (durable_run's and WorkerAgent's own arguments, in order)
    agent: Agent[Any, Any],
    model: Model | str | None,
    idempotent: Iterable[str],
    trusted_mcp: Iterable[str],
    honours_keys: Mapping[str, float | None] | None,
    deps: Any,
    telemetry: bool | Telemetry | None,
    *,
    who: str,
) -> _Options:
    """The arguments ``who`` (``durable_run``, ``WorkerAgent``) was given, checked."""
    if not isinstance(agent, Agent):
        raise UsageError(f"{who}() takes a pydantic_ai.Agent, got {agent!r}")
    chosen = model if model is not None else agent.model
    if chosen is None:
        raise UsageError(f"{who}(): the agent has no model; pass model=...")
    if not isinstance(chosen, Model | str):
        raise UsageError(
            f"{who}(model=...) takes a Pydantic AI Model or a model name such as "
            f"'openai:gpt-4.1', got {type(chosen).__name__} {chosen!r:.80}"
        )
    honours = _honours(honours_keys, who=who)
    traced = telemetry_of(telemetry, who)
    tools = names(idempotent, where=f"{who}(idempotent=...)")
    trusted = names(trusted_mcp, where=f"{who}(trusted_mcp=...)")
    return _Options(chosen, tools, trusted, deps, honours, traced)


def _honours(declared: Mapping[str, float | None] | None, *, who: str) -> dict[str, float | None]:
    """``honours_keys={toolset id: key TTL in seconds, or None for never forgotten}``, checked."""
    if declared is None:
        return {}
    if not isinstance(declared, Mapping):
        raise UsageError(
            f"{who}(honours_keys=...) takes a mapping of MCP toolset id to key TTL (seconds, "
            f"or None: keys never forgotten), got {type(declared).__name__}"
        )
    for toolset_id, ttl in declared.items():
        if not isinstance(toolset_id, str) or not toolset_id:
            raise UsageError(f"{who}(honours_keys=...): a toolset id is a str, got {toolset_id!r}")
        key_margin_of(ttl, None, who=f"{who}(honours_keys={{{toolset_id!r}: ...}})")
    return dict(declared)


def _keyed(toolset: AbstractToolset[Any], run: Pass) -> AbstractToolset[Any]:
    """``toolset`` with its MCP toolsets' calls carrying the step's key (none without
    Pydantic AI's MCP support installed: there can be no MCP toolset then)."""
    try:
        from ._pydantic_ai_mcp import keyed_toolset
    except ImportError:
        return toolset
    return keyed_toolset(toolset, run.keyed)


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
    if OUTPUT_KEY not in payload:
        raise UsageError(
            f"run {session.run_id!r} is closed without a Pydantic AI output "
            f"({closed.text!r}); it has nothing to hand back"
        )
    output = payload[OUTPUT_KEY]
    kind = agent.output_type
    if isinstance(kind, type) and kind is not str:
        output = TypeAdapter(kind).validate_python(output)
    return DurableResult(
        run_id=session.run_id,
        output=output,
        messages=load_messages(payload.get(MESSAGES_KEY)),
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


class _JournaledModel(WrapperModel):
    """The agent's model, with every request going through the run's journal."""

    def __init__(self, wrapped: Model, *, run: Pass) -> None:
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

        return await self._run.model_step(
            messages, model_settings, model_request_parameters, ask, self.wrapped
        )

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

    run: Pass | None = field(default=None, kw_only=True)

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        assert self.run is not None

        async def run() -> Any:
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)

        return await self.run.tool_step(name, ctx.tool_call_id, run, tool)
