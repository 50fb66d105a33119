"""The group-commit crash child: many runs at once on one SQLite file, one pass, then exit.

    python tests/crash/group_child.py DB LEDGER RUNS

Drives RUNS runs of the crash-test script (child.py's tools and model) with
``asyncio.gather`` on one ``SqliteCheckpointer``, so their appends share group
commits. Arm ``ASIENTO_CRASH_AT=inside_commit@N`` to be SIGKILLed inside one.
Every line of LEDGER is one fsynced write, in the order things happened: a model
request (``key``), a tool execution (``tool``), and, after each append returned,
the records it made durable (``durable``: [step, phase]). Prints one JSON line:
each run's outcome ("closed" or "uncertain").
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from child import INSTRUCTIONS, TASK, LedgerGateway, make_tools

from asiento import Agent, Session, SqliteCheckpointer, StepEvent, UncertainEffect
from asiento.testing._files import append_line


class DurableLedger:
    """The store, writing to the ledger what each append returned for (then it is promised)."""

    def __init__(self, store: SqliteCheckpointer, ledger: str) -> None:
        self.store, self.ledger = store, ledger

    async def append(self, *events: StepEvent, **kwargs: Any) -> None:
        await self.store.append(*events, **kwargs)
        for event in events:
            record = {"run": event.run_id, "durable": [event.step_id, event.phase]}
            append_line(self.ledger, record)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


async def one(run_id: str, store: DurableLedger, ledger: str) -> str:
    agent = Agent(instructions=INSTRUCTIONS, tools=make_tools(run_id, ledger))
    session = Session(run_id, LedgerGateway(run_id, ledger), store)  # type: ignore[arg-type]
    try:
        async for _ in agent.run(TASK, session=session):
            pass
    except UncertainEffect:
        return "uncertain"
    return "closed"


async def main(db: str, ledger: str, runs: int) -> dict[str, str]:
    store = SqliteCheckpointer(db)
    wrapped = DurableLedger(store, ledger)
    try:
        ids = [f"run-{i:03d}" for i in range(runs)]
        outcomes = await asyncio.gather(*(one(r, wrapped, ledger) for r in ids))
    finally:
        await store.close()
    return dict(zip(ids, outcomes, strict=True))


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))))
