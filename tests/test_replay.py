"""The replay decision table: one test per row, and a property over random journals."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asiento import ApprovalError, Decision, JournalCorrupt, Phase, StepEvent
from asiento.replay import Action, Records, decide, step_state

FP = "a" * 64


def rec(
    phase: Phase,
    decision: Decision | None = None,
    step_id: str = "m1.t1",
    **payload: Any,
) -> StepEvent:
    """One record of step ``step_id`` of run ``r``."""
    return StepEvent(run_id="r", step_id=step_id, phase=phase, decision=decision, payload=payload)


def intent(decision: Decision | None = Decision.ALLOW, fp: str = FP) -> StepEvent:
    return rec(Phase.INTENT, decision, tool="send", args={"to": "x"}, fp=fp)


def approval(decision: Decision, fp: str = FP) -> StepEvent:
    approved = decision is Decision.APPROVED
    return rec(Phase.APPROVAL, decision, approved=approved, by="ana", reason="", fp=fp)


def records(*events: StepEvent) -> Records:
    return {e.phase: e for e in events}


SUBMITTED = rec(Phase.SUBMITTED)
RESULT = rec(Phase.RESULT, status="ok", value=1)


@pytest.mark.parametrize("idempotent", [True, False])
def test_result_recorded_feeds_result(idempotent: bool) -> None:
    """Intent and result recorded: the step happened, its result is fed back."""
    recs = records(intent(), SUBMITTED, RESULT)
    assert decide(recs, idempotent=idempotent) is Action.FEED_RESULT


def test_nothing_recorded_starts() -> None:
    """A step with no records was never tried: replay starts it."""
    assert decide({}, idempotent=False) is Action.START


def test_policy_denied_intent_feeds_denial() -> None:
    """An intent the policy denied is a known outcome: the denial is fed back."""
    assert decide(records(intent(Decision.DENY)), idempotent=False) is Action.FEED_DENIAL


def test_require_approval_without_approval_awaits() -> None:
    """An intent that needs approval and has none waits for a person."""
    recs = records(intent(Decision.REQUIRE_APPROVAL))
    assert decide(recs, idempotent=False) is Action.AWAIT_APPROVAL


def test_approved_without_submitted_executes() -> None:
    """An approved step not yet submitted goes ahead."""
    recs = records(intent(Decision.REQUIRE_APPROVAL), approval(Decision.APPROVED))
    assert decide(recs, idempotent=False) is Action.EXECUTE


def test_approval_denied_feeds_denial() -> None:
    """A step a person denied is a known outcome: the denial is fed back."""
    recs = records(intent(Decision.REQUIRE_APPROVAL), approval(Decision.DENIED))
    assert decide(recs, idempotent=False) is Action.FEED_DENIAL


def test_submitted_without_result_idempotent_executes() -> None:
    """Submitted with no result, idempotent: repeating is free, so it executes."""
    assert decide(records(intent(), SUBMITTED), idempotent=True) is Action.EXECUTE


def test_submitted_without_result_non_idempotent_is_uncertain() -> None:
    """Submitted with no result, not idempotent: nobody knows, so it is uncertain."""
    assert decide(records(intent(), SUBMITTED), idempotent=False) is Action.UNCERTAIN


def test_resolution_happened_feeds_resolution() -> None:
    """A person resolved the uncertain effect as happened: their result is fed back."""
    resolution = rec(Phase.RESOLUTION, happened=True, result={"remote_id": "42"})
    recs = records(intent(), SUBMITTED, resolution)
    assert decide(recs, idempotent=False) is Action.FEED_RESOLUTION


def test_approval_with_other_fingerprint_approves_nothing() -> None:
    """An approval given for other arguments than the frozen ones raises ApprovalError."""
    recs = records(intent(Decision.REQUIRE_APPROVAL), approval(Decision.APPROVED, fp="b" * 64))
    with pytest.raises(ApprovalError, match=r"m1\.t1"):
        decide(recs, idempotent=False)


def test_submitted_without_intent_is_corrupt() -> None:
    """A submitted marker with no intent cannot happen in a sound journal."""
    with pytest.raises(JournalCorrupt, match=r"m1\.t1"):
        decide(records(SUBMITTED), idempotent=True)


def test_did_not_happen_retries_as_attempt_two() -> None:
    """After a "did not happen" resolution the step executes again, as attempt ``x/2``."""
    journal = {
        "x": records(
            rec(Phase.INTENT, Decision.ALLOW, step_id="x", fp=FP),
            rec(Phase.SUBMITTED, step_id="x"),
            rec(Phase.RESOLUTION, step_id="x", happened=False),
        )
    }
    state = step_state(journal, "x")
    assert decide(state.records, idempotent=False) is Action.EXECUTE
    assert (state.current_id, state.next_id) == ("x", "x/2")


def test_crash_inside_retry_is_uncertain_at_attempt_two() -> None:
    """A retry submitted as ``x/2`` with no result is as uncertain as the first try."""
    journal = {
        "x": records(
            rec(Phase.INTENT, Decision.ALLOW, step_id="x", fp=FP),
            rec(Phase.SUBMITTED, step_id="x"),
            rec(Phase.RESOLUTION, step_id="x", happened=False),
        ),
        "x/2": records(rec(Phase.SUBMITTED, step_id="x/2")),
    }
    state = step_state(journal, "x")
    assert set(state.records) == {Phase.INTENT, Phase.SUBMITTED}
    assert decide(state.records, idempotent=False) is Action.UNCERTAIN
    assert (state.attempt, state.current_id, state.next_id) == (2, "x/2", "x/3")


# -- property ----------------------------------------------------------------------

_DECISIONS = st.sampled_from([None, *Decision])


@st.composite
def journals(draw: st.DrawFn) -> dict[Phase, StepEvent]:
    """Any subset of a step's records, with any decisions and fingerprints."""
    phases = draw(st.sets(st.sampled_from(list(Phase))))
    fps = st.sampled_from([FP, "b" * 64])
    out: dict[Phase, StepEvent] = {}
    for phase in phases:
        payload = {"fp": draw(fps), "happened": draw(st.booleans())}
        out[phase] = StepEvent(
            run_id="r", step_id="m1.t1", phase=phase, decision=draw(_DECISIONS), payload=payload
        )
    return out


@given(journals())
def test_non_idempotent_submitted_never_executes(recs: dict[Phase, StepEvent]) -> None:
    """A non-idempotent step submitted with no result nor resolution is never re-executed."""
    try:
        action = decide(recs, idempotent=False)
    except (ApprovalError, JournalCorrupt):
        return
    if Phase.SUBMITTED in recs and not {Phase.RESULT, Phase.RESOLUTION} & recs.keys():
        assert action is not Action.EXECUTE
