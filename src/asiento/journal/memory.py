"""A journal in a dict, for unit tests only: it survives nothing."""

from __future__ import annotations

import time

from ..errors import DuplicateRecord, UsageError
from ..events import FINAL_STEP_ID, Phase, RunInfo, RunStatus, StepEvent
from .base import decode_row, encode_batch


class MemoryCheckpointer:
    """In-process journal with the same semantics as the durable ones."""

    def __init__(self) -> None:
        self._rows: dict[str, list[tuple[str, str, str | None, str, float]]] = {}
        self._keys: set[tuple[str, str, str]] = set()
        self._runs: dict[str, RunInfo] = {}

    async def append(self, *events: StepEvent, status: RunStatus | None = None) -> None:
        run_id, rows = encode_batch(events)
        for _, step_id, phase, *_ in rows:
            if (run_id, step_id, phase) in self._keys:
                raise DuplicateRecord(run_id, step_id, phase)
        for _, step_id, phase, decision, payload, created in rows:
            self._keys.add((run_id, step_id, phase))
            self._rows.setdefault(run_id, []).append((step_id, phase, decision, payload, created))
        self._touch(run_id, status, len(rows))

    def _touch(self, run_id: str, status: RunStatus | None, added: int) -> None:
        now = time.time()
        old = self._runs.get(run_id)
        self._runs[run_id] = RunInfo(
            run_id=run_id,
            status=status or (old.status if old else RunStatus.RUNNING),
            events=(old.events if old else 0) + added,
            created_at=old.created_at if old else now,
            updated_at=now,
        )

    async def load(self, run_id: str) -> list[StepEvent]:
        return [decode_row(run_id, row) for row in self._rows.get(run_id, [])]

    async def load_step(self, run_id: str, step_id: str) -> list[StepEvent]:
        return [e for e in await self.load(run_id) if e.step_id == step_id]

    async def final(self, run_id: str) -> StepEvent | None:
        if (run_id, FINAL_STEP_ID, Phase.RESULT) not in self._keys:
            return None
        events = await self.load_step(run_id, FINAL_STEP_ID)
        return next(e for e in events if e.phase == Phase.RESULT)

    async def set_status(self, run_id: str, status: RunStatus) -> None:
        if run_id not in self._runs:
            raise UsageError(f"unknown run {run_id!r}")
        self._touch(run_id, status, 0)

    async def runs(self, *, status: RunStatus | None = None) -> list[RunInfo]:
        return [r for r in self._runs.values() if status is None or r.status == status]

    async def close(self) -> None:
        return None
