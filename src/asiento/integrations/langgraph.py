"""LangGraph graphs, exactly-once on asiento's journal, without rewriting the graph.

    from asiento.integrations.langgraph import durable_run

    result = await durable_run(graph, {"messages": [("user", "refund order 42")]},
                               run_id="refund-42", store=store, idempotent=["lookup_order"])

Call it again with the same arguments after a crash: every chat-model call a node
made is read back from the journal (never asked, never paid again), every tool call
that has its outcome is not run again, a tool a crash left without one is run again
only if it is ``idempotent`` (else ``UncertainEffect``), and the graph goes on from
there. Each model request carries asiento's ``Idempotency-Key`` (``ChatOpenAI``,
``ChatAnthropic``), so ``asiento gateway`` answers a re-sent one from the generation
it kept. A changed graph (nodes, edges, a node's prompt, tools) is ``ReplayDivergence``.

How: the graph is run from its start at every pass, on a checkpointer of its own (in
memory, one per pass); the journal, not a checkpointer, is what happened. A graph
compiled with a checkpointer gets each ended pass's last checkpoint written there under
``thread_id`` = the run id, for ``get_state`` (``_langgraph_state``), never read back.
What a node does outside its model and tool calls runs again at each pass: keep effects
in tools.
A node's ``interrupt(value)`` is an asiento approval: the run is suspended, a person
approves or denies it (``asiento approve`` / ``deny``, the web page: bound to the value
shown), and the graph is resumed with ``{"approved": bool, "by": ..., "reason": ...}``.
Refused with a ``UsageError``, never silently at-least-once: subgraphs, two model calls
at once (parallel nodes, ``Send``), a node that streams a model itself (``astream``).
docs/integrations/langgraph.md.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from langchain_core.load import dumpd
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.pregel import Pregel
from langgraph.types import Command

from .. import step_ids
from .._canonical import fingerprint
from .._names import names
from ..errors import AsientoError, LeaseLost, UsageError
from ..events import Lease, Phase, Step, StepEvent
from ..journal.base import Checkpointer
from ..model import ModelRequest, ModelResponse
from ..payloads import Final
from ..policy import Policy
from ..replay import index
from ..session import RunStats, Session
from ..tools import check_seconds
from . import _langgraph_pass, _langgraph_state
from ._langgraph_pass import GraphPass, revive
from ._worker import abandonment, pass_end

__all__ = ["DurableResult", "WorkerAgent", "durable_run"]

Graph = Pregel[Any, Any, Any, Any]

log = logging.getLogger("asiento")

_STATE_KEY = "langgraph_state"
_MAX_INTERRUPTS = 10_000  # a graph answered more often than this in one pass loops
_langgraph_pass.install()


@dataclass(frozen=True, slots=True)
class DurableResult:
    """What a durable run of a graph ended with: the graph's final state (for a closed
    run, the recorded one), whether it was closed already (nothing ran), what this call
    paid and what the journal saved it from paying again. ``awaiting`` names the step
    of an ``interrupt()`` that waits for a person (``asiento approve`` / ``deny``): the
    run is suspended there and ``output`` is None; the next call after the decision
    resumes the graph with ``{"approved": bool, "by": ..., "reason": ...}``."""

    run_id: str
    output: Any
    replayed: bool
    stats: RunStats
    abandoned: bool = False
    awaiting: tuple[str, ...] = ()  # the interrupt() step a person must answer


async def durable_run(
    graph: Graph,
    input: Any,
    *,
    run_id: str,
    store: Checkpointer,
    idempotent: Iterable[str] = (),
    policy: Policy | None = None,
    config: Mapping[str, Any] | None = None,
    lease_ttl: float = 30.0,
    wait: float = 0.0,
    lease: Lease | None = None,
) -> DurableResult:
    """Run the compiled ``graph`` on ``input`` as run ``run_id`` of ``store``, to its end.

    ``idempotent`` names the tools safe to run again when a crash left their outcome
    unknown. ``policy`` (asiento's, e.g. ``require_approval_for("refund")``) decides
    each new tool call: allowed, denied (the model is told), or waiting for a person's
    approval (the run is suspended there; ``awaiting`` names the step). ``config`` is
    the graph's own (``recursion_limit``, ``configurable``...); a ``thread_id`` in it must
    be ``run_id``. ``lease`` is one a worker claimed.

    A graph compiled with a checkpointer gets the run's state written there, under
    ``thread_id`` = ``run_id``, when a pass ends closed or waiting for a person, so
    ``graph.get_state`` shows it; a pass never starts from it (the journal is the truth).
    """
    options = _Options.of(graph, idempotent, config, policy, who="durable_run")
    thread = (options.config.get("configurable") or {}).get("thread_id", run_id)
    if thread != run_id:
        raise UsageError(
            f"durable_run(config=...): thread_id {thread!r} is not the run id {run_id!r}; "
            "a durable run's thread is its run id (the graph's checkpointer shows its state "
            "under it): drop thread_id from config, or pass run_id=thread_id"
        )
    check_seconds(lease_ttl, "durable_run(lease_ttl=...)")  # named as the caller wrote it
    session = Session(run_id, _NoGateway(), store, lease_ttl=lease_ttl, wait=wait, lease=lease)
    return await _drive(graph, input, session, options)


@dataclass(frozen=True, slots=True)
class _Options:
    idempotent: frozenset[str]
    config: Mapping[str, Any]
    digest: str
    policy: Policy | None

    @classmethod
    def of(
        cls,
        graph: object,
        idempotent: Iterable[str],
        config: Mapping[str, Any] | None,
        policy: Policy | None,
        who: str,
    ) -> _Options:
        if not isinstance(graph, Pregel):
            raise UsageError(
                f"{who}(graph=...) takes a compiled LangGraph graph (builder.compile()), "
                f"got {type(graph).__name__}"
            )
        tools = names(idempotent, where=f"{who}(idempotent=...)")
        if config is not None and not isinstance(config, Mapping):
            raise UsageError(f"{who}(config=...) takes a mapping (RunnableConfig)")
        _check_configurable(dict(config or {}).get("configurable"), who)
        if policy is not None and not callable(policy):
            raise UsageError(f"{who}(policy=...) takes a policy (a callable of a ToolCall)")
        digest = _graph_digest(graph, who)
        _langgraph_state.check(graph, who)
        return cls(tools, dict(config or {}), digest, policy)


def _check_configurable(configurable: Any, who: str) -> None:
    """A checkpoint to start from is refused (a pass starts from the journal), and so is a
    worker's thread_id (each of its runs is the thread of its run id)."""
    if configurable is None:
        return
    if not isinstance(configurable, Mapping):
        raise UsageError(f"{who}(config=...): 'configurable' takes a mapping")
    if "checkpoint_id" in configurable:
        raise UsageError(
            f"{who}(config=...): checkpoint_id is refused: a durable run never starts from a "
            "checkpoint, it replays its journal; drop checkpoint_id"
        )
    if who == "WorkerAgent" and "thread_id" in configurable:
        raise UsageError(
            "WorkerAgent(config=...): thread_id is refused: each run a worker drives is the "
            "thread of its own run id; drop thread_id"
        )


def _graph_digest(graph: Graph, who: str) -> str:
    """The graph's shape, hashed: its nodes, edges, branches and the tools of its
    ToolNodes. A resumed run of another shape is ``ReplayDivergence`` at ``m1``."""
    builder = getattr(graph, "builder", None)
    nodes = getattr(builder, "nodes", None)
    if not isinstance(nodes, Mapping):
        raise UsageError(f"{who}(graph=...): only graphs built with StateGraph are supported")
    shape: dict[str, Any] = {"nodes": {}, "edges": sorted(map(list, getattr(builder, "edges", ())))}
    for name, spec in sorted(nodes.items()):
        runnable = getattr(spec, "runnable", None)
        if isinstance(runnable, Pregel):
            raise UsageError(
                f"{who}(graph=...): node {name!r} is a subgraph; subgraphs are not supported "
                "yet (their model and tool calls would run outside the journal's order)"
            )
        tools = getattr(runnable, "tools_by_name", None)
        shape["nodes"][name] = sorted(tools) if isinstance(tools, Mapping) else None
    branches = getattr(builder, "branches", {})
    shape["branches"] = {k: sorted(v) for k, v in sorted(branches.items())}
    return fingerprint(shape)


class _NoGateway:
    """A session's gateway for a graph: its own chat models ask their providers."""

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        raise UsageError("a LangGraph run asks its own chat models, not a gateway")


async def _drive(graph: Graph, input: Any, session: Session, options: _Options) -> DurableResult:
    store, run_id = session.store, session.run_id
    final = await store.final(run_id)
    if final is not None:
        await session.settle_closed()
        await _show_closed(graph, input, session, options, final)
        return _closed(run_id, session, final)
    try:
        async with session.driving() as held:
            journal = index(await store.load(run_id))
            run = GraphPass(
                run_id,
                store,
                held,
                journal,
                idempotent=options.idempotent,
                graph_digest=options.digest,
                stats=session.stats,
                policy=options.policy,
            )
            with run.active():
                try:
                    state, waiting, memory = await _walk(graph, input, run, options)
                    if waiting is not None:  # a tool call or an interrupt waits for a person
                        await _show_state(graph, memory, run_id, ended="suspended")
                        return DurableResult(
                            run_id=run_id,
                            output=None,
                            replayed=False,
                            stats=session.stats,
                            awaiting=(waiting,),
                        )
                except BaseException:
                    await run.keep_paid_answer()
                    raise
            last = step_ids.model(run.turns) if run.turns else step_ids.FINAL
            try:
                closing = Final(step=last, text=run.last_text).to_json() | {
                    _STATE_KEY: dumpd(state)
                }
                # The last model answer, held, rides this commit (one fsync a run fewer),
                # as a native run's does.
                await run.append_closing(session, run.event(step_ids.FINAL, Phase.RESULT, closing))
            except BaseException:  # the state cannot be recorded: the paid answer still is
                await run.keep_paid_answer()
                raise
            await _show_state(graph, memory, run_id, ended="closed")
    except LeaseLost as exc:
        raise await abandonment(session, exc)  # noqa: B904 (the error itself, or its cause set)
    return DurableResult(run_id=run_id, output=state, replayed=False, stats=session.stats)


async def _walk(
    graph: Graph, input: Any, run: GraphPass, options: _Options
) -> tuple[Any, str | None, InMemorySaver]:
    """Run the graph from its start under ``run``, through the interrupts a person
    answered: its state, the step waiting for a person (None), and its checkpoints."""
    memory = InMemorySaver()
    own = graph.copy(update={"checkpointer": memory})
    configurable = dict(options.config.get("configurable") or {})
    configurable["thread_id"] = f"asiento:{run.run_id}"
    config = cast("RunnableConfig", {**options.config, "configurable": configurable})
    state, waiting = await run.invoke(own, input, config)
    for _ in range(_MAX_INTERRUPTS):
        interrupts = state.get("__interrupt__") if isinstance(state, Mapping) else None
        if waiting is not None or not interrupts:
            break
        waiting, answer = await run.person(interrupts)
        if answer is not None:  # a person answered: the graph goes on
            state, waiting = await run.invoke(own, Command(resume=answer), config)
    return state, waiting, memory


async def _show_closed(
    graph: Graph, input: Any, session: Session, options: _Options, final: StepEvent
) -> None:
    """A closed run whose view in the graph's checkpointer is behind (its process died
    between the final record and the copy): replay the run from the journal, asking and
    running nothing, and write its last checkpoint there. Nothing if the view shows the
    close already, or the run was abandoned (its view stays at the last pass that ended)."""
    target = _langgraph_state.saver_of(graph)
    if target is None or Final.from_json(final.payload).abandoned:
        return
    run_id = session.run_id
    if await _langgraph_state.shows_closed(target, run_id):
        return
    run = GraphPass(
        run_id,
        session.store,
        Lease(run_id=run_id, token=0, owner="asiento:replay", expires=0.0),  # never written
        index(await session.store.load(run_id)),
        idempotent=options.idempotent,
        graph_digest=options.digest,
        stats=RunStats(),  # a replay for the view: the call's figures stay the journal's
        policy=options.policy,
        replaying=True,
    )
    try:
        with run.active():
            _, waiting, memory = await _walk(graph, input, run, options)
    except AsientoError as exc:  # a changed graph: ReplayDivergence
        log.warning(
            "run %r: get_state shows an earlier pass: the closed run could not be replayed "
            "for it: %s",
            run_id,
            exc,
        )
        return
    if waiting is None:
        recorded = final.payload.get(_STATE_KEY)
        values = revive(recorded) if recorded is not None else None
        shown = values if isinstance(values, Mapping) else None
        await _show_state(graph, memory, run_id, ended="closed", values=shown)


async def _show_state(
    graph: Graph,
    memory: InMemorySaver,
    run_id: str,
    *,
    ended: str,
    values: Mapping[str, Any] | None = None,
) -> None:
    """The pass's last checkpoint, written to the graph's own checkpointer if it has one
    (``values``: the state the journal recorded, for ``_langgraph_state.publish``)."""
    target = _langgraph_state.saver_of(graph)
    if target is not None:
        source = f"asiento:{run_id}"
        await _langgraph_state.publish(memory, source, target, run_id, ended=ended, values=values)


def _closed(run_id: str, session: Session, final: StepEvent) -> DurableResult:
    closed = Final.from_json(final.payload)
    state = final.payload.get(_STATE_KEY)
    output = revive(state) if state is not None else None
    return DurableResult(
        run_id=run_id, output=output, replayed=True, stats=session.stats, abandoned=closed.abandoned
    )


class WorkerAgent:
    """A graph as ``asiento worker`` drives it: ``App(agents={"support": WorkerAgent(graph)})``.

    ``input`` builds the graph's input from the run's task (by default a user message:
    ``{"messages": [("user", task)]}``). The app's gateway is not used: the graph's
    chat models ask their own providers.
    """

    def __init__(
        self,
        graph: Graph,
        *,
        input: Callable[[str], Any] | None = None,
        idempotent: Iterable[str] = (),
        policy: Policy | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.options = _Options.of(graph, idempotent, config, policy, who="WorkerAgent")
        self.graph = graph
        self.input = input or (lambda task: {"messages": [("user", task)]})

    async def run(self, task: str, *, session: Session) -> AsyncIterator[Step]:
        """The pass's end as the worker counts it: the ``FinalStep``."""
        result = await _drive(self.graph, self.input(task), session, self.options)
        text = ""
        final = await session.store.final(session.run_id)
        if final is not None:
            text = Final.from_json(final.payload).text
        async for step in pass_end(
            session,
            list(result.awaiting),
            text=text,
            replayed=result.replayed,
            abandoned=result.abandoned,
        ):
            yield step
