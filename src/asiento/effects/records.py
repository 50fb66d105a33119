"""The effect record: one line per effect step, read from the journal."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..events import Phase, StepEvent
from ..journal.base import Checkpointer
from ..payloads import Intent, Outcome, Resolution
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
        recorded = phases.get(Phase.INTENT)
        intent = None if recorded is None else Intent.from_json(recorded.payload)
        if recorded is None or intent is None or not intent.is_effect:
            continue
        state = step_state(journal, step_id)
        records.append(_record(recorded, intent, state.records, state.attempt))
    return records


async def effect_records(store: Checkpointer, run_id: str) -> list[EffectRecord]:
    """The effect records of a run, read from its journal."""
    return effect_records_of(await store.load(run_id))


def _record(recorded: StepEvent, intent: Intent, phases: Records, attempt: int) -> EffectRecord:
    result = phases.get(Phase.RESULT)
    resolution = phases.get(Phase.RESOLUTION)
    found = None if resolution is None else Resolution.from_json(resolution.payload)
    submitted = Phase.SUBMITTED in phases
    remote_id = None
    if result is not None:
        outcome = Outcome.from_json(result.payload)
        status = "confirmed" if outcome.status == "ok" else "failed"
        remote_id = outcome.remote_id
    elif found is not None and found.happened:
        status, remote_id = "confirmed", found.remote_id
    else:
        status = "submitted" if submitted else "prepared"
    latest = max(e.created_at for e in phases.values())
    key = str(intent.idem_key)
    return EffectRecord(
        run_id=recorded.run_id,
        step_id=recorded.step_id,
        idem_key=key,
        status=status,
        params_hash=key.rsplit(":", 1)[-1],
        remote_id=remote_id,
        attempts=attempt if submitted else attempt - 1,
        updated_at=latest,
    )
