"""When each step is yielded: as soon as its records are durable, before the tool runs.

A caller can log or stop on "the model asked for X" before X runs; if it stops
there, the tool does not run, the journal says so, and the next pass runs it once.
"""

from __future__ import annotations

from pathlib import Path

from asiento import (
    Agent,
    FinalStep,
    ModelResponse,
    ModelStep,
    Phase,
    Session,
    SqliteCheckpointer,
    ToolCall,
    ToolStep,
    tool,
)
from asiento.testing import ScriptedGateway

SCRIPT = [
    ModelResponse(tool_calls=[ToolCall(name="pay", arguments={"cents": 5})]),
    ModelResponse(text="paid"),
]


def paying(seen: list[str]) -> Agent:
    @tool()
    def pay(cents: int) -> str:
        """Pay, once; notes what the caller had seen when it ran."""
        seen.append("pay ran")
        return "paid"

    return Agent(tools=[pay])


async def test_the_model_step_is_yielded_before_its_tool_runs(tmp_path: Path) -> None:
    """ModelStep (durable) reaches the caller before the tool it asked for starts."""
    seen: list[str] = []
    store = SqliteCheckpointer(tmp_path / "runs.db")
    session = Session("r", ScriptedGateway(SCRIPT), store)
    async for step in paying(seen).run("pay", session=session):
        seen.append(type(step).__name__)
        if isinstance(step, ModelStep):  # what it stands for is on disk already
            assert {e.step_id for e in await store.load("r")} >= {"m1"}
    assert seen[:3] == ["ModelStep", "pay ran", "ToolStep"], seen
    assert seen[-1] == "FinalStep"


async def test_stopping_before_the_tool_runs_it_once_on_the_next_pass(tmp_path: Path) -> None:
    """The caller stops at the ModelStep: the tool never started, the journal records that
    (not an uncertain effect), and the next pass runs it exactly once and closes."""
    seen: list[str] = []
    store = SqliteCheckpointer(tmp_path / "runs.db")
    steps = paying(seen).run("pay", session=Session("r", ScriptedGateway(SCRIPT), store))
    async for step in steps:
        assert isinstance(step, ModelStep)
        break
    await steps.aclose()  # type: ignore[attr-defined]
    assert seen == []
    [resolution] = [e for e in await store.load("r") if e.phase == Phase.RESOLUTION]
    assert (resolution.step_id, resolution.payload["happened"]) == ("m1.t1", False)
    gateway = ScriptedGateway(SCRIPT)
    again = [s async for s in paying(seen).run("pay", session=Session("r", gateway, store))]
    assert seen == ["pay ran"]
    assert [type(s) for s in again] == [ToolStep, ModelStep, FinalStep]
    assert [key.split(":")[1] for key in gateway.keys] == ["m2"]  # m1 was not asked again
    await store.close()
