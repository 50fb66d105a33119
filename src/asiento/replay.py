"""The replay decision table for a tool step, as one pure function.

| In the journal                             | Replay          |
|--------------------------------------------|-----------------|
| result                                     | FEED_RESULT     |
| nothing                                    | START           |
| intent denied by policy                    | FEED_DENIAL     |
| intent require_approval, no approval       | AWAIT_APPROVAL  |
| approval denied                            | FEED_DENIAL     |
| intent allowed/approved, no submitted      | EXECUTE         |
| submitted, no result, idempotent           | EXECUTE         |
| submitted, no result, non-idempotent       | UNCERTAIN       |
| ... and a person resolved: happened        | FEED_RESOLUTION |
| ... and a person resolved: did not happen  | next attempt    |

A retry after "did not happen" is a new attempt with its own step id
(``step/2``, ``step/3``...), so each attempt keeps its own write-ahead record
and a crash inside a retry is as uncertain as one inside the first try.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from .errors import ApprovalError, JournalCorrupt
from .events import Decision, Phase, StepEvent

Records = Mapping[Phase, StepEvent]


class Action(StrEnum):
    FEED_RESULT = "feed_result"
    START = "start"
    EXECUTE = "execute"
    UNCERTAIN = "uncertain"
    FEED_DENIAL = "feed_denial"
    AWAIT_APPROVAL = "await_approval"
    FEED_RESOLUTION = "feed_resolution"


def decide(records: Records, *, idempotent: bool) -> Action:
    """What replay does with one tool step, given its records (latest attempt merged in)."""
    if Phase.RESULT in records:
        return Action.FEED_RESULT
    intent = records.get(Phase.INTENT)
    if intent is None:
        if Phase.SUBMITTED in records:
            step = records[Phase.SUBMITTED]
            raise JournalCorrupt(
                f"run {step.run_id!r} step {step.step_id!r}: submitted without intent"
            )
        return Action.START
    if intent.decision == Decision.DENY:
        return Action.FEED_DENIAL
    if intent.decision == Decision.REQUIRE_APPROVAL:
        approval = records.get(Phase.APPROVAL)
        if approval is None:
            return Action.AWAIT_APPROVAL
        check_approval(intent, approval)
        if approval.decision != Decision.APPROVED:
            return Action.FEED_DENIAL
    if Phase.SUBMITTED not in records:
        return Action.EXECUTE
    resolution = records.get(Phase.RESOLUTION)
    if resolution is not None and resolution.payload.get("happened"):
        return Action.FEED_RESOLUTION
    return Action.EXECUTE if idempotent else Action.UNCERTAIN


def check_approval(intent: StepEvent, approval: StepEvent) -> None:
    """An approval approves exactly the frozen arguments it was shown, or nothing."""
    if approval.payload.get("fp") != intent.payload.get("fp"):
        shown, frozen = approval.payload.get("fp"), intent.payload.get("fp")
        raise ApprovalError(
            f"run {intent.run_id!r} step {intent.step_id!r}: the recorded approval was given for "
            f"arguments {shown!r}, but the step froze {frozen!r}; it approves nothing"
        )


def attempt_id(step_id: str, attempt: int) -> str:
    """The step id under which attempt ``attempt`` of a tool step writes its records."""
    return step_id if attempt == 1 else f"{step_id}/{attempt}"


def merge_attempt(
    base: Records, journal: Mapping[str, Records], step_id: str
) -> tuple[Records, str]:
    """The records that decide a step now: intent and approval, plus its latest attempt."""
    attempt, current = 1, base
    while _resolved_not_happened(current):
        attempt += 1
        current = journal.get(attempt_id(step_id, attempt), {})
    if attempt == 1:
        return base, step_id
    merged: dict[Phase, StepEvent] = {
        p: e for p, e in base.items() if p in (Phase.INTENT, Phase.APPROVAL)
    }
    merged.update(current)
    return merged, attempt_id(step_id, attempt)


def _resolved_not_happened(records: Records) -> bool:
    resolution = records.get(Phase.RESOLUTION)
    return resolution is not None and not resolution.payload.get("happened")
