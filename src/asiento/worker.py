"""Workers: claim submitted runs that need work and drive them, one lease at a time.

Submit a run with ``submit(store, run_id, task, agent=...)``; any number of
worker processes on any number of machines pointed at the same store drive
the runs. A run whose worker died is claimed again once its lease expires; a
run that keeps crashing its workers is parked with the reason recorded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from . import shutdown
from .agent import Agent
from .errors import LeaseLost, RunAbandoned, RunClosed, UncertainEffect, UsageError
from .events import ApprovalStep, Claim, FinalStep, RunStatus
from .journal.base import Checkpointer
from .lease import Holder
from .model import Gateway
from .session import Session

log = logging.getLogger("asiento.worker")

# How often a waiting claim looks for a shutdown request (seconds).
_SHUTDOWN_POLL = 0.1


async def submit(store: Checkpointer, run_id: str, task: str, *, agent: str = "default") -> None:
    """Queue a run for the workers; ``agent`` names which of the app's agents drives it."""
    if not isinstance(task, str):
        raise UsageError("submit(task=...) must be a str")
    await store.submit(run_id, task, agent=agent)


@dataclass(slots=True)
class App:
    """What a worker needs: the agents by name, and how to reach the model."""

    agents: Mapping[str, Agent]
    gateway: Gateway | Callable[[], Gateway]
    lease_ttl: float = 30.0
    max_attempts: int = 5

    def gateway_for(self) -> Gateway:
        """The gateway itself, or a new one from its factory (one per run driven)."""
        return self.gateway if isinstance(self.gateway, Gateway) else self.gateway()


@dataclass(slots=True)
class WorkerStats:
    """What a worker did, for its logs and for tests."""

    claimed: int = 0
    closed: int = 0
    suspended: int = 0
    uncertain: int = 0
    failed: int = 0
    runs: list[str] = field(default_factory=list)


async def _unless_stopping(claiming: Awaitable[Claim | None]) -> Claim | None:
    """Await a claim, but give it up when a shutdown is requested meanwhile.

    A claim waits for a connection as long as the store's timeout (30 s on PostgreSQL)
    when the database is down; SIGTERM must not wait that long. A claim cut short
    may still have landed: that run's lease then expires and another worker takes it.
    """
    task = asyncio.ensure_future(claiming)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_SHUTDOWN_POLL)
        if done:
            return task.result()
        if shutdown.requested():
            task.cancel()
            await asyncio.wait({task}, timeout=_SHUTDOWN_POLL * 50)
            raise shutdown.ShutdownRequested("a shutdown was requested while claiming a run")


class Worker:
    """Claims runs from ``store`` and drives them with ``app``'s agents."""

    def __init__(self, store: Checkpointer, app: App, *, poll: float = 0.5) -> None:
        self.store, self.app, self.poll = store, app, poll
        self.holder = Holder.here()
        self.stats = WorkerStats()

    async def run_once(self) -> bool:
        """Claim one run and drive it until it ends or needs a person; False if none needed work."""
        app = self.app
        claiming = self.store.claim(self.holder, ttl=app.lease_ttl, max_attempts=app.max_attempts)
        claim = await _unless_stopping(claiming)
        if claim is None:
            return False
        self.stats.claimed += 1
        self.stats.runs.append(claim.lease.run_id)
        await self._drive(claim)
        return True

    async def run(self, *, until_idle: bool = False, max_seconds: float | None = None) -> None:
        """Work until a shutdown is requested (or, with ``until_idle``, no run needs work)."""
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        while not shutdown.requested():
            if deadline is not None and time.monotonic() > deadline:
                return
            if not await self.run_once():
                if until_idle:
                    return
                await asyncio.sleep(self.poll)

    async def _drive(self, claim: Claim) -> None:
        run_id = claim.lease.run_id
        agent = self.app.agents.get(claim.agent)
        if agent is None:
            reason = f"no agent named {claim.agent!r} in this worker's app"
            await self.store.set_status(run_id, RunStatus.PARKED, reason=reason)
            await self.store.release(claim.lease)
            return
        session = Session(
            run_id,
            self.app.gateway_for(),
            self.store,
            lease_ttl=self.app.lease_ttl,
            lease=claim.lease,
        )
        try:
            self._count(await self._pass(agent, claim.task, session))
        except shutdown.ShutdownRequested:
            raise
        except RunAbandoned as exc:  # a person closed it: nothing more to do here
            log.warning("%s", exc)
            self._count(RunStatus.CLOSED)
        except LeaseLost as exc:
            log.warning("run %r: %s", run_id, exc)
        except UncertainEffect:
            self._count(RunStatus.UNCERTAIN)
        except Exception as exc:
            await self._failed(run_id, exc)

    async def _pass(self, agent: Agent, task: str, session: Session) -> RunStatus:
        """How the pass left the run: closed, suspended, or still running (it stopped)."""
        status = RunStatus.RUNNING
        async for step in agent.run(task, session=session):
            if isinstance(step, FinalStep):
                status = RunStatus.CLOSED
            elif isinstance(step, ApprovalStep):
                status = RunStatus.SUSPENDED
        return status

    async def _failed(self, run_id: str, exc: Exception) -> None:
        """Note why the pass failed; the run stays claimable, and is parked if it keeps failing."""
        log.warning("run %r failed in this worker: %s", run_id, exc)
        reason = f"{type(exc).__name__}: {exc}"[:1000]
        try:
            await self.store.set_status(run_id, RunStatus.RUNNING, reason=reason)
        except RunClosed:  # abandoned meanwhile: a closed run stays closed
            self._count(RunStatus.CLOSED)
            return
        self.stats.failed += 1

    def _count(self, status: RunStatus) -> None:
        if status is RunStatus.CLOSED:
            self.stats.closed += 1
        elif status is RunStatus.SUSPENDED:
            self.stats.suspended += 1
        elif status is RunStatus.UNCERTAIN:
            self.stats.uncertain += 1
