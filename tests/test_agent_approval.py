"""Denial and human approval, and several tool calls in one model answer.

Shared helpers live in test_agent.py; see its docstring for what "resume" and
"crash" mean in these in-process tests.
"""

from __future__ import annotations

from typing import Any

import pytest

from asiento import (
    Agent,
    ApprovalError,
    ApprovalStep,
    Decision,
    FinalStep,
    MemoryCheckpointer,
    ModelStep,
    Phase,
    RunStatus,
    StepEvent,
    ToolCall,
    ToolStep,
    UncertainEffect,
    UsageError,
    approve,
    deny,
    require_approval_for,
)
from asiento.testing import ScriptedGateway
from sqlite_files import Journal
from test_agent import (
    ECHO_SCRIPT,
    RUN,
    Crash,
    after_tool,
    asks,
    counting_tool,
    done,
    drive,
    drive_until,
    echo_agent,
    phases,
    tool_messages,
)


def guarded(calls: list[str], *, crash: bool = False) -> Agent:
    """The echo agent with a policy that asks a person before echo runs."""
    return echo_agent(calls, crash=crash, policy=require_approval_for("echo"))


async def suspended(journal: Journal) -> ApprovalStep:
    """Pass 1 of a guarded run: it stops at m1.t1 awaiting approval."""
    calls: list[str] = []
    steps = await drive(guarded(calls), ScriptedGateway(ECHO_SCRIPT), journal.open())
    assert calls == []
    assert isinstance(steps[-1], ApprovalStep)
    return steps[-1]


def deny_all(call: ToolCall) -> str:
    return "deny"


async def status_of(journal: Journal) -> RunStatus:
    (info,) = await journal.open().runs()
    return info.status


# -- 4. denial -----------------------------------------------------------------------


async def test_policy_deny_is_a_known_outcome_fed_to_the_model(journal: Journal) -> None:
    """A policy deny yields ToolStep(denied), runs nothing, and the model reads the denial."""
    calls: list[str] = []
    gw = ScriptedGateway(ECHO_SCRIPT)
    steps = await drive(echo_agent(calls, policy=deny_all), gw, journal.open())
    assert calls == []
    (tool_step,) = [s for s in steps if isinstance(s, ToolStep)]
    assert (tool_step.status, tool_step.decision) == ("denied", Decision.DENY)
    assert tool_messages(gw.calls[1][0]) == ["denied: denied by policy"]
    assert isinstance(steps[-1], FinalStep)
    assert await phases(journal.open(), "m1.t1") == [Phase.INTENT, Phase.RESULT]


async def test_denied_intent_without_result_is_fed_as_denial(journal: Journal) -> None:
    """Replay table row: an intent denied by policy and no result is fed as a denial, not run."""
    scratch = MemoryCheckpointer()
    await drive(echo_agent([], policy=deny_all), ScriptedGateway(ECHO_SCRIPT), scratch)
    written = await scratch.load(RUN)
    prefix = [e for e in written if e.step_id == "m1" or e.phase == Phase.INTENT]
    await journal.open().append(*prefix)
    calls: list[str] = []
    gw = ScriptedGateway(ECHO_SCRIPT)
    steps = await drive(echo_agent(calls, policy=deny_all), gw, journal.open())
    assert calls == []
    (tool_step,) = [s for s in steps if isinstance(s, ToolStep)]
    assert (tool_step.status, tool_step.decision) == ("denied", Decision.DENY)
    assert tool_messages(gw.calls[0][0]) == ["denied: denied by policy"]


# -- 4. approval ---------------------------------------------------------------------


async def test_require_approval_suspends_the_run(journal: Journal) -> None:
    """require_approval yields ToolStep(awaiting_approval) then ApprovalStep; the run suspends."""
    calls: list[str] = []
    steps = await drive(guarded(calls), ScriptedGateway(ECHO_SCRIPT), journal.open())
    assert [type(s) for s in steps] == [ModelStep, ToolStep, ApprovalStep]
    tool_step, approval = steps[1], steps[2]
    assert isinstance(tool_step, ToolStep)
    assert (tool_step.decision, tool_step.status) == (
        Decision.REQUIRE_APPROVAL,
        "awaiting_approval",
    )
    assert isinstance(approval, ApprovalStep)
    assert (approval.step_id, approval.call.name) == ("m1.t1", "echo")
    assert calls == []
    assert await status_of(journal) == RunStatus.SUSPENDED
    assert await phases(journal.open(), "m1.t1") == [Phase.INTENT]


