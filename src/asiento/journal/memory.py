"""A journal in a dict, for unit tests only: it survives nothing."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from .. import _clock, budget, step_ids
from ..errors import DuplicateRecord, UsageError
from ..events import Claim, Lease, Phase, RunInfo, RunStatus, Savings, StepEvent
from ..lease import Holder
from ..telemetry import metrics
from . import _rules as rules
from ._wakeup import WakeUp
from .base import (
    check_id,
    check_release,
    counts_of,
    decode_row,
    encode_batch,
    index_limit,
    lease_lost,
    may_take,
    one_by_one,
    run_closed,
    run_locked,
)

_Row = tuple[str, str, str | None, str, float]


@dataclasses.dataclass(slots=True)
class _Holding:
    host: str
    pid: int
    started: str
    ttl: float


class MemoryCheckpointer:
    """In-process journal with the same semantics as the durable ones."""

    def __init__(self) -> None:
        self._wakeup = WakeUp()
        self._rows: dict[str, list[_Row]] = {}
        self._keys: set[tuple[str, str, str]] = set()
        self._runs: dict[str, RunInfo] = {}
        self._holders: dict[str, _Holding] = {}
        self._queued: dict[str, float] = {}  # each run's place in the queue (``_rules``)
        self._claim_events: dict[str, int] = {}  # each run's records when last claimed

    async def append(
        self,
        *events: StepEvent,
        status: RunStatus | None = None,
        lease: Lease | None = None,
        release: Savings | None = None,
    ) -> None:
        run_id, rows = encode_batch(events)
        release = check_release(release, status, lease)
        if lease is not None:
            self._check_lease(lease)
        elif self._info(run_id).status == RunStatus.CLOSED:
            raise run_closed(run_id)
        for _, step_id, phase, *_ in rows:
            if (run_id, step_id, phase) in self._keys:
                raise DuplicateRecord(run_id, step_id, phase)
        for _, step_id, phase, decision, payload, created in rows:
            self._keys.add((run_id, step_id, phase))
            self._rows.setdefault(run_id, []).append((step_id, phase, decision, payload, created))
        usage = counts_of(events)
        info = self._info(run_id)
        self._requeue(run_id, info.status, status)
        self._runs[run_id] = dataclasses.replace(
            info,
            status=rules.status_after(info.status, status),
            attempts=rules.attempts_after(info.status, status, info.attempts),
            lapses=rules.attempts_after(info.status, status, info.lapses),
            events=info.events + len(rows),
            updated_at=time.time(),
            model_calls=info.model_calls + usage["calls"],
            input_tokens=info.input_tokens + usage["inp"],
            output_tokens=info.output_tokens + usage["out"],
            cost=info.cost + usage["cost"],
            tool_steps=info.tool_steps + usage["tools"],
            cached_input_tokens=info.cached_input_tokens + usage["cread"],
            cache_write_tokens=info.cache_write_tokens + usage["cwrite"],
            **_budget_after(info, events),
        )
        if release is not None:
            assert lease is not None
            self._give_up(lease, release, clean=False)

    def _requeue(self, run_id: str, current: RunStatus, requested: RunStatus | None) -> None:
        now = time.time()
        queued = self._queued.setdefault(run_id, now)
        self._queued[run_id] = rules.queued_after(queued, current, requested, now)

    def _info(self, run_id: str) -> RunInfo:
        now = time.time()
        return self._runs.get(run_id) or RunInfo(
            run_id=run_id, status=RunStatus.RUNNING, events=0, created_at=now, updated_at=now
        )

    def _check_lease(self, lease: Lease) -> None:
        info, holding, now = (
            self._runs.get(lease.run_id),
            self._holders.get(lease.run_id),
            time.time(),
        )
        if info is None or holding is None or info.fence != lease.token:
            raise lease_lost(lease)
        if info.lease_owner != lease.owner or (info.lease_expires or 0) < now:
            raise lease_lost(lease)
        self._runs[lease.run_id] = dataclasses.replace(info, lease_expires=now + holding.ttl)

    async def acquire(
        self, run_id: str, holder: Holder, *, ttl: float, force: bool = False
    ) -> Lease:
        info, now = self._info(run_id), time.time()
        held = self._holders.get(run_id)
        host, pid = (held.host, held.pid) if held else (None, None)
        if not force and not may_take(
            owner=info.lease_owner,
            host=host,
            pid=pid,
            started=held.started if held else None,
            expires=info.lease_expires,
            holder=holder,
            now=now,
        ):
            raise run_locked(run_id, host, pid, info.lease_expires or 0, now)
        self._holders[run_id] = _Holding(holder.host, holder.pid, holder.started, ttl)
        token = info.fence + 1
        self._runs[run_id] = dataclasses.replace(
            info,
            lease_owner=holder.owner,
            lease_expires=now + ttl,
            fence=token,
            lease_host=holder.host,
            lease_pid=holder.pid,
        )
        return Lease(run_id=run_id, token=token, owner=holder.owner, expires=now + ttl)

    async def renew(self, lease: Lease, *, ttl: float) -> Lease:
        if lease.run_id in self._holders:
            self._holders[lease.run_id].ttl = ttl
        self._check_lease(lease)
        expires = time.time() + ttl
        return Lease(run_id=lease.run_id, token=lease.token, owner=lease.owner, expires=expires)

    async def release(
        self, lease: Lease, *, savings: Savings | None = None, clean: bool = False
    ) -> None:
        self._give_up(lease, savings or Savings(), clean=clean)
        self._wakeup.ring()

    def _give_up(self, lease: Lease, saved: Savings, *, clean: bool) -> None:
        info = self._runs.get(lease.run_id)
        if info is None or info.fence != lease.token or info.lease_owner != lease.owner:
            return
        if info.status is RunStatus.RUNNING:
            self._queued[lease.run_id] = time.time()
        self._runs[lease.run_id] = dataclasses.replace(
            info,
            lease_owner=None,
            lease_expires=None,
            lease_host=None,
            lease_pid=None,
            replayed_calls=info.replayed_calls + saved.calls,
            saved_input_tokens=info.saved_input_tokens + saved.input_tokens,
            saved_output_tokens=info.saved_output_tokens + saved.output_tokens,
            saved_cost=info.saved_cost + saved.cost,
            attempts=max(info.attempts - 1, 0) if clean else info.attempts,
        )

    async def load(self, run_id: str) -> list[StepEvent]:
        return [decode_row(run_id, row) for row in self._rows.get(run_id, [])]

    async def load_step(self, run_id: str, step_id: str) -> list[StepEvent]:
        return [e for e in await self.load(run_id) if e.step_id == step_id]

    async def final(self, run_id: str) -> StepEvent | None:
        if (run_id, step_ids.FINAL, Phase.RESULT) not in self._keys:
            return None
        events = await self.load_step(run_id, step_ids.FINAL)
        return next(e for e in events if e.phase == Phase.RESULT)

    async def age(self, run_id: str, step_id: str, phase: Phase) -> float | None:
        for row_step, row_phase, _, _, created in self._rows.get(run_id, []):
            if (row_step, row_phase) == (step_id, Phase(phase).value):
                return _clock.now() - created
        return None

    async def set_status(
        self,
        run_id: str,
        status: RunStatus,
        *,
        reason: str | None = None,
        lease: Lease | None = None,
        waits_for: tuple[str, Phase] | None = None,
    ) -> bool:
        if run_id not in self._runs:
            raise UsageError(f"unknown run {run_id!r}")
        if lease is not None:
            self._check_lease(lease)
        if waits_for is not None and (run_id, waits_for[0], Phase(waits_for[1])) in self._keys:
            return False
        info, status = self._runs[run_id], RunStatus(status)
        if info.status == RunStatus.CLOSED and status != RunStatus.CLOSED:
            raise run_closed(run_id)
        self._requeue(run_id, info.status, status)
        self._runs[run_id] = dataclasses.replace(
            info,
            status=rules.status_after(info.status, status),
            updated_at=time.time(),
            reason=reason or info.reason,
            attempts=rules.attempts_after(info.status, status, info.attempts),
            lapses=rules.attempts_after(info.status, status, info.lapses),
        )
        self._wakeup.ring()
        return True

    async def submit(self, run_id: str, task: str, *, agent: str = "default") -> None:
        check_id("run_id", run_id)
        if run_id in self._runs:
            raise UsageError(f"run {run_id!r} already exists")
        self._runs[run_id] = dataclasses.replace(self._info(run_id), task=task, agent=agent)
        self._queued[run_id] = time.time()
        self._wakeup.ring()

    async def claim(
        self, holder: Holder, *, ttl: float, max_attempts: int = 5, max_lapses: int = 0
    ) -> Claim | None:
        now = time.time()
        queue = (self._queued.get(r.run_id, r.created_at) for r in self._runs.values())
        for _, run in sorted(zip(queue, self._runs.values(), strict=True), key=_queue_order):
            if not rules.claimable_now(run, now) or run.task is None:
                continue
            judged = self._judge(run)
            reason = run.reason if judged.in_flight is None else rules.died_in(judged.in_flight)
            info = dataclasses.replace(
                run, attempts=judged.attempts, lapses=judged.lapses, reason=reason
            )
            self._runs[info.run_id] = info
            if rules.parks(info.attempts, max_attempts, info.lapses, max_lapses):
                why = rules.parked_reason(
                    info.attempts, reason, lapses=info.lapses, max_lapses=max_lapses
                )
                await self.set_status(info.run_id, RunStatus.PARKED, reason=why)
                metrics.parked(rules.park_cause(info.lapses, max_lapses))
                continue
            return await self._take_claim(info, holder, ttl, judged.in_flight)
        return None

    def _judge(self, info: RunInfo) -> rules.Charge:
        """What the claim counts against the run (``_rules.charge``)."""
        lapsed = info.lease_owner is not None
        records = ((step_id, phase) for step_id, phase, *_ in self._rows.get(info.run_id, []))
        return rules.charge(
            attempts=info.attempts,
            lapses=info.lapses,
            lapsed=lapsed,
            in_flight=rules.in_flight(records) if lapsed else None,
            progressed=info.events > self._claim_events.get(info.run_id, 0),
        )

    async def _take_claim(
        self, info: RunInfo, holder: Holder, ttl: float, in_flight: str | None
    ) -> Claim:
        lease = await self.acquire(info.run_id, holder, ttl=ttl)
        taken = self._runs[info.run_id]
        self._runs[info.run_id] = dataclasses.replace(taken, attempts=taken.attempts + 1)
        self._queued[info.run_id] = time.time()  # to the back: leased runs stay out of the way
        self._claim_events[info.run_id] = info.events
        agent, task = info.agent or "default", info.task or ""
        return Claim(
            lease=lease, task=task, agent=agent, attempts=info.attempts + 1, in_flight=in_flight
        )

    async def claim_many(
        self,
        holder: Holder,
        *,
        limit: int,
        ttl: float,
        max_attempts: int = 5,
        max_lapses: int = 0,
    ) -> list[Claim]:
        return await one_by_one(
            self.claim(holder, ttl=ttl, max_attempts=max_attempts, max_lapses=max_lapses)
            for _ in range(limit)
        )

    async def wait_for_work(self, timeout: float) -> None:
        await self._wakeup.wait(timeout)

    async def runs(self, *, status: RunStatus | None = None) -> list[RunInfo]:
        return [r for r in self._runs.values() if status is None or r.status == status]

    async def run(self, run_id: str) -> RunInfo | None:
        return self._runs.get(run_id)

    async def close(self) -> None:
        return None


def _queue_order(entry: tuple[float, RunInfo]) -> tuple[float, bytes]:
    """``_rules.queue_order`` in Python: the longest queued first, run ids byte by byte."""
    queued, info = entry
    return queued, info.run_id.encode()


def _budget_after(info: RunInfo, events: tuple[StepEvent, ...]) -> dict[str, Any]:
    """The budget columns after an append (``budget.after``, as the SQL backends apply it)."""
    shown = {name: getattr(info, column) for column, name in rules.BUDGET_COLUMNS}
    limits = budget.after(shown if info.budgeted else None, budget.noted(events))
    if limits is None:
        return {}
    return {column: index_limit(column, limits.get(name)) for column, name in rules.BUDGET_COLUMNS}
