"""The effect record: one line per effect step, read from the journal."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..events import Phase, StepEvent
from ..journal.base import Checkpointer
from ..replay import Records, index, step_state


@dataclass(frozen=True, slots=True, kw_only=True)
class EffectRecord:
    """Where an effect stands: ``prepared``, ``submitted``, ``confirmed`` or ``failed``."""

    run_id: str
    step_id: str
    idem_key: str
    status: str
    params_hash: str
    remote_id: str | None
    attempts: int
    updated_at: float


def effect_records_of(events: Sequence[StepEvent]) -> list[EffectRecord]:
    """The effect records of one run's timeline, in step order."""
    journal = index(events)
    records = []
    for step_id, phases in journal.items():
        intent = phases.get(Phase.INTENT)
        if intent is None or "idem_key" not in intent.payload:
            continue
        state = step_state(journal, step_id)
        records.append(_record(intent, state.records, state.attempt))
    return records


async def effect_records(store: Checkpointer, run_id: str) -> list[EffectRecord]:
    """The effect records of a run, read from its journal."""
    return effect_records_of(await store.load(run_id))


def _record(intent: StepEvent, phases: Records, attempt: int) -> EffectRecord:
    result = phases.get(Phase.RESULT)
    resolution = phases.get(Phase.RESOLUTION)
    submitted = Phase.SUBMITTED in phases
    remote_id = None
    if result is not None:
        status = "confirmed" if result.payload.get("status") == "ok" else "failed"
        remote_id = result.payload.get("remote_id")
    elif resolution is not None and resolution.payload.get("happened"):
        status, remote_id = "confirmed", resolution.payload.get("remote_id")
    else:
        status = "submitted" if submitted else "prepared"
    latest = max(e.created_at for e in phases.values())
    return EffectRecord(
        run_id=intent.run_id,
        step_id=intent.step_id,
        idem_key=intent.payload["idem_key"],
        status=status,
        params_hash=intent.payload["idem_key"].rsplit(":", 1)[-1],
        remote_id=remote_id,
        attempts=attempt if submitted else attempt - 1,
        updated_at=latest,
    )
