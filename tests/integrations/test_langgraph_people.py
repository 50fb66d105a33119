"""A person and a LangGraph run, across processes: an ``interrupt()`` decided on the web
page (``asiento serve`` in its own process, over real HTTP), and ``asiento abandon`` from
another process while a pass is inside a node."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import BaseMessage

from asiento import RunAbandoned, RunStatus, SqliteCheckpointer
from asiento.events import Phase
from asiento.integrations.langgraph import DurableResult, durable_run

from .langgraph_graph import ASKED, TASK, ScriptedChat, build, lines, make_tools

INPUT = {"messages": [("user", TASK)]}
WAIT = 30.0  # seconds any one wait in these tests may take before it fails


@pytest.fixture(autouse=True)
def _fresh_count() -> None:
    ASKED.clear()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "asiento", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


async def _run(graph: Any, path: Path) -> DurableResult:
    store = SqliteCheckpointer(path)
    try:
        return await durable_run(graph, INPUT, run_id="r1", store=store)
    finally:
        await store.close()


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
