"""A user's own agent, outside asiento: what the crash harness is meant to be pointed at.

    CrashHarness(app="harness.app:make", task=app.TASK, pythonpath=[tests_dir], ...)

Its model (scripted) asks in m1 for ``fetch`` (async, idempotent) and ``charge``
(sync, not idempotent: it builds its own idempotency key from
``asiento.current_step()`` and passes ``inside_tool`` itself, as a user's tool
may); in m2 for ``save`` (``WriteFile``, allowed without approval, so it passes
``after_prepare``); m3 answers. ``$HARNESS_APP_BROKEN=1`` makes ``charge``
raise: a failed tool is a recorded outcome, not a crash.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import asiento
from asiento import Agent, ModelResponse, ToolCall, tool
from asiento.effects import WriteFile
from asiento.testing import ScriptedGateway, crash_point

TASK = "Charge order 7 and save the receipt"


@tool(idempotent=True)
async def fetch(order: int) -> dict[str, int]:
    """Read an order; safe to repeat."""
    await asyncio.sleep(0)
    return {"order": order, "amount": 1200}


@tool
def charge(order: int, amount: int) -> str:
    """Charge the customer for an order; must happen once."""
    step = asiento.current_step()
    key = step.idempotency_key({"order": order}) if step else "outside"
    crash_point("inside_tool")
    if os.environ.get("HARNESS_APP_BROKEN"):
        raise RuntimeError("the payment provider is down")
    return f"charged {amount} under {key}"


SCRIPT = [
    ModelResponse(
        tool_calls=[
            ToolCall(name="fetch", arguments={"order": 7}),
            ToolCall(name="charge", arguments={"order": 7, "amount": 1200}),
        ]
    ),
    ModelResponse(
        tool_calls=[
            ToolCall(name="save", arguments={"path": "receipts/7.txt", "content": "paid 1200\n"})
        ]
    ),
    ModelResponse(text="charged and saved"),
]


class Save(WriteFile):
    """Save a file under the harness's working directory."""

    name = "save"


def make() -> tuple[Agent, ScriptedGateway]:
    """The agent and its deterministic model; files go to the harness's workdir."""
    root = Path(os.environ.get("ASIENTO_HARNESS_WORKDIR", ".")) / "app-files"
    agent = Agent(
        instructions="Charge, then keep a receipt.", tools=[fetch, charge, Save(root).as_tool()]
    )
    return agent, ScriptedGateway(SCRIPT)
