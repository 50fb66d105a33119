"""A LangGraph graph on asiento's journal, in one process: replays instead of asking or
running again, the journal's records, divergence, and what is refused rather than run
at-least-once. Real processes killed with SIGKILL: test_langgraph_crashes.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Send

from asiento import (
    App,
    RecordTooLarge,
    ReplayDivergence,
    RunStatus,
    SqliteCheckpointer,
    UncertainEffect,
    UsageError,
    Worker,
    resolve,
    submit,
)
from asiento.events import Phase
from asiento.integrations.langgraph import WorkerAgent, durable_run
from asiento.testing import ScriptedGateway
from sqlite_files import record_commits

from .langgraph_graph import ASKED, TASK, ScriptedChat, build, lines, make_tools

INPUT = {"messages": [("user", TASK)]}


class _Crash(BaseException):
    """A process dying mid-step, as far as the pass can tell: nothing after it runs."""


@pytest.fixture(autouse=True)
def _fresh_count() -> None:
    ASKED.clear()


async def _run(graph: Any, path: Path, **kwargs: Any) -> Any:
    store = SqliteCheckpointer(path)
    try:
        return await durable_run(graph, INPUT, run_id="r1", store=store, **kwargs)
    finally:
        await store.close()


def _contents(state: Any) -> list[str]:
    return [str(m.content) for m in state["messages"]]


async def test_a_graph_runs_once_and_a_closed_run_replays_its_state(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    graph = build(ScriptedChat(), make_tools(ledger))
    first = await _run(graph, tmp_path / "j.db")
    assert _contents(first.output)[-1] == "refunded order 42 to ana"
    assert len(ASKED) == 3
    assert lines(ledger) == ["lookup 42", "refund 42 ana"]
    assert (first.stats.model_calls, first.stats.tool_calls) == (3, 2)
    again = await _run(graph, tmp_path / "j.db")
    assert again.replayed
    assert _contents(again.output) == _contents(first.output)
    assert len(ASKED) == 3
    assert lines(ledger) == ["lookup 42", "refund 42 ana"]
    store = SqliteCheckpointer(tmp_path / "j.db")
    ids = [(e.step_id, e.phase) for e in await store.load("r1")]
    [run] = await store.runs()
    await store.close()
    assert ids == [
        ("m1", Phase.RESULT),
        ("m1.t1", Phase.INTENT),
        ("m1.t1", Phase.SUBMITTED),
        ("m1.t1", Phase.RESULT),
        ("m2", Phase.RESULT),
        ("m2.t1", Phase.INTENT),
        ("m2.t1", Phase.SUBMITTED),
        ("m2.t1", Phase.RESULT),
        ("m3", Phase.RESULT),
        ("final", Phase.RESULT),
    ]
    assert run.status == RunStatus.CLOSED
    assert (run.model_calls, run.input_tokens) == (3, 33)


async def test_each_model_and_tool_step_costs_two_commits_and_the_close_one(
    tmp_path: Path,
) -> None:
    """As a native run: an answer rides with its tool's intent and submitted, the tool's
    outcome is one commit, and the last answer rides with the final record, which gives
    the lease up (no release of its own)."""
    store = SqliteCheckpointer(tmp_path / "j.db")
    try:
        commits = record_commits(store, every=True)
        graph = build(ScriptedChat(), make_tools(tmp_path / "ledger"))
        await durable_run(graph, INPUT, run_id="r1", store=store)
        info = await store.run("r1")
    finally:
        await store.close()
    # the lease, (m1, intent, submitted), result, (m2, intent, submitted), result,
    # (m3, final) with the release
    assert commits == [0, 3, 1, 3, 1, 2]
    assert info is not None
    assert (info.status, info.lease_owner) == (RunStatus.CLOSED, None)


async def test_a_final_state_too_large_keeps_the_last_answer_it_would_have_carried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graph's final state (every message) is over the journal's limit though each
    step's record is not: the pass fails with RecordTooLarge, and the last answer,
    which was to ride the final commit, is recorded alone, so the next pass fails the
    same way without paying for it again."""
    monkeypatch.setattr("asiento.journal.base.MAX_RECORD_BYTES", 50_000)

    @tool
    def lookup(order: int) -> str:
        """Look an order up (read-only)."""
        return "l" * 30_000

    @tool
    def refund(order: int, to: str) -> str:
        """Refund an order (an effect: once)."""
        return "r" * 30_000

    graph = build(ScriptedChat(), [lookup, refund])
    for passes in (1, 2):
        with pytest.raises(RecordTooLarge, match="final"):
            await _run(graph, tmp_path / "j.db", idempotent=["lookup"])
        store = SqliteCheckpointer(tmp_path / "j.db")
        try:
            records = [(e.step_id, e.phase) for e in await store.load("r1")]
        finally:
            await store.close()
        assert records[-1] == ("m3", Phase.RESULT), passes
        assert ASKED == [0, 1, 2], passes  # each answer paid once


