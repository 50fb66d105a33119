"""Abandoning a run: a person closes it; resuming it then makes no call."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asiento import (
    Agent,
    ModelResponse,
    RunStatus,
    Session,
    SqliteCheckpointer,
    StepEvent,
    ToolCall,
    UncertainEffect,
    UsageError,
    abandon,
    tool,
)
from asiento._canonical import FingerprintChain
from asiento.events import Decision, Phase
from asiento.model import Message
from asiento.testing import ScriptedGateway

SCRIPT = [ModelResponse(tool_calls=[ToolCall(name="pay", arguments={"n": 1})]), ModelResponse()]


def build(calls: list[int]) -> Agent:
    @tool()
    def pay(n: int) -> str:
        """Pay, once."""
        calls.append(n)
        return "paid"

    return Agent(tools=[pay])


async def uncertain_run(store: SqliteCheckpointer, calls: list[int]) -> None:
    """A run whose payment was submitted with no result: UncertainEffect on resume."""
    gateway = ScriptedGateway(SCRIPT)
    response = {"text": "", "tool_calls": [{"name": "pay", "arguments": {"n": 1}, "id": "m1.t1"}]}
    agent = build(calls)
    # What the loop writes before the tool runs; then the process died.
    chain = FingerprintChain(agent.head)
    chain.add(Message(role="user", content="t").to_json())
    fp = chain.value[:32]
    await store.append(
        StepEvent(
            run_id="r", step_id="m1", phase=Phase.RESULT, payload={"fp": fp, "response": response}
        ),
        StepEvent(
            run_id="r",
            step_id="m1.t1",
            phase=Phase.INTENT,
            decision=Decision.ALLOW,
            payload={"tool": "pay", "args": {"n": 1}, "fp": "x"},
        ),
        StepEvent(run_id="r", step_id="m1.t1", phase=Phase.SUBMITTED, payload={}),
    )
    with pytest.raises(UncertainEffect):
        async for _ in agent.run("t", session=Session("r", gateway, store)):
            pass


async def test_abandoned_run_answers_with_its_reason_and_calls_nothing(tmp_path: Path) -> None:
    """After abandon(), run() yields FinalStep(abandoned=True) with zero model and tool calls."""
    calls: list[int] = []
    store = SqliteCheckpointer(tmp_path / "runs.db")
    await uncertain_run(store, calls)
    await abandon(store, "r", by="ana", reason="the bank cannot tell")
    gateway = ScriptedGateway(SCRIPT)
    steps = [s async for s in build(calls).run("t", session=Session("r", gateway, store))]
    assert [(type(s).__name__, s.abandoned, s.text) for s in steps] == [  # type: ignore[union-attr]
        ("FinalStep", True, "abandoned by ana: the bank cannot tell")
    ]
    assert (gateway.calls, calls) == ([], [])
    [info] = await store.runs()
    assert (info.status, info.reason) == (
        RunStatus.CLOSED,
        "abandoned by ana: the bank cannot tell",
    )
    with pytest.raises(UsageError, match="closed already"):
        await abandon(store, "r", by="ana", reason="again")
    with pytest.raises(UsageError, match="unknown run"):
        await abandon(store, "nope", by="ana", reason="x")


async def test_cli_abandon(tmp_path: Path) -> None:
    """`asiento abandon RUN --by --reason` closes the run."""
    calls: list[int] = []
    await uncertain_run(SqliteCheckpointer(tmp_path / "runs.db"), calls)
    argv = [sys.executable, "-m", "asiento", "abandon", "r", "--by", "ana", "--reason", "gone"]
    proc = subprocess.run(
        argv, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "abandoned by ana: gone" in proc.stdout
    [info] = await SqliteCheckpointer(tmp_path / "runs.db").runs()
    assert info.status == RunStatus.CLOSED
