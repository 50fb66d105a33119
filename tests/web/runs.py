"""Runs on real SQLite journals for the web tests: waiting for approval, uncertain, closed.

Each helper drives a real ``Agent`` with a scripted model on the journal file,
in this process, and counts how many times its tool really ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asiento import (
    Agent,
    ApprovalStep,
    FinalStep,
    ModelResponse,
    Price,
    Session,
    SqliteCheckpointer,
    Step,
    ToolCall,
    UncertainEffect,
    Usage,
    require_approval_for,
    tool,
)
from asiento.effects import Effect, Published
from asiento.testing import ScriptedGateway

PAYMENT = {"amount": 120, "to": "ACME Ltd"}
PRICES = {"scripted": Price(input_per_mtok=3.0, output_per_mtok=15.0)}
SCRIPT = [
    ModelResponse(
        tool_calls=[ToolCall(name="pay", arguments=PAYMENT)],
        usage=Usage(input_tokens=412, output_tokens=38),
        model="scripted-1",
    ),
    ModelResponse(
        text="Paid 120 to ACME Ltd.",
        usage=Usage(input_tokens=470, output_tokens=12),
        model="scripted-1",
    ),
]
BOOKING = [
    ModelResponse(
        tool_calls=[ToolCall(name="book_entry", arguments={"account": "4300", "amount": 75})],
        usage=Usage(input_tokens=300, output_tokens=25),
    ),
    ModelResponse(text="Booked.", usage=Usage(input_tokens=340, output_tokens=6)),
]


class BookEntry(Effect):
    """Book an entry in the accounts: a destination that deduplicates by idempotency key."""

    honours_keys = True

    def __init__(self) -> None:
        self.entries: dict[str, str] = {}

    def prepare(self, account: str, amount: int) -> dict[str, object]:
        """Book ``amount`` on ``account``."""
        return {"account": account, "amount": amount}

    async def publish(self, payload: object, idem_key: str) -> Published:
        entry = self.entries.setdefault(idem_key, f"entry-{len(self.entries) + 1:04d}")
        return Published(remote_id=entry, result={"booked": entry})


class Killed(BaseException):
    """Stands for the process dying inside the tool: not an error the loop records."""


@dataclass
class Pass:
    """What one pass yielded, and the payments its tool really made."""

    steps: list[Step]
    payments: list[dict[str, object]] = field(default_factory=list)


async def drive(db: Path, run_id: str, *, dies: bool = False, approval: bool = True) -> Pass:
    """One pass of a payment run (approval required unless ``approval=False``)."""
    done = Pass(steps=[])

    @tool
    def pay(amount: int, to: str) -> str:
        """Pay an amount to someone."""
        done.payments.append({"amount": amount, "to": to})
        if dies:
            raise Killed
        return "tx-1"

    policy = require_approval_for("pay") if approval else None
    store = SqliteCheckpointer(db)
    try:
        session = Session(run_id, ScriptedGateway(SCRIPT), store, prices=PRICES)
        agent = Agent(tools=[pay], policy=policy)
        done.steps = [s async for s in agent.run("pay ACME's invoice", session=session)]
    finally:
        await store.close()
    return done


async def suspended(db: Path, run_id: str) -> str:
    """A run suspended on its payment; the fingerprint of the frozen arguments."""
    first = await drive(db, run_id)
    assert first.payments == []
    approval = first.steps[-1]
    assert isinstance(approval, ApprovalStep)
    return approval.fingerprint


async def uncertain(db: Path, run_id: str) -> None:
    """A run whose non-idempotent payment was submitted and has no recorded outcome."""
    with pytest.raises(Killed):
        await drive(db, run_id, dies=True, approval=False)
    with pytest.raises(UncertainEffect):
        await drive(db, run_id, approval=False)


async def book(db: Path, run_id: str, *, approval: bool = False) -> list[Step]:
    """One pass of a run that books an entry through an effect (prepare, publish, confirm)."""
    store = SqliteCheckpointer(db)
    policy = require_approval_for("book_entry") if approval else None
    try:
        session = Session(run_id, ScriptedGateway(BOOKING), store)
        agent = Agent(tools=[BookEntry().as_tool()], policy=policy)
        return [s async for s in agent.run("book the fee", session=session)]
    finally:
        await store.close()


async def closed_with_effect(db: Path, run_id: str) -> None:
    """A run that booked an entry through an effect and closed."""
    steps = await book(db, run_id)
    assert isinstance(steps[-1], FinalStep)