async def test_a_pass_cut_between_super_steps_replays_what_it_recorded(tmp_path: Path) -> None:
    """A node after the refund fails once (a crash between super-steps): the next pass
    replays both model answers and both tools, asks only the third answer."""
    ledger = tmp_path / "ledger"
    tools = make_tools(ledger)
    failed = {"once": False}

    def audit(state: MessagesState) -> dict[str, Any]:
        if not failed["once"] and any("issued" in str(m.content) for m in state["messages"]):
            failed["once"] = True
            raise RuntimeError("the audit service is down")
        return {}

    bound = ScriptedChat().bind_tools(tools)

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    from langgraph.prebuilt import ToolNode, tools_condition

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode(tools))
    builder.add_node("audit", audit)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: END})
    builder.add_edge("tools", "audit")
    builder.add_edge("audit", "agent")
    graph = builder.compile()
    with pytest.raises(RuntimeError, match="audit service"):
        await _run(graph, tmp_path / "j.db")
    assert (len(ASKED), lines(ledger)) == (2, ["lookup 42", "refund 42 ana"])
    resumed = await _run(graph, tmp_path / "j.db")
    assert _contents(resumed.output)[-1] == "refunded order 42 to ana"
    assert ASKED == [0, 1, 2]  # the third answer only
    assert lines(ledger) == ["lookup 42", "refund 42 ana"]
    assert (resumed.stats.model_calls_replayed, resumed.stats.tool_calls_replayed) == (2, 2)


async def test_an_effect_cut_before_its_record_is_uncertain_and_a_person_settles_it(
    tmp_path: Path,
) -> None:
    """The refund ran and the process died before its outcome was recorded: never run
    again blindly (UncertainEffect); resolved by a person, the graph goes on from there.
    The read-only lookup, cut the same way and declared idempotent, just runs again."""
    ledger = tmp_path / "ledger"
    lookup, refund = make_tools(ledger)
    cut = {"lookup": 1, "refund": 1}
    real = {"lookup": lookup.func, "refund": refund.func}

    def dying(name: str) -> Any:
        def run(**kwargs: Any) -> str:
            out = real[name](**kwargs)  # type: ignore[operator]
            if cut[name]:
                cut[name] -= 1
                raise _Crash
            return str(out)

        return run

    lookup.func, refund.func = dying("lookup"), dying("refund")  # type: ignore[attr-defined]
    graph = build(ScriptedChat(), [lookup, refund])
    path = tmp_path / "j.db"
    with pytest.raises(_Crash):
        await _run(graph, path, idempotent=["lookup"])
    with pytest.raises(_Crash):  # the lookup ran again (idempotent), then the refund died
        await _run(graph, path, idempotent=["lookup"])
    assert lines(ledger) == ["lookup 42", "lookup 42", "refund 42 ana"]
    with pytest.raises(UncertainEffect) as stopped:
        await _run(graph, path, idempotent=["lookup"])
    assert stopped.value.step_id == "m2.t1"
    assert lines(ledger) == ["lookup 42", "lookup 42", "refund 42 ana"]  # never again
    store = SqliteCheckpointer(path)
    [run] = await store.runs()
    assert run.status == RunStatus.UNCERTAIN
    await resolve(store, "r1", "m2.t1", happened=True, result="refund issued", by="ana")
    await store.close()
    done = await _run(graph, path, idempotent=["lookup"])
    assert _contents(done.output)[-1] == "refunded order 42 to ana"
    assert lines(ledger) == ["lookup 42", "lookup 42", "refund 42 ana"]


