"""What a person (or their script, CLI or web page) writes while no loop runs.

Approvals, denials and resolutions are journal records like any other: the
checkpointer is the run's diary, not a private store of the loop.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from . import lease as lease_state
from . import step_ids
from ._crash import crash_point
from .errors import (
    ApprovalRefused,
    AsientoError,
    DuplicateRecord,
    LeaseLost,
    RunClosed,
    RunLocked,
    UsageError,
)
from .events import Decision, Lease, Phase, RunStatus, StepEvent
from .journal.base import Checkpointer, check_id
from .lease import Holder
from .replay import StepState, index, step_state

# How long a person's write holds the run's lease (it holds it for one transaction; if
# the deciding process dies meanwhile, the run is free again at the latest by then).
DECISION_TTL = 10.0

log = logging.getLogger("asiento")


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
        raise ApprovalRefused(f"{where} is not awaiting approval")
    if Phase.APPROVAL in records:
        raise ApprovalRefused(f"{where} was already decided: {records[Phase.APPROVAL].decision}")
    await refuse_closed(store, run_id, "approved or denied")
    frozen = intent.payload.get("fp")
    if fingerprint is not None and fingerprint != frozen:
        raise ApprovalRefused(
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
    try:  # no lease needed: a pass replaying meanwhile does not overwrite the decision
        await store.append(event, status=RunStatus.RUNNING)
    except DuplicateRecord:
        raise ApprovalRefused(
            f"{where} was decided by someone else first; nothing recorded"
        ) from None
    except RunClosed:
        raise closed_error(run_id, "approved or denied") from None
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
    payload = {"happened": happened, "by": by, "reason": reason, "remote_id": remote_id}
    if happened:
        payload["result"] = result if result is not None else {"remote_id": remote_id}
    await _uncertain_state(store, run_id, step_id)
    await refuse_closed(store, run_id, "resolved")
    # The run's lease, taken for this one write: a session still driving the run may
    # record the step's own outcome yet (RunLocked), and a stale one writes nothing after.
    async with _holding(store, run_id, busy=_driven) as lease:
        state = await _uncertain_state(store, run_id, step_id)  # as it is under the lease
        where = f"run {run_id!r} step {state.step_id!r}"
        event = StepEvent(
            run_id=run_id, step_id=state.current_id, phase=Phase.RESOLUTION, payload=payload
        )
        try:
            await store.append(event, status=RunStatus.RUNNING, lease=lease)
        except DuplicateRecord:
            raise UsageError(
                f"{where} was resolved by someone else first; nothing recorded"
            ) from None
        except LeaseLost:  # only abandoning takes the lease from a live holder
            raise closed_error(run_id, "resolved") from None
    return event


async def _uncertain_state(store: Checkpointer, run_id: str, step_id: str) -> StepState:
    """The step as replay sees it, or a ``UsageError`` if it is not uncertain."""
    state = step_state(index(await store.load(run_id)), step_ids.base(step_id))
    records = state.records
    if {Phase.RESULT, Phase.RESOLUTION} & records.keys() or Phase.SUBMITTED not in records:
        raise UsageError(
            f"run {run_id!r} step {state.step_id!r} is not uncertain "
            "(submitted with no recorded outcome)"
        )
    return state


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

    Abandoning takes the run's fence, as a takeover does: once this returns, no new
    effect of the run starts anywhere, and a session still driving it stops at its
    next write with ``RunAbandoned``. The run's final record says who abandoned it
    and why; resuming it then makes no call and yields that ``FinalStep(abandoned=True)``.
    """
    check_id("run_id", run_id)
    if not isinstance(by, str) or not by or not isinstance(reason, str) or not reason:
        raise UsageError("say who abandons the run and why: by='name', reason='...'")
    if not [r for r in await store.runs() if r.run_id == run_id]:
        raise UsageError(f"unknown run {run_id!r}")
    if await store.final(run_id) is not None:
        raise RunClosed(f"run {run_id!r} is closed already; nothing recorded")
    text = f"abandoned by {by}: {reason}"
    payload = {"step": "abandoned", "text": text, "abandoned": True, "by": by, "reason": reason}
    event = StepEvent(run_id=run_id, step_id=step_ids.FINAL, phase=Phase.RESULT, payload=payload)
    async with _holding(store, run_id, force=True) as lease:
        try:
            await store.append(event, status=RunStatus.CLOSED, lease=lease)
        except DuplicateRecord:
            raise RunClosed(f"run {run_id!r} is closed already; nothing recorded") from None
        await store.set_status(run_id, RunStatus.CLOSED, reason=text, lease=lease)
    return event


@asynccontextmanager
async def _holding(
    store: Checkpointer,
    run_id: str,
    *,
    force: bool = False,
    busy: Callable[[str, RunLocked], Exception] | None = None,
) -> AsyncIterator[Lease]:
    """The run's lease for one write by a person (``force``: even from a live session).

    A session that holds it and is provably dead does not count: it is taken over.
    """
    try:
        lease = await store.acquire(run_id, Holder.here(), ttl=DECISION_TTL, force=force)
    except RunLocked as exc:
        if busy is None:
            raise
        raise busy(run_id, exc) from None
    try:
        yield lease
    finally:
        lease_state.ended(lease.owner)
        try:
            await store.release(lease)
        except AsientoError as exc:  # never hide what the write raised; it expires soon
            log.warning("run %r: could not release a person's lease: %s", run_id, exc)


def _driven(run_id: str, exc: RunLocked) -> UsageError:
    return UsageError(
        f"run {run_id!r} is being driven right now ({exc}); its step may still record an "
        "outcome, and nothing was recorded. Resolve it once the run stops"
    )


async def refuse_closed(store: Checkpointer, run_id: str, done: str) -> None:
    """``RunClosed`` if the run is closed: a person's decision on it would change nothing."""
    if await store.final(run_id) is not None:
        raise closed_error(run_id, done)


def closed_error(run_id: str, done: str) -> RunClosed:
    return RunClosed(
        f"run {run_id!r} is closed: a closed run cannot be {done}, and nothing was recorded. "
        "`asiento show` tells how it ended"
    )
