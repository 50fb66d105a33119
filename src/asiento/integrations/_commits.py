"""How a framework's pass writes the journal, as the native loop does.

A new model answer is held (``hold``) and committed with what follows it: its
first tool's intent and submitted, or the final record, so a model+tool step costs
two commits. Parallel tool calls append concurrently; a lock keeps their commits in
the order they took the held answer, so an intent is never durable before the answer
that asked for it. A pass that stops before a commit took the answer records it all
the same (``keep_paid_answer``), so the next pass does not pay for it again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .. import step_ids
from .._crash import crash_point
from ..errors import AsientoError, LeaseLost, RecordTooLarge, RunAbandoned
from ..events import Decision, Lease, Phase, RunStatus, Savings, StepEvent
from ..journal.base import Checkpointer
from ..replay import Indexed
from ..session import Session, abandonment

log = logging.getLogger("asiento")


class HeldCommits:
    """The journal as this pass knows it, and its writes (subclassed by each framework's pass)."""

    def __init__(self, run_id: str, store: Checkpointer, lease: Lease, journal: Indexed) -> None:
        self.run_id, self.store, self.lease, self.journal = run_id, store, lease, journal
        self.held: list[StepEvent] = []  # a new model answer, for the next commit
        self.writing = asyncio.Lock()  # commits in the order they took ``held``

    def event(
        self, step_id: str, phase: Phase, payload: Any, decision: Decision | None = None
    ) -> StepEvent:
        return StepEvent(
            run_id=self.run_id, step_id=step_id, phase=phase, payload=payload, decision=decision
        )

    def hold(self, answer: StepEvent) -> None:
        """A new model answer: committed with the next append."""
        self.held.append(answer)

    async def append(
        self, *events: StepEvent, status: RunStatus | None = None, release: Savings | None = None
    ) -> None:
        """Commit ``events`` in one transaction, after the model answer held for them
        (``release``: the closing commit gives the lease up too, ``append_closing``)."""
        held, self.held = self.held, []
        batch = [*held, *events]
        if not batch:
            if status is not None:
                await self.store.set_status(self.run_id, status, lease=self.lease)
            return
        async with self.writing:
            try:
                closing = {} if release is None else {"release": release}
                await self.store.append(*batch, status=status, lease=self.lease, **closing)
            except RecordTooLarge:  # nothing written: the paid answer must not go with it
                self.held = [*held, *self.held]
                raise
            except RunAbandoned:
                raise
            except LeaseLost as lost:  # abandoned: say which outcomes this pass could not keep
                abandoned = await abandonment(self.store, self.run_id, batch)
                if abandoned is None:
                    raise
                raise abandoned from lost
        for event in batch:
            self.journal.setdefault(event.step_id, {})[event.phase] = event
        if any(e.phase is Phase.RESULT and step_ids.is_model(e.step_id) for e in batch):
            crash_point("after_model_result")

    async def append_closing(self, session: Session, *events: StepEvent) -> None:
        """The run's closing commit, which gives ``session``'s lease up in its own
        transaction, as a native run's does: one commit a run fewer, and no closed run
        left holding a lease by a kill between the two."""
        await self.append(*events, status=RunStatus.CLOSED, release=session.closing())
        session.closed()

    async def settle(self) -> None:
        """Commit a held model answer now: the pass ends, or asks the model again first."""
        if self.held:
            await self.append()

    async def keep_paid_answer(self) -> None:
        """The pass stopped before a commit took the held answer (an error, a guardrail, a
        validator's failure, max turns): record it all the same."""
        try:
            await self.settle()
        except AsientoError as exc:
            log.warning("run %r: could not record the last answer: %s", self.run_id, exc)
