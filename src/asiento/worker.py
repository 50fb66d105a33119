"""Workers: claim submitted runs that need work and drive them, each under its own lease.

Submit a run with ``submit(store, run_id, task, agent=...)``; any number of
worker processes on any number of machines pointed at the same store drive
the runs. A run whose worker died is claimed again once its lease expires; a
run that keeps crashing its workers is parked with the reason recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, cast

from . import shutdown
from .agent import Agent
from .errors import (
    DuplicateRecord,
    LeaseLost,
    RunAbandoned,
    RunClosed,
    UncertainEffect,
    UsageError,
)
from .events import ApprovalStep, Claim, FinalStep, RunStatus, Step
from .journal.base import Checkpointer
from .lease import Holder
from .model import Gateway
from .session import Session, give_back
from .telemetry import metrics, tracing
from .tools import check_count, check_seconds, check_timeout, tool_threads_at_least

log = logging.getLogger("asiento.worker")

_T = TypeVar("_T")

# How often a waiting claim looks for a shutdown request (seconds).
_SHUTDOWN_POLL = 0.1
# How long a run cut at the end of a shutdown's grace may take to release its lease.
_CUT_SECONDS = 5.0


async def submit(store: Checkpointer, run_id: str, task: str, *, agent: str = "default") -> None:
    """Queue a run for the workers; ``agent`` names which of the app's agents drives it.

    Submitted under a span of the caller's (a web request's, say), the run's trace is
    that span's: its passes join the caller's trace (docs/observability.md).
    """
    if not isinstance(task, str):
        raise UsageError("submit(task=...) must be a str")
    await store.submit(run_id, task, agent=agent)
    caller = tracing.caller_context()
    if caller is not None:  # a pass that began meanwhile keeps the trace it recorded
        with contextlib.suppress(DuplicateRecord, RunClosed):
            await store.append(tracing.context_record(run_id, caller))


class Drivable(Protocol):
    """What a worker drives: an ``Agent``, or a framework's agent wrapped for asiento
    (``asiento.integrations.pydantic_ai.WorkerAgent``)."""

    def run(self, task: str, *, session: Session) -> AsyncIterator[Step]: ...


@dataclass(slots=True)
class App:
    """What a worker needs: the agents by name, and how to reach the model."""

    agents: Mapping[str, Agent | Drivable]
    gateway: Gateway | Callable[[], Gateway]
    lease_ttl: float = 30.0
    # Claims counted against a run before it is parked: a pass that failed, or a worker
    # that died while one of the run's tools was in flight (docs/fleet.md).
    max_attempts: int = 5
    # Worker deaths in a row with none of the run's tools in flight and no new record in
    # between, before the run is parked (0: never): what may kill a worker outside a tool.
    max_lapses: int = 20
    # Seconds a tool step may take, for tools that set no ``@tool(timeout=...)`` (None:
    # no limit); past it an idempotent tool's step fails, any other is uncertain.
    tool_timeout: float | None = None
    # Seconds a shutdown waits for the steps in flight to finish; then they are cut and
    # their runs stay resumable (docs/fleet.md); within Kubernetes' default 30 s.
    shutdown_grace: float = 25.0

    def __post_init__(self) -> None:
        # Refused here, not at each run: a bad value would fail every run's pass and
        # park them all after max_attempts.
        if not isinstance(self.agents, Mapping) or not all(
            isinstance(name, str) and callable(getattr(agent, "run", None))
            for name, agent in self.agents.items()
        ):
            raise UsageError(
                "App(agents=...) takes a mapping of names to agents "
                f"({{'default': Agent(...)}}), got {self.agents!r:.100}"
            )
        check_seconds(self.lease_ttl, "App(lease_ttl=...)")
        check_count(self.max_attempts, "App(max_attempts=...)", least=1)
        check_count(self.max_lapses, "App(max_lapses=...)", least=0)
        check_timeout(self.tool_timeout, "App(tool_timeout=...)")
        check_seconds(self.shutdown_grace, "App(shutdown_grace=...)")

    def gateway_for(self) -> Gateway:
        """The gateway itself, or a new one from its factory (one per run driven)."""
        # What isinstance(gateway, Gateway) asks, without the runtime protocol's cost
        # (tens of microseconds, paid for every run a worker drives).
        if callable(getattr(self.gateway, "complete", None)):
            return cast("Gateway", self.gateway)
        return cast("Callable[[], Gateway]", self.gateway)()


@dataclass(slots=True)
class WorkerStats:
    """What a worker did, for its logs and for tests."""

    claimed: int = 0
    closed: int = 0
    suspended: int = 0
    uncertain: int = 0
    failed: int = 0
    runs: list[str] = field(default_factory=list)


async def _unless_stopping(claiming: Awaitable[_T]) -> _T:
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
    """Claims runs from ``store``; drives up to ``concurrency`` at once with ``app``'s agents.

    Each run claimed is driven in its own task under its own lease (its session renews
    it); a run whose pass crashes is that run's business, not the others'. Sync tools
    run on asiento's tool threads, sized to at least ``concurrency``.
    """

    def __init__(
        self, store: Checkpointer, app: App, *, poll: float = 0.5, concurrency: int = 1
    ) -> None:
        check_count(concurrency, "Worker(concurrency=...)", least=1)
        if not poll > 0:
            raise UsageError(f"Worker(poll=...) must be > 0 seconds, not {poll!r}")
        self.store, self.app, self.poll = metrics.counted(store), app, poll
        self.concurrency = concurrency
        self.holder = Holder.here()
        self.stats = WorkerStats()
        self._in_flight: set[asyncio.Task[None]] = set()
        self._freed = asyncio.Event()  # a run in flight ended: a slot may be free
        self._stopped_by_shutdown = False
        tool_threads_at_least(concurrency)

    async def run_once(self) -> bool:
        """Claim one run and drive it until it ends or needs a person; False if none needed work."""
        app = self.app
        claiming = self.store.claim(
            self.holder, ttl=app.lease_ttl, max_attempts=app.max_attempts, max_lapses=app.max_lapses
        )
        claim = await _unless_stopping(claiming)
        if claim is None:
            return False
        self._note(claim)
        await self._drive(claim)
        return True

    async def run(self, *, until_idle: bool = False, max_seconds: float | None = None) -> None:
        """Work until a shutdown is requested (or, with ``until_idle``, no run needs work).

        On a shutdown request no new run is claimed; every run in flight finishes its
        step, records it and releases its lease, then ``ShutdownRequested`` is raised.
        A step still running ``app.shutdown_grace`` seconds after the request is cut:
        its run's lease is released and the run resumes from the journal elsewhere.
        At ``max_seconds`` the runs in flight are driven to their end first.
        """
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        self._stopped_by_shutdown = False
        self._freed = asyncio.Event()  # this loop's: a worker may be run on several
        metrics.watch_waiting(self.store, asyncio.get_running_loop())
        try:
            await self._claim_and_start(until_idle, deadline)
        except asyncio.CancelledError:
            await self._finish_in_flight(cancel=True)
            raise
        except BaseException:  # a claim failed or was cut short: the runs in flight go on
            await self._finish_in_flight(cancel=False)
            raise
        finally:
            metrics.watch_waiting(self.store, None)
        await self._finish_in_flight(cancel=False)
        if shutdown.requested():
            self._stopped_by_shutdown = True
        if self._stopped_by_shutdown:
            raise shutdown.ShutdownRequested("a shutdown was requested while runs were driven")

    async def _claim_and_start(self, until_idle: bool, deadline: float | None) -> None:
        app = self.app
        while not shutdown.requested():
            if deadline is not None and time.monotonic() > deadline:
                return
            free = self.concurrency - len(self._in_flight)
            if free <= 0:
                await self._wait(None, deadline)
                continue
            claiming = self.store.claim_many(
                self.holder,
                limit=free,
                ttl=app.lease_ttl,
                max_attempts=app.max_attempts,
                max_lapses=app.max_lapses,
            )
            claims = await _unless_stopping(claiming)
            for claim in claims[:free]:
                self._note(claim)
                task = asyncio.create_task(self._drive_apart(claim), name=claim.lease.run_id)
                task.add_done_callback(self._slot_freed)
                self._in_flight.add(task)
            if len(claims) >= free:
                continue
            if until_idle and not self._in_flight and not claims:
                return
            idle = None if until_idle else self.store.wait_for_work(self.poll)
            await self._wait(idle, deadline)

    async def _wait(self, idle: Awaitable[None] | None, deadline: float | None) -> None:
        """Until a slot frees, ``idle`` returns (wake-up or poll), a shutdown or the deadline.

        A run's end sets ``_freed`` (its task's done callback): one future to wait on,
        not a callback on every run in flight at every wait.
        """
        waiter = None if idle is None else asyncio.ensure_future(idle)
        try:
            while not shutdown.requested():
                if self._reap():  # a run ended since the last look
                    return
                if waiter is None and not self._in_flight:
                    return
                self._freed.clear()  # no run in flight has ended: its callback is to come
                freed = asyncio.ensure_future(self._freed.wait())
                watched = {freed} if waiter is None else {freed, waiter}
                try:
                    done, _ = await asyncio.wait(
                        watched, timeout=_SHUTDOWN_POLL, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    freed.cancel()
                if waiter in done or (deadline is not None and time.monotonic() > deadline):
                    self._reap()
                    return
        finally:
            if waiter is not None and not waiter.done():
                waiter.cancel()
                await asyncio.wait({waiter})

    def _slot_freed(self, task: asyncio.Task[None]) -> None:
        self._freed.set()

    async def _finish_in_flight(self, *, cancel: bool) -> None:
        """Let every run in flight end (or, when the worker itself is cancelled, cancel them).

        Once a shutdown is requested, the wait lasts ``app.shutdown_grace`` from the
        request: a step that never returns must not keep a stopping worker alive.
        """
        if cancel:
            for task in self._in_flight:
                task.cancel()
        while self._in_flight:
            left = shutdown.grace_left(self.app.shutdown_grace)
            if left is not None and left <= 0:
                await self._cut(set(self._in_flight))
                break
            poll = _SHUTDOWN_POLL if left is None else min(left, _SHUTDOWN_POLL)
            await asyncio.wait(set(self._in_flight), timeout=poll)
            self._reap()
        self._reap()

    async def _cut(self, late: set[asyncio.Task[None]]) -> None:
        """The grace is over: cancel the runs whose steps are still running.

        Each run's lease is released as its pass unwinds; a step cut this way was
        submitted and has no outcome, so the replay table settles it on resume (an
        idempotent tool runs again, another is reconciled or left uncertain).
        """
        for task in late:
            log.warning(
                "run %r: its step was still running %g s after the shutdown request;"
                " cut, the run stays resumable",
                task.get_name(),
                self.app.shutdown_grace,
            )
            task.cancel()
        await asyncio.wait(late, timeout=_CUT_SECONDS)
        for task in late:
            self._in_flight.discard(task)

    def _reap(self) -> int:
        """Forget the runs in flight that ended; how many."""
        ended = [t for t in self._in_flight if t.done()]
        for task in ended:
            self._in_flight.discard(task)
            if task.cancelled():
                continue
            if isinstance(task.exception(), shutdown.ShutdownRequested):
                self._stopped_by_shutdown = True
        return len(ended)

    async def _drive_apart(self, claim: Claim) -> None:
        """Drive one run in its own task: what goes wrong there is logged, never spread."""
        try:
            await self._drive(claim)
        except (shutdown.ShutdownRequested, asyncio.CancelledError):
            raise
        except Exception as exc:  # recording the failure itself failed (the store is down)
            log.error("run %r: the worker could not record its pass: %s", claim.lease.run_id, exc)
            self.stats.failed += 1

    def _note(self, claim: Claim) -> None:
        self.stats.claimed += 1
        metrics.claimed()
        self.stats.runs.append(claim.lease.run_id)
        if claim.in_flight is not None:
            log.warning(
                "run %r: its last worker died while its tool step %s was in flight; claim %d"
                " of %d counted against it",
                claim.lease.run_id,
                claim.in_flight,
                claim.attempts,
                self.app.max_attempts,
            )

    async def _drive(self, claim: Claim) -> None:
        with metrics.driving():
            await self._drive_claimed(claim)

    async def _drive_claimed(self, claim: Claim) -> None:
        run_id = claim.lease.run_id
        agent = self.app.agents.get(claim.agent)
        if agent is None:
            reason = f"no agent named {claim.agent!r} in this worker's app"
            await self.store.set_status(run_id, RunStatus.PARKED, reason=reason)
            metrics.parked("no_agent")
            await self.store.release(claim.lease)
            return
        try:
            session = Session(
                run_id,
                self.app.gateway_for(),
                self.store,
                lease_ttl=self.app.lease_ttl,
                lease=claim.lease,
                tool_timeout=self.app.tool_timeout,
            )
        except Exception as exc:  # a gateway factory that raised, a gateway Session refused
            self._failed(run_id, exc, closed=not await give_back(self.store, claim.lease, exc))
            return
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
            await session.give_back(exc)  # a claim the pass never drove is noted and released
            self._failed(run_id, exc, closed=session.found_closed)

    async def _pass(self, agent: Agent | Drivable, task: str, session: Session) -> RunStatus:
        """How the pass left the run: closed, suspended, or still running (it stopped)."""
        status = RunStatus.RUNNING
        async for step in agent.run(task, session=session):
            if isinstance(step, FinalStep):
                status = RunStatus.CLOSED
            elif isinstance(step, ApprovalStep):
                status = RunStatus.SUSPENDED
        return status

    def _failed(self, run_id: str, exc: Exception, *, closed: bool) -> None:
        """Why was noted under the lease; the run is parked if it keeps failing."""
        if closed:  # abandoned meanwhile: a closed run stays closed
            self._count(RunStatus.CLOSED)
            return
        log.warning("run %r failed in this worker: %s", run_id, exc)
        self.stats.failed += 1

    def _count(self, status: RunStatus) -> None:
        if status is RunStatus.CLOSED:
            self.stats.closed += 1
        elif status is RunStatus.SUSPENDED:
            self.stats.suspended += 1
        elif status is RunStatus.UNCERTAIN:
            self.stats.uncertain += 1
