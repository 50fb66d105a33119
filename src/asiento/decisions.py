"""What a person (or their script, CLI or web page) writes while no loop runs.

Approvals, denials and resolutions are journal records like any other: the
checkpointer is the run's diary, not a private store of the loop.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from . import budget as budgets
from . import lease as lease_state
from . import step_ids
from ._crash import crash_point
from .errors import (
    ApprovalRefused,
    AsientoError,
    DecisionOnClosedRun,
    DuplicateRecord,
    LeaseLost,
    RunClosed,
    RunLocked,
    UsageError,
)
from .events import Decision, Lease, Phase, RunStatus, StepEvent
from .journal.base import Checkpointer, check_id
from .lease import Holder
from .payloads import Approval, BudgetRaise, Final, Resolution
from .replay import Indexed, Waits, index, same_fingerprint, step_state, waits_for
from .views import Waiting, decided_by, find_run, waiting

# How long a person's write holds the run's lease (it holds it for one transaction; if
# the deciding process dies meanwhile, the run is free again at the latest by then).
DECISION_TTL = 10.0

log = logging.getLogger("asiento")

_APPROVED_OR_DENIED = "approved or denied"


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
    if not isinstance(by, str) or not by:
        raise UsageError("say who decides: by='name'")
    pending = await pending_approval(store, run_id, step_id)
    where, frozen = f"run {run_id!r} step {pending.step_id!r}", pending.fingerprint
    if fingerprint is not None and not same_fingerprint(fingerprint, frozen):
        raise ApprovalRefused(
            f"{where}: you were shown the arguments of fingerprint {fingerprint!r}, but the "
            f"step froze fingerprint {frozen!r}; nothing was recorded"
        )
    event = StepEvent(
        run_id=run_id,
        step_id=pending.step_id,
        phase=Phase.APPROVAL,
        decision=Decision.APPROVED if approved else Decision.DENIED,
        payload=Approval(approved=approved, by=by, reason=reason, fp=frozen).to_json(),
    )
    crash_point("during_approval")
    first = ApprovalRefused(f"{where} was decided by someone else first; nothing recorded")
    return await _record_decision(store, event, first=first, done=_APPROVED_OR_DENIED)


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
    if not isinstance(happened, bool):
        raise UsageError("resolve(happened=...) takes True or False")
    found = Resolution(
        happened=happened,
        by=by,
        reason=reason,
        remote_id=remote_id,
        result=(result if result is not None else {"remote_id": remote_id}) if happened else None,
    )
    await pending_resolution(store, run_id, step_id)
    # The run's lease, taken for this one write: a session still driving the run may
    # record the step's own outcome yet (RunLocked), and a stale one writes nothing after.
    async with _holding(store, run_id, busy=_driven) as lease:
        pending = await pending_resolution(store, run_id, step_id)  # as it is under the lease
        where = f"run {run_id!r} step {pending.step_id!r}"
        event = StepEvent(
            run_id=run_id,
            step_id=pending.record_id,
            phase=Phase.RESOLUTION,
            payload=found.to_json(),
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


async def raise_budget(
    store: Checkpointer,
    run_id: str,
    *,
    by: str,
    max_cost: float | None = None,
    max_tokens: int | None = None,
    max_model_calls: int | None = None,
    reason: str = "",
) -> StepEvent:
    """Raise the budget of a run stopped on it; the next pass makes the new calls.

    The raise is a journal record at the run's open stop (``budget{n}``), so every
    worker resuming the run sees it; each limit in force is the largest of the
    code's and of every raise (see ``asiento.budget``).
    """
    check_id("run_id", run_id)
    if not isinstance(by, str) or not by:
        raise UsageError("say who raises the budget: by='name'")
    asked = budgets.Budget(max_cost, max_tokens, max_model_calls)  # checks the numbers
    limits = {k: float(v) for k, v in asked.limits().items() if v is not None}
    if not limits:
        raise UsageError("say which limit to raise: max_cost, max_tokens or max_model_calls")
    events = await store.load(run_id)
    if not events and await store.run(run_id) is None:
        raise UsageError(f"unknown run {run_id!r} in this journal; `asiento runs` lists them")
    journal = index(events)
    _refuse_closed(journal, run_id, _RAISED)
    stop_id = budgets.open_stop(journal)
    if Phase.INTENT not in journal.get(stop_id, {}):
        raise UsageError(f"run {run_id!r} is not stopped on its budget; nothing was recorded")
    event = StepEvent(
        run_id=run_id,
        step_id=stop_id,
        phase=Phase.APPROVAL,
        payload=BudgetRaise(limits=limits, by=by, reason=reason).to_json(),
    )
    first = UsageError(
        f"run {run_id!r}: its budget was raised by someone else first; nothing recorded"
    )
    return await _record_decision(store, event, first=first, done=_RAISED)


_RAISED = "given a bigger budget"


async def _record_decision(
    store: Checkpointer, event: StepEvent, *, first: AsientoError, done: str
) -> StepEvent:
    """Append a person's decision (an approval, a raise) without taking the lease.

    A pass replaying meanwhile reads it in its conditional status and never
    overwrites it; ``first`` is raised if someone else decided first.
    """
    try:
        await store.append(event, status=RunStatus.RUNNING)
    except DuplicateRecord:
        raise first from None
    except RunClosed:
        raise closed_error(event.run_id, done) from None
    return event


async def pending_approval(store: Checkpointer, run_id: str, step_id: str) -> Waiting:
    """The step a person is about to approve or deny, or why they cannot.

    ``ApprovalRefused`` when it does not await a decision (or was decided),
    ``RunClosed`` when the run is closed, ``UsageError`` for an unknown run or step.
    """
    journal = await _journal_of(store, run_id, step_id, refused=ApprovalRefused, exact=True)
    state = step_state(journal, step_id)
    where = f"run {run_id!r} step {state.step_id!r}"
    _refuse_closed(journal, run_id, _APPROVED_OR_DENIED)
    if step_ids.is_retry(step_id):  # a decision names the step, never one of its attempts
        raise ApprovalRefused(f"{where} is not awaiting approval")
    decided = state.records.get(Phase.APPROVAL)
    if decided is not None:
        raise ApprovalRefused(f"{where} was already {decided_by(decided)}; nothing was recorded")
    if waits_for(state.records) is not Waits.APPROVAL:
        raise ApprovalRefused(f"{where} is not awaiting approval")
    return waiting(state, Waits.APPROVAL)


async def pending_resolution(store: Checkpointer, run_id: str, step_id: str) -> Waiting:
    """The step a person is about to resolve (submitted, no outcome), or why they cannot."""
    journal = await _journal_of(store, run_id, step_id)
    state = step_state(journal, step_ids.base(step_id))
    _refuse_closed(journal, run_id, "resolved")
    if waits_for(state.records, uncertain=True) is not Waits.RESOLUTION:
        raise UsageError(
            f"run {run_id!r} step {step_id!r} is not uncertain (submitted with no recorded outcome)"
        )
    return waiting(state, Waits.RESOLUTION)


async def _journal_of(
    store: Checkpointer,
    run_id: str,
    step_id: str,
    *,
    refused: type[UsageError] = UsageError,
    exact: bool = False,
) -> Indexed:
    """The run's journal, which must hold ``step_id`` (``exact``: that very id, else its
    step): else ``refused`` saying so."""
    check_id("run_id", run_id)
    check_id("step_id", step_id)
    events = await store.load(run_id)
    if not events and await store.run(run_id) is None:
        raise refused(f"unknown run {run_id!r} in this journal; `asiento runs` lists them")
    journal = index(events)
    if (step_id if exact else step_ids.base(step_id)) not in journal:
        raise refused(f"run {run_id!r} has no step {step_id!r}; `asiento show` lists its steps")
    return journal


def _refuse_closed(journal: Indexed, run_id: str, done: str) -> None:
    if Phase.RESULT in journal.get(step_ids.FINAL, {}):
        raise closed_error(run_id, done)


async def unpark(store: Checkpointer, run_id: str, *, by: str, reason: str = "") -> None:
    """Give a parked run back to the workers, with a fresh count of claims."""
    check_id("run_id", run_id)
    if not isinstance(by, str) or not by:
        raise UsageError("say who unparks the run: by='name'")
    if (await find_run(store, run_id)).status != RunStatus.PARKED:
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
    await find_run(store, run_id)
    if await store.final(run_id) is not None:
        raise RunClosed(f"run {run_id!r} is closed already; nothing recorded")
    closing = Final.abandoning(by, reason)
    event = StepEvent(
        run_id=run_id, step_id=step_ids.FINAL, phase=Phase.RESULT, payload=closing.to_json()
    )
    async with _holding(store, run_id, force=True) as lease:
        try:
            await store.append(event, status=RunStatus.CLOSED, lease=lease)
        except DuplicateRecord:
            raise RunClosed(f"run {run_id!r} is closed already; nothing recorded") from None
        await store.set_status(run_id, RunStatus.CLOSED, reason=closing.text, lease=lease)
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


def closed_error(run_id: str, done: str) -> RunClosed:
    """The refusal of a person's write on a closed run (a ``DecisionOnClosedRun`` when it
    was an approval or a denial)."""
    kind = DecisionOnClosedRun if done == _APPROVED_OR_DENIED else RunClosed
    return kind(
        f"run {run_id!r} is closed: a closed run cannot be {done}, and nothing was recorded. "
        "`asiento show` tells how it ended"
    )
