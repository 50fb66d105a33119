"""Replay of tool effects and model requests: write-ahead, provider keys, divergence, resolve.

Shared helpers live in test_agent.py; see its docstring for what "resume" and
"crash" mean in these in-process tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from asiento import (
    Agent,
    FinalStep,
    MemoryCheckpointer,
    ModelStep,
    Phase,
    ReplayDivergence,
    RunInfo,
    RunStatus,
    SqliteCheckpointer,
    ToolStep,
    UncertainEffect,
    UsageError,
    resolve,
    tool,
)
from asiento.testing import ScriptedGateway
from sqlite_files import Journal
from test_agent import (
    ECHO_SCRIPT,
    RUN,
    TASK,
    Crash,
    after_tool,
    counting_tool,
    done,
    drive,
    drive_until,
    echo_agent,
    phases,
    scripted,
    tool_messages,
)


async def crashed_in_tool(journal: Journal, **kwargs: Any) -> None:
    """Pass 1 dies inside the echo tool, after it counted its call."""
    calls: list[str] = []
    with pytest.raises(Crash):
        await drive(
            echo_agent(calls, crash=True, **kwargs), ScriptedGateway(ECHO_SCRIPT), journal.open()
        )
    assert calls == ["hi"]


# -- 3. write-ahead ------------------------------------------------------------------


async def test_intent_and_submitted_are_on_disk_before_the_tool_runs(journal: Journal) -> None:
    """From a second connection, the running tool sees its own intent and submitted records."""
    seen: list[tuple[str, Phase]] = []

    @tool(name="echo")
    async def probe(text: str) -> str:
        """Looks at the journal while it runs."""
        other = SqliteCheckpointer(journal.path)
        try:
            for step_id in ("m1", "m1.t1"):
                seen.extend((e.step_id, e.phase) for e in await other.load_step(RUN, step_id))
        finally:
            await other.close()
        return "looked"

    await drive(Agent(tools=[probe]), ScriptedGateway(ECHO_SCRIPT), journal.open())
    assert seen == [("m1", Phase.RESULT), ("m1.t1", Phase.INTENT), ("m1.t1", Phase.SUBMITTED)]


async def test_submitted_without_result_is_uncertain(journal: Journal) -> None:
    """Non-idempotent, submitted, no result: UncertainEffect naming run/step/tool, no re-run."""
    await crashed_in_tool(journal)
    before = await journal.open().load(RUN)
    calls: list[str] = []
    gw = ScriptedGateway(ECHO_SCRIPT)
    with pytest.raises(UncertainEffect) as info:
        await drive(echo_agent(calls), gw, journal.open())
    assert calls == []
    assert len(gw.calls) == 0
    assert (info.value.run_id, info.value.step_id, info.value.tool) == (RUN, "m1.t1", "echo")
    for name in (RUN, "m1.t1", "echo"):
        assert repr(name) in str(info.value)
    store = journal.open()
    assert [r.run_id for r in await store.runs(status=RunStatus.UNCERTAIN)] == [RUN]
    assert await store.load(RUN) == before


async def test_uncertain_stays_uncertain_on_every_resume(journal: Journal) -> None:
    """Resuming an uncertain run again still refuses to guess and runs nothing."""
    await crashed_in_tool(journal)
    calls: list[str] = []
    for _ in range(2):
        with pytest.raises(UncertainEffect):
            await drive(echo_agent(calls), ScriptedGateway(ECHO_SCRIPT), journal.open())
    assert calls == []


async def test_idempotent_submitted_without_result_runs_again_once(journal: Journal) -> None:
    """Idempotent, submitted, no result: the resumed pass executes it exactly once more."""
    await crashed_in_tool(journal, idempotent=True)
    calls: list[str] = []
    gw = ScriptedGateway(ECHO_SCRIPT)
    steps = await drive(echo_agent(calls, idempotent=True), gw, journal.open())
    assert calls == ["hi"]
    assert len(gw.calls) == 1  # m1 is replayed; only m2 is asked
    assert isinstance(steps[-1], FinalStep)
    events = await journal.open().load(RUN)
    results = [e for e in events if e.step_id.startswith("m1.t1") and e.phase == Phase.RESULT]
    assert [r.payload["value"] for r in results] == ["echo:hi:1"]


async def test_recorded_result_is_skipped_and_fed_to_the_model(journal: Journal) -> None:
    """Intent and result recorded: the tool is skipped and the model reads the recorded value."""
    calls: list[str] = []  # shared: a second run would answer "echo:hi:2"
    await drive_until(echo_agent(calls), ScriptedGateway(ECHO_SCRIPT), journal.open(), after_tool)
    gw = ScriptedGateway(ECHO_SCRIPT)
    steps = await drive(echo_agent(calls), gw, journal.open())
    assert calls == ["hi"]
    assert tool_messages(gw.calls[0][0]) == ["echo:hi:1"]
    assert not any(isinstance(s, ToolStep) for s in steps)


# -- 5. idempotency key towards the provider -----------------------------------------


async def test_every_model_call_carries_run_step_and_fingerprint(journal: Journal) -> None:
    """Each key is f"{run_id}:{step_id}:{fp[:32]}" with the fingerprint the journal recorded."""
    gw = ScriptedGateway(ECHO_SCRIPT)
    steps = await drive(echo_agent([]), gw, journal.open())
    store = journal.open()
    expected = []
    for step_id in ("m1", "m2"):
        (record,) = await store.load_step(RUN, step_id)
        expected.append(f"{RUN}:{step_id}:{record.payload['fp'][:32]}")
    assert gw.keys == expected
    assert [s.idempotency_key for s in steps if isinstance(s, ModelStep)] == expected
    assert all(len(k.rsplit(":", 1)[1]) == 32 for k in expected)


async def test_retried_model_step_sends_the_same_key(journal: Journal) -> None:
    """A model call lost before it was recorded is retried with the identical key."""
    calls: list[str] = []
    gw1 = scripted(ECHO_SCRIPT, fail_at=1)
    with pytest.raises(ConnectionError):
        await drive(echo_agent(calls), gw1, journal.open())
    assert await journal.open().load_step(RUN, "m2") == []
    gw2 = ScriptedGateway(ECHO_SCRIPT)
    await drive(echo_agent(calls), gw2, journal.open())
    assert gw2.keys == [gw1.keys[1]]
    assert gw1.keys[1].startswith(f"{RUN}:m2:")
    assert calls == ["hi"]


def _other_tool() -> Any:
    @tool
    def other(text: str) -> str:
        """Another tool."""
        return text

    return other


VARIANTS: dict[str, Callable[[], tuple[Agent, str]]] = {
    "task": lambda: (echo_agent([]), "read /y"),
    "instructions": lambda: (
        Agent(instructions="be verbose", tools=[counting_tool("echo", [])]),
        TASK,
    ),
    "tools": lambda: (
        Agent(instructions="be brief", tools=[counting_tool("echo", []), _other_tool()]),
        TASK,
    ),
}


@pytest.mark.parametrize("change", list(VARIANTS))
async def test_other_task_instructions_or_tools_change_the_key(change: str) -> None:
    """Same run_id, another task, instructions or tool set: the m1 key differs."""
    base = ScriptedGateway([done()])
    await drive(echo_agent([]), base, MemoryCheckpointer())
    agent, task = VARIANTS[change]()
    changed = ScriptedGateway([done()])
    await drive(agent, changed, MemoryCheckpointer(), task=task)
    assert base.keys[0].startswith(f"{RUN}:m1:")
    assert changed.keys[0].startswith(f"{RUN}:m1:")
    assert changed.keys[0] != base.keys[0]


# -- 6. divergence -------------------------------------------------------------------


@pytest.mark.parametrize("change", list(VARIANTS))
async def test_resume_with_a_changed_agent_diverges_and_writes_nothing(
    journal: Journal, change: str
) -> None:
    """Resuming with another task, instructions or tools: ReplayDivergence at m1, no writes."""
    await drive_until(echo_agent([]), ScriptedGateway(ECHO_SCRIPT), journal.open(), after_tool)
    store = journal.open()
    events, listing = await store.load(RUN), _steps_and_status(await store.runs())
    agent, task = VARIANTS[change]()
    gw = ScriptedGateway(ECHO_SCRIPT)
    with pytest.raises(ReplayDivergence) as info:
        await drive(agent, gw, journal.open(), task=task)
    assert (info.value.run_id, info.value.step_id) == (RUN, "m1")
    assert repr(RUN) in str(info.value)
    assert "'m1'" in str(info.value)
    assert len(gw.calls) == 0
    assert await store.load(RUN) == events
    assert _steps_and_status(await store.runs()) == listing


# -- 10. resolve ---------------------------------------------------------------------


async def uncertain_run(journal: Journal) -> None:
    """A run stopped with UncertainEffect at m1.t1."""
    await crashed_in_tool(journal)
    with pytest.raises(UncertainEffect):
        await drive(echo_agent([]), ScriptedGateway(ECHO_SCRIPT), journal.open())


async def test_resolved_happened_feeds_the_result_without_running(journal: Journal) -> None:
    """resolve(happened=True, remote_id) is what the model reads; the tool is not run."""
    await uncertain_run(journal)
    await resolve(journal.open(), RUN, "m1.t1", happened=True, by="ana", remote_id="r1")
    assert await journal.open().runs(status=RunStatus.UNCERTAIN) == []
    calls: list[str] = []
    gw = ScriptedGateway(ECHO_SCRIPT)
    steps = await drive(echo_agent(calls), gw, journal.open())
    assert calls == []
    assert tool_messages(gw.calls[0][0]) == ['{"remote_id": "r1"}']
    assert isinstance(steps[-1], FinalStep)


async def test_resolved_not_happened_runs_once_as_a_new_attempt(journal: Journal) -> None:
    """resolve(happened=False): the next pass runs the tool once, recorded under m1.t1/2."""
    await uncertain_run(journal)
    await resolve(journal.open(), RUN, "m1.t1", happened=False, by="ana")
    calls: list[str] = []
    gw = ScriptedGateway(ECHO_SCRIPT)
    steps = await drive(echo_agent(calls), gw, journal.open())
    assert calls == ["hi"]
    assert isinstance(steps[-1], FinalStep)
    store = journal.open()
    assert await phases(store, "m1.t1/2") == [Phase.SUBMITTED, Phase.RESULT]
    assert tool_messages(gw.calls[0][0]) == ["echo:hi:1"]


async def test_crash_inside_a_retry_is_uncertain_again(journal: Journal) -> None:
    """A retry after "did not happen" has its own write-ahead: dying in it is uncertain too."""
    await uncertain_run(journal)
    await resolve(journal.open(), RUN, "m1.t1", happened=False, by="ana")
    calls: list[str] = []
    with pytest.raises(Crash):
        await drive(echo_agent(calls, crash=True), ScriptedGateway(ECHO_SCRIPT), journal.open())
    with pytest.raises(UncertainEffect) as info:
        await drive(echo_agent(calls), ScriptedGateway(ECHO_SCRIPT), journal.open())
    assert info.value.step_id == "m1.t1/2"
    assert calls == ["hi"]


@pytest.mark.parametrize("step_id", ["m1.t1", "m9.t1"], ids=["has-result", "unknown"])
async def test_resolving_a_step_that_is_not_uncertain_is_refused(
    journal: Journal, step_id: str
) -> None:
    """resolve() on a step with a known outcome, or no records, is a UsageError."""
    await drive(echo_agent([]), ScriptedGateway(ECHO_SCRIPT), journal.open())
    store = journal.open()
    before = await store.load(RUN)
    with pytest.raises(UsageError, match=r"not uncertain|has no step|is closed"):
        await resolve(store, RUN, step_id, happened=True, by="ana")
    assert await store.load(RUN) == before


def _steps_and_status(runs: list[RunInfo]) -> list[tuple[str, str, int, int]]:
    """What a divergent resume must not change (its lease fields do change: it took the lease)."""
    return [(r.run_id, r.status, r.events, r.model_calls) for r in runs]
