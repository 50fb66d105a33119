"""What a worker sees of a framework's pass: the steps ``asiento worker`` counts.

A framework run is driven whole by its framework (``Runner.run``, ``Agent.run``), not
step by step; its pass ends closed or waiting for people. The worker counts a pass by
its last steps, so a framework pass ends as a native one would: one ``ApprovalStep``
for each step waiting for a person, else the ``FinalStep``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic_core import to_jsonable_python

from .. import step_ids
from .._canonical import canonical_json
from ..errors import LeaseLost, RunAbandoned
from ..events import ApprovalStep, FinalStep, Phase, Step
from ..model import ToolCall
from ..payloads import Intent
from ..session import Session
from ..session import abandonment as session_abandonment


async def pass_end(
    session: Session, awaiting: Sequence[str], *, text: str, replayed: bool, abandoned: bool
) -> AsyncIterator[Step]:
    """The steps a framework pass ends with, read from the journal where it waits."""
    for step_id in awaiting:
        intent = next(
            Intent.from_json(e.payload)
            for e in await session.store.load_step(session.run_id, step_id)
            if e.phase is Phase.INTENT
        )
        yield ApprovalStep(
            run_id=session.run_id,
            step_id=step_id,
            call=ToolCall(name=intent.tool, arguments=intent.args),
            fingerprint=intent.fp,
        )
    if not awaiting:
        yield FinalStep(
            run_id=session.run_id,
            step_id=step_ids.FINAL,
            text=text,
            replayed=replayed,
            abandoned=abandoned,
        )


def shown(output: Any) -> str:
    """An output as ``asiento show`` prints a run's answer: text, or its canonical JSON."""
    if output is None:
        return ""
    return output if isinstance(output, str) else canonical_json(to_jsonable_python(output))


async def abandonment(session: Session, lost: LeaseLost) -> LeaseLost:
    """What to raise for a lease a framework's pass lost: ``RunAbandoned`` when a person
    abandoned the run (abandoning takes the run's fence), else ``lost`` itself. A pass
    whose commit was refused raised ``RunAbandoned`` already, naming what it lost."""
    if isinstance(lost, RunAbandoned):
        return lost
    abandoned = await session_abandonment(session.store, session.run_id)
    if abandoned is None:
        return lost
    abandoned.__cause__ = lost
    return abandoned
