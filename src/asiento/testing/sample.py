"""A small agent that passes every crash point: the one our reliability figures measure.

    harness = CrashHarness(app="asiento.testing.sample:factory", task=sample.TASK, ...)

The scripted model, turn by turn:

- m1: ``lookup`` (idempotent) then ``send`` (not idempotent, no way to check:
  a crash inside it is an ``UncertainEffect``);
- m2: ``write_file`` (``WriteFile``: ``write_atomic``, found again by content
  hash; it needs a person's approval) and, when ``ASIENTO_SAMPLE_INVOICES``
  names the invoices URL of an ``InvoiceServer(honour_keys=False)``,
  ``bill_invoice`` (an effect whose destination ignores idempotency keys,
  reconciled by looking the invoice up by its number);
- m3: "done".

Files go under ``$ASIENTO_HARNESS_WORKDIR/files`` (the harness sets it). The
task names the run (``{run_id}`` is replaced by the harness), so the invoice
number, and the destination's record of it, is unique per run.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path
from typing import Any

import httpx

from ..agent import Agent
from ..effects import Effect, Published, WriteFile
from ..model import ModelRequest, ModelResponse, ToolCall
from ..policy import require_approval_for
from ..tools import tool
from . import ScriptedGateway

TASK = "Serve customer ana for run {run_id}"
INVOICES_ENV = "ASIENTO_SAMPLE_INVOICES"
WORKDIR_ENV = "ASIENTO_HARNESS_WORKDIR"

# One TLS context for the process (httpx builds one per client otherwise, ~30 ms):
# created at import, so the harness's forked children inherit it.
_TLS = ssl.create_default_context()


@tool(idempotent=True)
def lookup(customer: str) -> str:
    """Look a customer up; safe to repeat."""
    return f"{customer}: premium"


@tool
def send(to: str, text: str) -> str:
    """Send a message; not safe to repeat, and nothing can check whether it left."""
    return f"sent to {to}"


class BillInvoice(Effect):
    """Bill an invoice; the billing API ignores idempotency keys, invoices are found by number."""

    name = "bill_invoice"

    def __init__(self, url: str) -> None:
        self.url = url

    def prepare(self, number: str, amount: int) -> dict[str, Any]:
        """Bill ``amount`` cents under invoice ``number``."""
        return {"customer": "ana", "amount": amount, "number": number}

    async def publish(self, payload: Any, idem_key: str) -> Published:
        async with httpx.AsyncClient(timeout=10.0, verify=_TLS) as client:
            response = await client.post(self.url, json=payload)
        response.raise_for_status()
        data = response.json()
        return Published(remote_id=data["id"], result=data)

    async def lookup(self, payload: Any) -> Published | None:
        async with httpx.AsyncClient(timeout=10.0, verify=_TLS) as client:
            response = await client.get(self.url, params={"number": payload["number"]})
        response.raise_for_status()
        found = response.json()["data"]
        return Published(remote_id=found[0]["id"], result=found[0]) if found else None


def invoice_number(run_id: str) -> str:
    """The business id of a run's invoice: what the destination oracle counts."""
    return f"INV-{run_id}"


def _script(request: ModelRequest, billing: bool) -> ModelResponse:
    turn = sum(1 for m in request.messages if m.role == "assistant")
    run_id = request.messages[0].content.rsplit(" ", 1)[-1]
    if turn == 0:
        calls = [
            ToolCall(name="lookup", arguments={"customer": "ana"}),
            ToolCall(name="send", arguments={"to": "ana", "text": "your receipt"}),
        ]
        return ModelResponse(tool_calls=calls)
    if turn == 1:
        report = {"path": f"{run_id}/report.txt", "content": f"report of {run_id}\n"}
        calls = [ToolCall(name="write_file", arguments=report)]
        if billing:
            bill = {"number": invoice_number(run_id), "amount": 1200}
            calls.append(ToolCall(name="bill_invoice", arguments=bill))
        return ModelResponse(tool_calls=calls)
    return ModelResponse(text="done")


def factory() -> tuple[Agent, ScriptedGateway]:
    """The agent and its scripted model, configured from the environment."""
    root = Path(os.environ.get(WORKDIR_ENV, ".")) / "files"
    tools = [lookup, send, WriteFile(root).as_tool()]
    url = os.environ.get(INVOICES_ENV)
    if url:
        tools.append(BillInvoice(url).as_tool())
    agent = Agent(
        instructions="Serve the customer.",
        tools=tools,
        policy=require_approval_for("write_file"),
    )
    return agent, ScriptedGateway(lambda request: _script(request, bool(url)))


def warm_up() -> None:
    """Load the HTTP stack once (a harmless lookup), before the harness forks its children."""
    url = os.environ.get(INVOICES_ENV)
    if url:
        asyncio.run(BillInvoice(url).lookup({"number": "warm-up"}))