async def test_resume_without_a_decision_waits_again(journal: Journal) -> None:
    """Resuming an undecided run calls nothing and yields the same ApprovalStep again."""
    first = await suspended(journal)
    before = await journal.open().load(RUN)
    calls: list[str] = []
    gw = ScriptedGateway(ECHO_SCRIPT)
    steps = await drive(guarded(calls), gw, journal.open())
    assert steps[-1] == first
    assert (len(gw.calls), calls) == (0, [])
    assert await journal.open().load(RUN) == before
    assert await status_of(journal) == RunStatus.SUSPENDED


async def test_approved_step_runs_exactly_once(journal: Journal) -> None:
    """Approved from another connection: the next pass runs it once, the one after nothing."""
    await suspended(journal)
    await approve(journal.open(), RUN, "m1.t1", by="ana")
    calls: list[str] = []
    gw = ScriptedGateway(ECHO_SCRIPT)
    steps = await drive(guarded(calls), gw, journal.open())
    assert calls == ["hi"]
    (tool_step,) = [s for s in steps if isinstance(s, ToolStep)]
    assert (tool_step.decision, tool_step.status) == (Decision.APPROVED, "ok")
    assert isinstance(steps[-1], FinalStep)
    assert len(gw.calls) == 1

    gw3 = ScriptedGateway(ECHO_SCRIPT)
    third = await drive(guarded(calls), gw3, journal.open())
    assert (len(gw3.calls), calls) == (0, ["hi"])
    assert [type(s) for s in third] == [FinalStep]


async def test_approval_with_the_shown_fingerprint_works(journal: Journal) -> None:
    """Approving with ApprovalStep.fingerprint approves the step."""
    shown = await suspended(journal)
    event = await approve(journal.open(), RUN, "m1.t1", by="ana", fingerprint=shown.fingerprint)
    assert event.decision == Decision.APPROVED
    calls: list[str] = []
    await drive(guarded(calls), ScriptedGateway(ECHO_SCRIPT), journal.open())
    assert calls == ["hi"]


async def test_person_denial_is_fed_with_its_reason(journal: Journal) -> None:
    """deny(reason=...) yields ToolStep(denied) with the reason, and the model reads it."""
    await suspended(journal)
    await deny(journal.open(), RUN, "m1.t1", by="ana", reason="too risky")
    calls: list[str] = []
    gw = ScriptedGateway(ECHO_SCRIPT)
    steps = await drive(guarded(calls), gw, journal.open())
    assert calls == []
    (tool_step,) = [s for s in steps if isinstance(s, ToolStep)]
    assert (tool_step.decision, tool_step.status) == (Decision.DENIED, "denied")
    assert tool_step.result == "too risky"
    assert tool_messages(gw.calls[0][0]) == ["denied: too risky"]
    assert isinstance(steps[-1], FinalStep)


@pytest.mark.parametrize("second", [approve, deny])
async def test_deciding_twice_is_refused(journal: Journal, second: Any) -> None:
    """A step already approved cannot be approved or denied again."""
    await suspended(journal)
    await approve(journal.open(), RUN, "m1.t1", by="ana")
    with pytest.raises(ApprovalError, match=r"was already (approved|denied) by ana"):
        await second(journal.open(), RUN, "m1.t1", by="bob")
    (approval,) = [e for e in await journal.open().load(RUN) if e.phase == Phase.APPROVAL]
    assert approval.payload["by"] == "ana"


