"""``Session``: one attempt at driving one run, in one process, under its lease."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from . import lease as lease_state
from . import step_ids
from .errors import (
    AsientoError,
    LeaseLost,
    RunAbandoned,
    RunClosed,
    RunLocked,
    UncertainEffect,
    UsageError,
)
from .events import Lease, Phase, RunStatus, Savings, StepEvent
from .journal.base import Checkpointer, check_id
from .lease import Holder
from .ledger import PriceTable
from .model import Gateway
from .payloads import Final
from .shutdown import ShutdownRequested
from .shutdown import requested as shutdown_requested
from .telemetry import metrics
from .tools import check_seconds, check_timeout

log = logging.getLogger("asiento")

# What the loop calls on its journal; the harness and workers use the rest.
_LOOP_NEEDS = ("append", "load", "final", "set_status", "acquire", "renew", "release")

# How a pass may end that is no failure of the run: its status says the rest.
_NOT_FAILURES = (ShutdownRequested, LeaseLost, UncertainEffect, RunClosed)


@dataclass(slots=True)
class RunStats:
    """What this session paid for and what the journal saved it from paying again."""

    model_calls: int = 0
    model_calls_replayed: int = 0
    model_calls_repaid: int = 0  # streamed generations earlier passes paid and lost to a cut
    tool_calls: int = 0
    tool_calls_replayed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    input_tokens_saved: int = 0
    output_tokens_saved: int = 0
    cost: float = 0.0
    cost_saved: float = 0.0

    def savings(self) -> Savings:
        return Savings(
            calls=self.model_calls_replayed,
            input_tokens=self.input_tokens_saved,
            output_tokens=self.output_tokens_saved,
            cost=self.cost_saved,
        )


class Session:
    """Binds a run id to the model gateway and the journal, and holds the run's lease.

    A second session on a run that is held fails fast with ``RunLocked`` naming
    the holder, or waits up to ``wait`` seconds for it. The lease lasts
    ``lease_ttl`` seconds and is renewed while the session drives the run.
    ``lease`` is one a worker already claimed for this run. With ``prices``
    (model name to ``Price``), every model step records what it cost.
    ``tool_timeout``: seconds a tool step may take, for tools that set no
    ``@tool(timeout=...)`` of their own (None: no limit; docs/fleet.md).
    """

    def __init__(
        self,
        run_id: str,
        gateway: Gateway,
        store: Checkpointer,
        *,
        lease_ttl: float = 30.0,
        wait: float = 0.0,
        lease: Lease | None = None,
        prices: PriceTable | None = None,
        tool_timeout: float | None = None,
    ) -> None:
        self.run_id = check_id("run_id", run_id)
        self.tool_timeout = check_timeout(tool_timeout, "Session(tool_timeout=...)")
        if not callable(getattr(gateway, "complete", None)):
            raise UsageError(
                f"gateway {gateway!r} has no complete(request, *, idempotency_key) coroutine"
            )
        missing = [m for m in _LOOP_NEEDS if not callable(getattr(store, m, None))]
        if missing:
            raise UsageError(
                f"store {store!r} is not a Checkpointer: it lacks {', '.join(missing)}"
            )
        check_seconds(lease_ttl, "Session(lease_ttl=...)")
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not wait >= 0:
            raise UsageError(f"Session(wait=...) takes seconds >= 0, got {wait!r}")
        self.gateway = gateway
        self.store = store
        self.lease_ttl = lease_ttl
        self.wait = wait
        self.holder = Holder.here()
        self.stats = RunStats()
        self.prices = prices
        if lease is not None and lease.run_id != self.run_id:
            raise UsageError(f"Session(lease=...) holds run {lease.run_id!r}, not {self.run_id!r}")
        self._claimed = lease
        self._driven: tuple[Savings, _Keeper] | None = None  # savings before, the renewals
        self.found_closed = False  # noting a failure found the run closed (abandoned meanwhile)

    def __repr__(self) -> str:
        return f"Session(run_id={self.run_id!r})"

    @property
    def claimed(self) -> bool:
        """Whether a worker's claim already holds the run for this session (not yet driven)."""
        return self._claimed is not None

    @contextlib.asynccontextmanager
    async def driving(self) -> AsyncIterator[Lease]:
        """Hold the run's lease for the body: acquire, keep alive, release."""
        lease = await self._acquire()
        before = self.stats.savings()
        keeper = _Keeper(self, lease)
        self._driven = (before, keeper)
        clean = False
        try:
            yield lease
        except ShutdownRequested:
            clean = True
            raise
        except asyncio.CancelledError:  # cut at the end of a shutdown's grace: not its fault
            clean = shutdown_requested()
            raise
        except Exception as exc:
            if not isinstance(exc, _NOT_FAILURES):
                await self._note_failure(lease, exc)
            raise
        finally:
            await keeper.stopped()
            lease_state.ended(lease.owner)
            if self._driven is not None:  # else the closing append gave the lease up
                self._driven = None
                await self._release(lease, before, clean=clean)

    def closing(self) -> Savings | None:
        """What the pass saved, for the append that closes the run to give the lease up
        with (one commit a run fewer); None when no lease is being driven. Renewals stop
        here: a renewal that lands after the lease is given up would only be refused."""
        if self._driven is None:
            return None
        before, keeper = self._driven
        keeper.stop()
        return self.stats.savings() - before

    def closed(self) -> None:
        """The closing append landed with its release: nothing is left to give up."""
        self._driven = None

    async def _note_failure(self, lease: Lease, exc: Exception) -> None:
        if not await note_failure(self.store, lease, exc):
            self.found_closed = True

    async def give_back(self, exc: Exception) -> None:
        """The pass failed before it drove the run: note why under the claim, release it."""
        lease, self._claimed = self._claimed, None
        if lease is not None and not await give_back(self.store, lease, exc):
            self.found_closed = True

    async def settle_closed(self) -> None:
        """The run turned out closed: give back a lease a worker claimed for it.

        The index is set to closed too (it said running, or the run would not have
        been claimed), so no worker claims the closed run again.
        """
        lease, self._claimed = self._claimed, None
        if lease is None:
            return
        try:
            await self.store.set_status(self.run_id, RunStatus.CLOSED, lease=lease)
        except AsientoError as exc:
            log.warning("run %r: could not mark the closed run closed: %s", self.run_id, exc)
        finally:
            lease_state.ended(lease.owner)
            await self._release(lease, self.stats.savings(), clean=False)

    async def _acquire(self) -> Lease:
        if self._claimed is not None:  # a worker claimed the run for this session
            lease, self._claimed = self._claimed, None
            return lease
        deadline = time.monotonic() + self.wait
        while True:
            try:
                return await self.store.acquire(self.run_id, self.holder, ttl=self.lease_ttl)
            except RunLocked:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                await asyncio.sleep(min(0.2, left))

    async def _release(self, lease: Lease, before: Savings, *, clean: bool) -> None:
        try:
            await self.store.release(lease, savings=self.stats.savings() - before, clean=clean)
        except AsientoError as exc:  # never hide the error that ended the body
            log.warning("run %r: could not release the lease: %s", self.run_id, exc)


