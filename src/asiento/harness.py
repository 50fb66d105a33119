"""What a person (or their script, CLI or web page) writes while no loop runs.

Approvals, denials and resolutions are journal records like any other: the
checkpointer is the run's diary, not a private store of the loop.
"""

from __future__ import annotations

from typing import Any

from ._crash import crash_point
from .errors import ApprovalError, DuplicateRecord, UsageError
from .events import FINAL_STEP_ID, Decision, Phase, RunStatus, StepEvent
from .journal.base import Checkpointer, check_id
from .replay import index, step_state


async def approve(
    store: Checkpointer,
    run_id: str,
    step_id: str,
    *,
    by: str,
    reason: str = "",
    fingerprint: str | None = None,
) -> StepEvent:
    """Approve the frozen arguments of a step awaiting approval; it will run exactly once.

    Pass ``fingerprint`` (from ``ApprovalStep.fingerprint``) to approve only the
    arguments you were shown.
    """
    return await _decide(
        store, run_id, step_id, approved=True, by=by, reason=reason, fingerprint=fingerprint
    )


async def deny(
    store: Checkpointer,
    run_id: str,
    step_id: str,
    *,
    by: str,
    reason: str = "",
    fingerprint: str | None = None,
) -> StepEvent:
    """Deny a step awaiting approval; the model is told it was denied, and why."""
    return await _decide(
        store, run_id, step_id, approved=False, by=by, reason=reason, fingerprint=fingerprint
    )


async def _decide(
    store: Checkpointer,
    /,
    run_id: str,
    step_id: str,
    *,
    approved: bool,
    by: str,
    reason: str,
    fingerprint: str | None,
) -> StepEvent:
    check_id("run_id", run_id)
    check_id("step_id", step_id)
    if not isinstance(by, str) or not by:
        raise UsageError("say who decides: by='name'")
    records = {e.phase: e for e in await store.load_step(run_id, step_id)}
    intent = records.get(Phase.INTENT)
    where = f"run {run_id!r} step {step_id!r}"
    if intent is None or intent.decision != Decision.REQUIRE_APPROVAL:
        raise ApprovalError(f"{where} is not awaiting approval")
    if Phase.APPROVAL in records:
        raise ApprovalError(f"{where} was already decided: {records[Phase.APPROVAL].decision}")
    frozen = intent.payload.get("fp")
    if fingerprint is not None and fingerprint != frozen:
        raise ApprovalError(
            f"{where}: you were shown arguments {fingerprint!r} but the step froze {frozen!r}; "
            "nothing was recorded"
        )
    event = StepEvent(
        run_id=run_id,
        step_id=step_id,
        phase=Phase.APPROVAL,
        decision=Decision.APPROVED if approved else Decision.DENIED,
        payload={"approved": approved, "by": by, "reason": reason, "fp": frozen},
    )
    crash_point("during_approval")
    try:
        await store.append(event, status=RunStatus.RUNNING)
    except DuplicateRecord:
        raise ApprovalError(
            f"{where} was decided by someone else first; nothing recorded"
        ) from None
    return event


async def resolve(
    store: Checkpointer,
    run_id: str,
    step_id: str,
    *,
    happened: bool,
    by: str = "",
    remote_id: str | None = None,
    result: Any = None,
    reason: str = "",
) -> StepEvent:
    """Record what a person found about an uncertain effect.

    ``happened=True``: the effect happened; ``result`` is fed to the model.
    ``happened=False``: it did not; the next pass executes it again, once.
    """
    check_id("run_id", run_id)
    check_id("step_id", step_id)
    if not isinstance(happened, bool):
        raise UsageError("resolve(happened=...) takes True or False")
    journal = index(await store.load(run_id))
    state = step_state(journal, step_id.split("/", 1)[0])
    records = state.records
    where = f"run {run_id!r} step {state.step_id!r}"
    if Phase.SUBMITTED not in records or Phase.RESULT in records or Phase.RESOLUTION in records:
        raise UsageError(f"{where} is not uncertain (submitted with no recorded outcome)")
    payload = {"happened": happened, "by": by, "reason": reason, "remote_id": remote_id}
    if happened:
        payload["result"] = result if result is not None else {"remote_id": remote_id}
    event = StepEvent(
        run_id=run_id, step_id=state.current_id, phase=Phase.RESOLUTION, payload=payload
    )
    try:
        await store.append(event, status=RunStatus.RUNNING)
    except DuplicateRecord:
        raise UsageError(f"{where} was resolved by someone else first; nothing recorded") from None
    return event


async def unpark(store: Checkpointer, run_id: str, *, by: str, reason: str = "") -> None:
    """Give a parked run back to the workers, with a fresh count of claims."""
    check_id("run_id", run_id)
    if not isinstance(by, str) or not by:
        raise UsageError("say who unparks the run: by='name'")
    info = next((r for r in await store.runs(status=RunStatus.PARKED) if r.run_id == run_id), None)
    if info is None:
        raise UsageError(f"run {run_id!r} is not parked")
    note = f"unparked by {by}" + (f": {reason}" if reason else "")
    await store.set_status(run_id, RunStatus.RUNNING, reason=note)


async def abandon(store: Checkpointer, run_id: str, *, by: str, reason: str) -> StepEvent:
    """Close a run that will not go on (an uncertain effect nobody can settle, say).

    The run's final record says who abandoned it and why; resuming it then makes
    no call and yields that ``FinalStep(abandoned=True)``.
    """
    check_id("run_id", run_id)
    if not isinstance(by, str) or not by or not isinstance(reason, str) or not reason:
        raise UsageError("say who abandons the run and why: by='name', reason='...'")
    if not [r for r in await store.runs() if r.run_id == run_id]:
        raise UsageError(f"unknown run {run_id!r}")
    text = f"abandoned by {by}: {reason}"
    payload = {"step": "abandoned", "text": text, "abandoned": True, "by": by, "reason": reason}
    event = StepEvent(run_id=run_id, step_id=FINAL_STEP_ID, phase=Phase.RESULT, payload=payload)
    try:
        await store.append(event, status=RunStatus.CLOSED)
    except DuplicateRecord:
        raise UsageError(f"run {run_id!r} is closed already; nothing recorded") from None
    await store.set_status(run_id, RunStatus.CLOSED, reason=text)
    return event