async def test_a_changed_graph_or_prompt_is_a_divergence_naming_it(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    tools = make_tools(ledger)
    path = tmp_path / "j.db"
    failing = build(ScriptedChat(), tools)
    await _run(failing, path)  # closed; a new run id for the resumes below
    store = SqliteCheckpointer(path)
    await store.close()

    async def resumed(graph: Any) -> Any:
        store = SqliteCheckpointer(path)
        try:
            return await durable_run(graph, INPUT, run_id="r2", store=store)
        finally:
            await store.close()

    # r2 stops after m1 (a crash in the lookup), then is resumed by changed graphs
    lookup, refund = make_tools(ledger)
    original = lookup.func

    def crash(**kwargs: Any) -> str:
        raise _Crash

    lookup.func = crash  # type: ignore[attr-defined]
    with pytest.raises(_Crash):
        await resumed(build(ScriptedChat(), [lookup, refund]))
    lookup.func = original  # type: ignore[attr-defined]
    with pytest.raises(ReplayDivergence, match=r"node 'agent' asks the model something else"):
        await resumed(build(ScriptedChat(), [lookup, refund], system="You refund any order."))
    other = build(ScriptedChat(), [lookup, refund])
    other.builder.add_node("extra", lambda state: {})
    with pytest.raises(ReplayDivergence, match=r"the graph changed since the run began"):
        await resumed(other.builder.compile())


async def test_what_cannot_be_exactly_once_is_refused(tmp_path: Path) -> None:
    tools = make_tools(tmp_path / "ledger")
    inner = build(ScriptedChat(), tools)
    outer = StateGraph(MessagesState)
    outer.add_node("inner", inner)
    outer.add_edge(START, "inner")
    with pytest.raises(UsageError, match=r"node 'inner' is a subgraph"):
        await _run(outer.compile(), tmp_path / "a.db")

    model = ScriptedChat()

    async def ask(state: dict[str, Any]) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    def fan_out(state: MessagesState) -> list[Send]:
        return [Send("ask", {"messages": state["messages"]}) for _ in range(2)]

    fan = StateGraph(MessagesState)
    fan.add_node("ask", ask)
    fan.add_conditional_edges(START, fan_out, ["ask"])
    with pytest.raises(UsageError, match=r"two chat-model calls at once"):
        await _run(fan.compile(), tmp_path / "b.db")

    async def streams(state: MessagesState) -> dict[str, Any]:
        parts = [chunk async for chunk in model.astream(state["messages"])]
        return {"messages": [AIMessage(content="".join(str(p.content) for p in parts))]}

    streaming = StateGraph(MessagesState)
    streaming.add_node("streams", streams)
    streaming.add_edge(START, "streams")
    with pytest.raises(UsageError, match=r"a node streams a chat model itself"):
        await _run(streaming.compile(), tmp_path / "c.db")
    with pytest.raises(UsageError, match=r"takes a compiled LangGraph graph"):
        await _run(object(), tmp_path / "d.db")
    # A string where tool names go: its letters would be read as names, so it is refused.
    plain = build(ScriptedChat(), tools)
    with pytest.raises(UsageError, match=r"idempotent=\.\.\.\) takes names .*got str 'lookup'"):
        await _run(plain, tmp_path / "e.db", idempotent="lookup")
    with pytest.raises(UsageError, match=r"non-empty str names, got 3"):
        await _run(plain, tmp_path / "e.db", idempotent=["lookup", 3])
    with pytest.raises(UsageError, match=r"durable_run\(lease_ttl=\.\.\.\) takes seconds"):
        await _run(plain, tmp_path / "e.db", lease_ttl="30")


async def test_a_tool_called_inside_a_node_is_a_step_too(tmp_path: Path) -> None:
    """A node that calls a tool directly (no ToolNode, no model tool call) gets its own
    step after the last model step, replayed like any other."""
    ledger = tmp_path / "ledger"
    _, refund = make_tools(ledger)

    async def pay(state: MessagesState) -> dict[str, Any]:
        out = await refund.ainvoke({"order": 7, "to": "bo"})
        return {"messages": [AIMessage(content=str(out))]}

    failed = {"once": False}

    def after(state: MessagesState) -> dict[str, Any]:
        if not failed["once"]:
            failed["once"] = True
            raise RuntimeError("cut")
        return {}

    builder = StateGraph(MessagesState)
    builder.add_node("pay", pay)
    builder.add_node("after", after)
    builder.add_edge(START, "pay")
    builder.add_edge("pay", "after")
    graph = builder.compile()
    with pytest.raises(RuntimeError):
        await _run(graph, tmp_path / "j.db")
    done = await _run(graph, tmp_path / "j.db")
    assert lines(ledger) == ["refund 7 bo"]
    assert _contents(done.output)[-1] == "refund of order 7 to bo issued"
    store = SqliteCheckpointer(tmp_path / "j.db")
    assert [e.step_id for e in await store.load("r1")][:3] == ["m1.t1"] * 3
    await store.close()


async def test_a_worker_drives_a_graph(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    store = SqliteCheckpointer(tmp_path / "j.db")
    app = App(
        agents={"support": WorkerAgent(build(ScriptedChat(), make_tools(ledger)))},
        gateway=ScriptedGateway([]),  # unused: the graph's model asks for itself
    )
    await submit(store, "w1", TASK, agent="support")
    worker = Worker(store, app, poll=0.01)
    await asyncio.wait_for(worker.run(until_idle=True, max_seconds=20), 30)
    [run] = await store.runs()
    final = await store.final("w1")
    await store.close()
    assert run.status == RunStatus.CLOSED
    assert final is not None
    assert final.payload["text"] == "refunded order 42 to ana"
    assert worker.stats.closed == 1
    assert lines(ledger) == ["lookup 42", "refund 42 ana"]


def _confirming_graph(ledger: Path) -> Any:
    """A node asks a person before the refund (``interrupt``) and tells the model a
    denial; the refund tool runs only when approved."""
    from langgraph.types import interrupt

    _, refund = make_tools(ledger)
    model = ScriptedChat()

    async def confirm(state: MessagesState) -> dict[str, Any]:
        answer = interrupt({"refund": 42, "to": "ana", "amount": "30 EUR"})
        if not answer["approved"]:
            note = f"the refund was denied by {answer['by']}: {answer['reason']}"
            return {"messages": [("user", note)]}
        done = await refund.ainvoke({"order": 42, "to": "ana"})
        return {"messages": [("user", str(done))]}

    async def answer(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("confirm", confirm)
    builder.add_node("answer", answer)
    builder.add_edge(START, "confirm")
    builder.add_edge("confirm", "answer")
    builder.add_edge("answer", END)
    return builder.compile()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "asiento", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("decision", ["approve", "deny"])
async def test_an_interrupt_is_an_approval_decided_from_the_cli_in_another_process(
    tmp_path: Path, decision: str
) -> None:
    ledger, path = tmp_path / "ledger", tmp_path / "j.db"
    graph = _confirming_graph(ledger)
    waiting = await _run(graph, path)
    assert waiting.awaiting == ("m1.t1",)
    assert waiting.output is None
    store = SqliteCheckpointer(path)
    [run] = await store.runs()
    await store.close()
    assert run.status == RunStatus.SUSPENDED
    again = await _run(graph, path)  # nobody decided: still waiting, nothing ran
    assert again.awaiting == ("m1.t1",)
    assert lines(ledger) == []
    shown = _cli("show", "r1", "--store", str(path))
    said = " ".join(shown.stdout.split())  # the terminal's width may wrap the line
    asked = 'the graph\'s interrupt() asks {"refund":42, "to":"ana", "amount":"30 EUR"}'
    assert f"awaiting approval: m1.t1 {asked}" in said, shown.stdout
    assert '{"value"' not in shown.stdout  # the journal's wrapping is not shown
    extra = ["--reason", "over the limit"] if decision == "deny" else []
    decided = _cli(decision, "r1", "m1.t1", "--by", "ana", *extra, "--store", str(path))
    assert decided.returncode == 0, decided.stderr
    assert "asked by     the graph's interrupt()" in decided.stdout, decided.stdout
    assert '"amount": "30 EUR"' in decided.stdout
    done = await _run(graph, path)
    assert done.awaiting == ()
    said = _contents(done.output)
    if decision == "approve":
        assert lines(ledger) == ["refund 42 ana"]
        assert "refund of order 42 to ana issued" in said
    else:
        assert lines(ledger) == []
        assert "the refund was denied by ana: over the limit" in said
    assert len(ASKED) == 1  # the model answered once, after the person
    closed = await _run(graph, path)
    assert closed.replayed
    assert lines(ledger) == (["refund 42 ana"] if decision == "approve" else [])


@pytest.mark.parametrize("decision", ["approve", "deny"])
async def test_a_tool_the_policy_holds_waits_for_a_person_then_runs_once_or_is_denied(
    tmp_path: Path, decision: str
) -> None:
    """policy=require_approval_for("refund"): the ToolNode's refund call stops the run
    (suspended, the call's arguments frozen); approved it runs once, denied the model
    is told and the refund never runs."""
    from asiento import approve, deny, require_approval_for

    ledger, path = tmp_path / "ledger", tmp_path / "j.db"
    graph = build(ScriptedChat(), make_tools(ledger))
    policy = require_approval_for("refund")
    waiting = await _run(graph, path, policy=policy)
    assert waiting.awaiting == ("m2.t1",)
    assert lines(ledger) == ["lookup 42"]
    store = SqliteCheckpointer(path)
    [run] = await store.runs()
    assert run.status == RunStatus.SUSPENDED
    if decision == "approve":
        await approve(store, "r1", "m2.t1", by="ana")
    else:
        await deny(store, "r1", "m2.t1", by="ana", reason="over the limit")
    await store.close()
    done = await _run(graph, path, policy=policy)
    said = _contents(done.output)
    if decision == "approve":
        assert lines(ledger) == ["lookup 42", "refund 42 ana"]
        assert "refund of order 42 to ana issued" in said
    else:
        assert lines(ledger) == ["lookup 42"]
        assert "denied: over the limit" in said
    assert said[-1] == "refunded order 42 to ana"  # the script's last turn either way
    assert ASKED == [0, 1, 2]
    again = await _run(graph, path, policy=policy)
    assert again.replayed


async def test_a_call_the_policy_denies_never_runs_and_the_model_is_told(tmp_path: Path) -> None:
    from asiento import Decision

    ledger, path = tmp_path / "ledger", tmp_path / "j.db"
    graph = build(ScriptedChat(), make_tools(ledger))

    def policy(call: Any) -> Decision:
        return Decision.DENY if call.name == "refund" else Decision.ALLOW

    done = await _run(graph, path, policy=policy)
    assert lines(ledger) == ["lookup 42"]
    assert "denied: denied by policy" in _contents(done.output)
    store = SqliteCheckpointer(path)
    intent = [e for e in await store.load_step("r1", "m2.t1") if e.phase is Phase.INTENT]
    await store.close()
    assert intent[0].decision == Decision.DENY