@pytest.mark.parametrize("step_id", ["m1", "m1.t1", "m9.t1"])
async def test_approving_a_step_not_awaiting_is_refused(journal: Journal, step_id: str) -> None:
    """approve() on a model step, an allowed tool step or an unknown step is an ApprovalError."""
    await drive_until(
        echo_agent([]),
        ScriptedGateway(ECHO_SCRIPT),
        journal.open(),
        after_tool,
    )
    before = await journal.open().load(RUN)
    with pytest.raises(ApprovalError, match=r"not awaiting approval|has no step|is closed"):
        await approve(journal.open(), RUN, step_id, by="ana")
    assert await journal.open().load(RUN) == before


async def test_approval_with_a_wrong_fingerprint_records_nothing(journal: Journal) -> None:
    """A fingerprint other than the frozen one is an ApprovalError and writes nothing."""
    await suspended(journal)
    with pytest.raises(ApprovalError, match="nothing was recorded"):
        await approve(journal.open(), RUN, "m1.t1", by="ana", fingerprint="0" * 64)
    assert await phases(journal.open(), "m1.t1") == [Phase.INTENT]
    assert await status_of(journal) == RunStatus.SUSPENDED


async def test_a_wrong_fingerprint_is_named_a_fingerprint(journal: Journal) -> None:
    """The refusal names the fingerprint shown and the frozen one as fingerprints, not as
    arguments."""
    shown = await suspended(journal)
    with pytest.raises(ApprovalError) as refused:
        await approve(journal.open(), RUN, "m1.t1", by="ana", fingerprint="0" * 64)
    message = str(refused.value)
    assert f"shown the arguments of fingerprint {'0' * 64!r}" in message
    assert f"the step froze fingerprint {shown.fingerprint!r}" in message
    assert "arguments '0" not in message


@pytest.mark.parametrize("decide", [approve, deny])
async def test_an_upper_case_fingerprint_is_the_same_fingerprint(
    journal: Journal, decide: Any
) -> None:
    """A fingerprint typed in upper case (hex) is the one shown: the decision is recorded."""
    shown = await suspended(journal)
    upper = shown.fingerprint.upper()
    assert upper != shown.fingerprint
    event = await decide(journal.open(), RUN, "m1.t1", by="ana", reason="ok", fingerprint=upper)
    assert event.payload["fp"] == shown.fingerprint  # the frozen one is what is recorded
    calls: list[str] = []
    await drive(guarded(calls), ScriptedGateway(ECHO_SCRIPT), journal.open())
    assert calls == (["hi"] if decide is approve else [])


async def test_a_recorded_approval_in_upper_case_approves_the_step(journal: Journal) -> None:
    """An approval record whose fingerprint differs from the intent's only in letter case
    approves it: the resumed run runs the step once."""
    shown = await suspended(journal)
    record = StepEvent(
        run_id=RUN,
        step_id="m1.t1",
        phase=Phase.APPROVAL,
        decision=Decision.APPROVED,
        payload={"approved": True, "by": "a script", "reason": "", "fp": shown.fingerprint.upper()},
    )
    await journal.open().append(record, status=RunStatus.RUNNING)
    calls: list[str] = []
    steps = await drive(guarded(calls), ScriptedGateway(ECHO_SCRIPT), journal.open())
    assert calls == ["hi"]
    assert isinstance(steps[-1], FinalStep)


@pytest.mark.parametrize("decide", [approve, deny])
async def test_deciding_on_an_unknown_run_says_unknown_run(journal: Journal, decide: Any) -> None:
    """approve() / deny() on a run the journal does not hold say "unknown run", as the CLI."""
    await suspended(journal)
    with pytest.raises(UsageError, match="unknown run 'ghost' in this journal"):
        await decide(journal.open(), "ghost", "m1.t1", by="ana", reason="no")
    assert [i.run_id for i in await journal.open().runs()] == [RUN]


async def test_forged_approval_approves_nothing(journal: Journal) -> None:
    """An approval record whose fingerprint is not the intent's fails on resume; nothing runs."""
    await suspended(journal)
    forged = StepEvent(
        run_id=RUN,
        step_id="m1.t1",
        phase=Phase.APPROVAL,
        decision=Decision.APPROVED,
        payload={"approved": True, "by": "mallory", "reason": "", "fp": "0" * 64},
    )
    await journal.open().append(forged, status=RunStatus.RUNNING)
    calls: list[str] = []
    with pytest.raises(ApprovalError, match="approves nothing"):
        await drive(guarded(calls), ScriptedGateway(ECHO_SCRIPT), journal.open())
    assert calls == []
    assert await phases(journal.open(), "m1.t1") == [Phase.INTENT, Phase.APPROVAL]


