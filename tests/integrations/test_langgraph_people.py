"""A person and a LangGraph run, across processes: an ``interrupt()`` decided on the web
page (``asiento serve`` in its own process, over real HTTP), and ``asiento abandon`` from
another process while a pass is inside a node."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.messages import BaseMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import interrupt

from asiento import RunAbandoned, RunStatus, SqliteCheckpointer
from asiento.events import Phase
from asiento.integrations.langgraph import DurableResult, durable_run
from web.test_access import TOKEN, serving

from .langgraph_graph import ASKED, TASK, ScriptedChat, build, lines, make_tools

INPUT = {"messages": [("user", TASK)]}
WAIT = 30.0  # seconds any one wait in these tests may take before it fails


@pytest.fixture(autouse=True)
def _fresh_count() -> None:
    ASKED.clear()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "asiento", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


async def _run(graph: Any, path: Path, run_id: str = "r1") -> DurableResult:
    store = SqliteCheckpointer(path)
    try:
        return await durable_run(graph, INPUT, run_id=run_id, store=store)
    finally:
        await store.close()


def _said(result: DurableResult) -> list[str]:
    return [str(m.content) for m in result.output["messages"]]


# -- an interrupt() decided on the web page ------------------------------------------------

ASKS = {"refund": 42, "to": "<i>ana</i> & co", "amount": "30 EUR"}  # markup: shown as text


def confirming_graph(ledger: Path, checkpointer: Any = None) -> Any:
    """A node asks a person before the refund (``interrupt``) and says what it was told;
    the refund tool runs only when approved."""
    _, refund = make_tools(ledger)
    model = ScriptedChat()

    async def confirm(state: MessagesState) -> dict[str, Any]:
        answer = interrupt(ASKS)
        told = f"approved={answer['approved']} by={answer['by']} reason={answer['reason']}"
        if answer["approved"]:
            told += "; " + str(await refund.ainvoke({"order": 42, "to": "ana"}))
        return {"messages": [("user", told)]}

    async def answer(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("confirm", confirm)
    builder.add_node("answer", answer)
    builder.add_edge(START, "confirm")
    builder.add_edge("confirm", "answer")
    builder.add_edge("answer", END)
    return builder.compile(checkpointer=checkpointer)


def _card(html: str, run_id: str) -> str:
    """The approval card of ``run_id``'s waiting step on a page, up to its form's end."""
    card = re.search(rf'<div class="card approval" id="wait-{run_id}-.*?</form>', html, re.S)
    assert card is not None, f"no approval card for {run_id!r}"
    return card.group(0)


def _card_form(html: str, run_id: str) -> dict[str, str]:
    """The hidden fields of the card's form, as the page rendered them (what a person's
    browser would post)."""
    fields = re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', _card(html, run_id))
    return dict(fields)


async def _approvals(path: Path, run_id: str) -> list[Any]:
    store = SqliteCheckpointer(path)
    try:
        return [e for e in await store.load(run_id) if e.phase is Phase.APPROVAL]
    finally:
        await store.close()


async def test_an_interrupt_is_shown_and_decided_on_the_web_page_bound_to_its_value(
    tmp_path: Path,
) -> None:
    """Two runs suspended at ``interrupt()``: the page (``asiento serve``, real HTTP) shows
    the value each asks about, escaped; a form whose fingerprint is not the shown value's
    records nothing; one run is approved and one denied from their cards; each graph then
    resumes with ``{approved, by, reason}``, the approved one refunds once, both close."""
    ledger, path = tmp_path / "ledger", tmp_path / "runs.db"
    graph = confirming_graph(ledger)
    for run_id in ("r-yes", "r-no"):
        assert (await _run(graph, path, run_id)).awaiting == ("m1.t1",)
    with (
        serving(tmp_path) as server,
        httpx.Client(base_url=server.url, timeout=WAIT, follow_redirects=True) as client,
    ):
        login = client.post("/login", data={"by": "ana", "token": TOKEN})
        assert login.status_code == 200, login.text
        page = client.get("/runs/r-yes").text
        card = _card(page, "r-yes")
        assert "the graph's <code>interrupt()</code>" in card
        assert "&#34;to&#34;: &#34;&lt;i&gt;ana&lt;/i&gt; &amp; co&#34;" in card  # escaped
        assert "<i>" not in page
        assert "&#34;value&#34;" not in card  # the value itself, not the journal's wrapping
        shown = _card_form(page, "r-yes")
        [awaiting] = client.get("/api/runs/r-yes").json()["awaiting"]
        assert shown["fp"] == awaiting["fingerprint"]
        tampered = client.post("/approve", data={**shown, "fp": "0" * 32, "reason": "ok"})
        assert tampered.status_code == 409, tampered.text
        assert await _approvals(path, "r-yes") == []
        approved = client.post("/approve", data={**shown, "reason": "checked the order"})
        assert approved.status_code == 200, approved.text
        assert "Recorded: step m1.t1 approved by ana" in approved.text
        denied_form = _card_form(client.get("/runs/r-no").text, "r-no")
        denied = client.post("/deny", data={**denied_form, "reason": "over the limit"})
        assert denied.status_code == 200, denied.text
    [yes], [no] = await _approvals(path, "r-yes"), await _approvals(path, "r-no")
    assert (yes.decision, yes.payload["fp"]) == ("approved", shown["fp"])
    assert no.decision == "denied"

    done = await _run(graph, path, "r-yes")
    assert "approved=True by=ana reason=checked the order; refund of order 42 to ana issued" in (
        _said(done)
    )
    refused = await _run(graph, path, "r-no")
    assert "approved=False by=ana reason=over the limit" in _said(refused)
    assert lines(ledger) == ["refund 42 ana"]  # the approved refund, once
    store = SqliteCheckpointer(path)
    try:
        statuses = [(i.run_id, i.status) for i in await store.runs()]
    finally:
        await store.close()
    assert sorted(statuses) == [("r-no", RunStatus.CLOSED), ("r-yes", RunStatus.CLOSED)]
    assert (await _run(graph, path, "r-yes")).replayed
    assert lines(ledger) == ["refund 42 ana"]


# -- abandon while a pass drives the run ------------------------------------------------


class _Gate:
    """Holds a node's call (a tool, or a chat model's turn) until the test lets it go."""

    def __init__(self) -> None:
        self.entered, self.released = threading.Event(), threading.Event()

    def hold(self) -> None:
        self.entered.set()
        if not self.released.wait(WAIT):
            raise TimeoutError("the test never released the held call")


class _HeldChat(ScriptedChat):
    """The scripted model, its turn ``held_turn`` held at ``gate`` before it answers."""

    held_turn: int = 1
    gate: Any = None

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> Any:
        answer = super()._generate(messages, *args, **kwargs)
        if ASKED[-1] == self.held_turn:
            self.gate.hold()
        return answer


@pytest.mark.parametrize("inside", ["tool", "model"])
async def test_a_run_abandoned_from_another_process_while_a_node_runs_stops_there(
    tmp_path: Path, inside: str
) -> None:
    """``asiento abandon`` in another process while the lookup tool (or the model's second
    answer) is in flight: the pass stops with RunAbandoned, records nothing after the
    abandon and starts nothing (the refund never runs), the run stays closed as
    abandoned, and ``durable_run`` on it afterwards runs nothing."""
    ledger, path, gate = tmp_path / "ledger", tmp_path / "j.db", _Gate()
    lookup, refund = make_tools(ledger)
    if inside == "tool":
        real = lookup.func

        def held_lookup(order: int) -> str:
            gate.hold()
            return str(real(order=order))  # type: ignore[misc]

        lookup.func = held_lookup  # type: ignore[attr-defined]
        model: ScriptedChat = ScriptedChat()
    else:
        model = _HeldChat(gate=gate)
    graph = build(model, [lookup, refund])
    driving = asyncio.create_task(_run(graph, path))
    assert await asyncio.to_thread(gate.entered.wait, WAIT), "the pass never reached the call"
    abandoned = await asyncio.to_thread(
        _cli, "abandon", "r1", "--by", "ops", "--reason", "wrong order", "--store", str(path)
    )
    assert abandoned.returncode == 0, abandoned.stderr
    gate.released.set()
    with pytest.raises(RunAbandoned, match="abandoned by ops: wrong order"):
        await asyncio.wait_for(driving, WAIT)

    store = SqliteCheckpointer(path)
    try:
        records = [(e.step_id, e.phase) for e in await store.load("r1")]
        info = await store.run("r1")
    finally:
        await store.close()
    before = [("m1", Phase.RESULT), ("m1.t1", Phase.INTENT), ("m1.t1", Phase.SUBMITTED)]
    if inside == "model":
        before.append(("m1.t1", Phase.RESULT))  # the lookup's outcome came before the abandon
    assert records == [*before, ("final", Phase.RESULT)]  # nothing after the abandon
    assert lines(ledger) == ["lookup 42"]  # the refund never ran
    asked = [0] if inside == "tool" else [0, 1]  # the model answers paid before the abandon
    assert asked == ASKED
    assert info is not None
    assert (info.status, info.reason) == (RunStatus.CLOSED, "abandoned by ops: wrong order")

    again = await _run(graph, path)
    assert (again.replayed, again.abandoned, again.output) == (True, True, None)
    assert (again.stats.model_calls, again.stats.tool_calls) == (0, 0)
    assert lines(ledger) == ["lookup 42"]
    assert len(ASKED) == (1 if inside == "tool" else 2)