async def note_failure(store: Checkpointer, lease: Lease, exc: Exception) -> bool:
    """Record why a pass failed while its lease still holds the run; False if it was closed.

    After the release a neighbour's claim may park the run for its attempts; a note
    written then would set it running again, past ``max_attempts``.
    """
    reason = f"{type(exc).__name__}: {exc}"[:1000]
    try:
        await store.set_status(lease.run_id, RunStatus.RUNNING, reason=reason, lease=lease)
    except RunClosed:
        return False
    except Exception as noted:  # never hide the error that ended the body
        log.warning("run %r: could not note why its pass failed: %s", lease.run_id, noted)
    return True


async def give_back(store: Checkpointer, lease: Lease, exc: Exception) -> bool:
    """A claim no pass drove: note why and release it at once, not at its lapse.

    False if the run turned out closed (abandoned meanwhile).
    """
    try:
        return await note_failure(store, lease, exc)
    finally:
        lease_state.ended(lease.owner)
        try:
            await store.release(lease, clean=False)
        except AsientoError as released:
            log.warning("run %r: could not release the lease: %s", lease.run_id, released)


async def abandonment(
    store: Checkpointer, run_id: str, unrecorded: Sequence[StepEvent] = ()
) -> RunAbandoned | None:
    """The error for a lease lost to a person who abandoned the run, if that is what
    happened (abandoning takes the run's fence); ``unrecorded``: what the pass lost."""
    try:
        final = await store.final(run_id)
    except AsientoError:
        return None
    closed = None if final is None else Final.from_json(final.payload)
    if closed is None or not closed.abandoned:
        return None
    lost = {e.step_id for e in unrecorded if e.phase is Phase.RESULT}
    text = closed.text or "abandoned"
    return RunAbandoned(run_id, text, tuple(sorted(lost - {step_ids.FINAL})))


class _Keeper:
    """Renews a session's lease while its body runs (long tools, slow consumers).

    A renewal is due a third of the lease after the last one began; how late it
    committed past that moment is its lag (``asiento.lease.renewal_lag``). Until one
    is due there is only a timer: most passes end before their first renewal, and a
    task kept asleep for each would cost every pass its start and its cancellation.
    """

    def __init__(self, session: Session, lease: Lease) -> None:
        self.session, self.lease = session, lease
        self.loop = asyncio.get_running_loop()
        self.renewing: asyncio.Task[None] | None = None
        self._schedule()

    def _schedule(self) -> None:
        every = self.session.lease_ttl / 3
        self.due = time.monotonic() + every
        self.timer: asyncio.TimerHandle | None = self.loop.call_later(every, self._start)

    def _start(self) -> None:
        self.timer = None
        self.renewing = self.loop.create_task(self._renew())

    async def _renew(self) -> None:
        session = self.session
        try:
            await session.store.renew(self.lease, ttl=session.lease_ttl)
            metrics.renewed(time.monotonic() - self.due)
        except LeaseLost:
            log.warning(
                "run %r: lease lost; the session's next write will be refused", session.run_id
            )
            return
        except AsientoError as exc:
            log.warning("run %r: could not renew the lease: %s", session.run_id, exc)
        self._schedule()

    def stop(self) -> None:
        """No renewal from now on (one under way is cut)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.renewing is not None:
            self.renewing.cancel()

    async def stopped(self) -> None:
        """``stop``, and wait for a renewal under way to unwind."""
        self.stop()
        if self.renewing is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.renewing
