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

A new submission of a step that was already submitted (a retry after "did not
happen", an idempotent re-run, a republish while reconciling an effect) is a new
attempt with its own step id (``step/2``, ``step/3``...): each attempt keeps its
own write-ahead record, so a crash inside a retry is as uncertain as one inside
the first try, and the attempts are counted in the journal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from . import step_ids
from .errors import ApprovalMismatch, JournalCorrupt
from .events import Decision, Phase, StepEvent
from .payloads import Approval, Intent, Resolution

Records = Mapping[Phase, StepEvent]
# A timeline as ``index`` gives it: step id -> phase -> record.
Indexed = dict[str, dict[Phase, StepEvent]]


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
    if resolution is not None:
        found = Resolution.from_json(resolution.payload)
        return Action.FEED_RESOLUTION if found.happened else Action.EXECUTE
    return Action.EXECUTE if idempotent else Action.UNCERTAIN


def check_approval(intent: StepEvent, approval: StepEvent) -> None:
    """An approval approves exactly the frozen arguments it was shown, or nothing."""
    shown, frozen = Approval.from_json(approval.payload).fp, Intent.from_json(intent.payload).fp
    if not same_fingerprint(shown, frozen):
        raise ApprovalMismatch(
            f"run {intent.run_id!r} step {intent.step_id!r}: the recorded approval was given for "
            f"arguments of fingerprint {shown!r}, but the step froze fingerprint {frozen!r}; "
            "it approves nothing"
        )


def same_fingerprint(shown: object, frozen: object) -> bool:
    """Whether a fingerprint a person was shown is the frozen one (hex: any letter case)."""
    if isinstance(shown, str) and isinstance(frozen, str):
        return shown.lower() == frozen.lower()
    return shown == frozen


def tool_drift(recorded: Mapping[str, str], now: Mapping[str, str]) -> str | None:
    """What changed between the tools a run was recorded with and the ones it has now
    (name -> digest of schema and source), in words; None when nothing did."""
    gone = sorted(set(recorded) - set(now))
    new = sorted(set(now) - set(recorded))
    changed = sorted(n for n in set(recorded) & set(now) if recorded[n] != now[n])
    parts = [
        f"{label} {', '.join(repr(n) for n in names)}"
        for label, names in (
            ("no longer offered:", gone),
            ("new:", new),
            ("changed (schema, description, annotations or treatment):", changed),
        )
        if names
    ]
    return f"the tools changed since it was recorded; {'; '.join(parts)}" if parts else None


class Waits(StrEnum):
    """What a tool step waits for, as the decision table judges it."""

    APPROVAL = "approval"  # a person approves or denies
    RESOLUTION = "resolution"  # uncertain: a person says whether the effect happened
    IN_FLIGHT = "in_flight"  # submitted, no outcome yet: its session may still record one


def waits_for(records: Records, *, uncertain: bool = False, closed: bool = False) -> Waits | None:
    """What the step of ``records`` waits for, if anything: the one place that says so.

    ``uncertain``: the run stopped there (a submitted step with no outcome waits for a
    person, not for its session). A closed run waits for nobody: a step it had in
    flight stays in flight. An approval recorded for other arguments approves
    nothing, and the step waits for nothing a person can give (its pass says why).
    """
    if Phase.INTENT not in records:
        return None
    try:
        action = decide(records, idempotent=False)
    except ApprovalMismatch:
        return None
    if action is Action.AWAIT_APPROVAL:
        return None if closed else Waits.APPROVAL
    if action is Action.UNCERTAIN:
        return Waits.RESOLUTION if uncertain and not closed else Waits.IN_FLIGHT
    return None


def index(events: Sequence[StepEvent]) -> Indexed:
    """A timeline as step id -> phase -> record, steps in the order they first appear."""
    journal: Indexed = {}
    for event in events:
        journal.setdefault(event.step_id, {})[event.phase] = event
    return journal


@dataclass(frozen=True, slots=True)
class StepState:
    """A tool step as replay sees it: intent and approval, plus its latest attempt."""

    step_id: str
    attempt: int
    records: Records

    @property
    def current_id(self) -> str:
        """Where the latest attempt's records live."""
        return step_ids.attempt(self.step_id, self.attempt)

    @property
    def next_id(self) -> str:
        """Where a new submission writes: a fresh attempt once this one was submitted."""
        if Phase.SUBMITTED in self.records:
            return step_ids.attempt(self.step_id, self.attempt + 1)
        return self.current_id


def step_state(journal: Mapping[str, Records], step_id: str) -> StepState:
    """Merge a step's base records with those of its latest attempt."""
    base = journal.get(step_id, {})
    attempt = 1
    while step_ids.attempt(step_id, attempt + 1) in journal:
        attempt += 1
    if attempt == 1:
        return StepState(step_id, 1, base)
    merged: dict[Phase, StepEvent] = {
        p: e for p, e in base.items() if p in (Phase.INTENT, Phase.APPROVAL)
    }
    merged.update(journal[step_ids.attempt(step_id, attempt)])
    return StepState(step_id, attempt, merged)