async def test_approved_effect_that_died_in_flight_is_uncertain(journal: Journal) -> None:
    """Approved, submitted, no result: the resume raises UncertainEffect, never a second run."""
    await suspended(journal)
    await approve(journal.open(), RUN, "m1.t1", by="ana")
    calls: list[str] = []
    with pytest.raises(Crash):
        await drive(guarded(calls, crash=True), ScriptedGateway(ECHO_SCRIPT), journal.open())
    assert await phases(journal.open(), "m1.t1") == [Phase.INTENT, Phase.APPROVAL, Phase.SUBMITTED]
    with pytest.raises(UncertainEffect) as info:
        await drive(guarded(calls), ScriptedGateway(ECHO_SCRIPT), journal.open())
    assert info.value.step_id == "m1.t1"
    assert calls == ["hi"]


# -- 7. several tool calls in one answer ---------------------------------------------

THREE = [asks(("echo", {"text": "a"}), ("echo", {"text": "b"}), ("echo", {"text": "c"})), done()]


async def test_tool_calls_of_one_answer_get_ordered_step_ids(journal: Journal) -> None:
    """Three calls in one answer are m1.t1, m1.t2, m1.t3, in order, each with its own records."""
    calls: list[str] = []
    gw = ScriptedGateway(THREE)
    steps = await drive(echo_agent(calls), gw, journal.open())
    assert calls == ["a", "b", "c"]
    ids = [s.step_id for s in steps if isinstance(s, ToolStep)]
    assert ids == ["m1.t1", "m1.t2", "m1.t3"]
    store = journal.open()
    for step_id in ids:
        assert await phases(store, step_id) == [Phase.INTENT, Phase.SUBMITTED, Phase.RESULT]
    written = [e.step_id for e in await store.load(RUN) if e.step_id.startswith("m1.")]
    assert written == sorted(written)
    request = gw.calls[1][0]
    assert tool_messages(request) == ["echo:a:1", "echo:b:2", "echo:c:3"]
    asked = [c.id for m in request.messages for c in m.tool_calls]
    answered = [m.tool_call_id for m in request.messages if m.role == "tool"]
    assert answered == asked
    assert len(set(asked)) == 3


def three_tools(calls: list[str]) -> Agent:
    tools = [counting_tool(name, calls) for name in ("first", "second", "third")]
    return Agent(tools=tools, policy=require_approval_for("second"))


THREE_TOOLS = [
    asks(("first", {"text": "a"}), ("second", {"text": "b"}), ("third", {"text": "c"})),
    done(),
]


async def test_approval_in_the_middle_suspends_between_calls(journal: Journal) -> None:
    """t2 needing approval: t1 has run, t3 is untouched; after approval t1 is not run again."""
    calls: list[str] = []
    steps = await drive(three_tools(calls), ScriptedGateway(THREE_TOOLS), journal.open())
    assert calls == ["a"]
    assert [(type(s).__name__, s.step_id) for s in steps] == [
        ("ModelStep", "m1"),
        ("ToolStep", "m1.t1"),
        ("ToolStep", "m1.t2"),
        ("ApprovalStep", "m1.t2"),
    ]
    assert await phases(journal.open(), "m1.t3") == []

    await approve(journal.open(), RUN, "m1.t2", by="ana")
    again: list[str] = []
    gw = ScriptedGateway(THREE_TOOLS)
    steps = await drive(three_tools(again), gw, journal.open())
    assert again == ["b", "c"]
    assert [s.step_id for s in steps if isinstance(s, ToolStep)] == ["m1.t2", "m1.t3"]
    assert tool_messages(gw.calls[0][0]) == ["first:a:1", "second:b:1", "third:c:2"]
    assert isinstance(steps[-1], FinalStep)
