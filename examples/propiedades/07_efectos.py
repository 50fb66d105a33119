"""Efectos: una factura publicada no se publica dos veces.

An invoice server runs in this process, on 127.0.0.1. By default it ignores
``Idempotency-Key`` (every POST creates an invoice), so the only thing that can
save the run is the effect's lookup by invoice number. Two passes over run-1,
each in its own process:

1. the agent publishes the invoice; the child is killed with SIGKILL right after
   the server created it and before the run recorded it (``after_publish``);
2. a new child resumes: the step was submitted with no result, so it is
   reconciled. The lookup finds the invoice and records it; no second POST.

With ``--claves`` the server deduplicates by key like Stripe, and the resume
publishes again with the same key instead: a second POST, still one invoice.

    python examples/propiedades/07_efectos.py [--claves]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from _medir import child, ending, report, reported, table, verdict

from asiento import Agent, ModelResponse, Phase, Session, SqliteCheckpointer, ToolCall
from asiento.effects import HttpEffect, Published
from asiento.testing import ScriptedGateway
from asiento.testing.invoices import InvoiceServer

FACTURA = {"cliente": "ACME S.L.", "importe": 120000, "numero": "F-2026-0001"}


class PublicarFactura(HttpEffect):
    """Publish an invoice to the billing API."""

    name = "publicar_factura"
    honours_keys = False  # this destination ignores Idempotency-Key
    max_attempts = 1  # so a POST left unanswered is never repeated blindly: the lookup decides

    def prepare(self, cliente: str, importe: int, numero: str) -> dict[str, Any]:
        """Build the invoice; nothing leaves the process here."""
        return {"customer": cliente, "amount": importe, "number": numero}

    async def lookup(self, payload: Any) -> Published | None:
        """Find the invoice by its number, the business id."""
        async with httpx.AsyncClient() as client:
            answer = await client.get(self.url, params={"number": payload["number"]})
        found = answer.raise_for_status().json()["data"]
        return Published(remote_id=found[0]["id"], result=found[0]) if found else None


class PublicarFacturaConClaves(PublicarFactura):
    """The same invoice, to a destination that deduplicates by key for 24 hours."""

    honours_keys = True
    key_ttl = 24 * 3600.0
    max_attempts = 4  # retrying with the same key is safe here


async def vuelta(url: str, db: str, claves: bool) -> None:
    """One pass, in this process: the model asks for the invoice, then says it is done."""
    efecto = PublicarFacturaConClaves(url) if claves else PublicarFactura(url)
    llamada = ToolCall(name="publicar_factura", arguments=FACTURA)
    gateway = ScriptedGateway([ModelResponse(tool_calls=[llamada]), ModelResponse(text="hecho")])
    store = SqliteCheckpointer(db)
    try:
        agente = Agent(instructions="Publica la factura.", tools=[efecto.as_tool()])
        async for _ in agente.run("factura a ACME", session=Session("run-1", gateway, store)):
            pass
    finally:
        await store.close()
    report({"ended": "closed"})


async def resultado(db: Path) -> dict[str, Any]:
    """The recorded outcome of the invoice step (its latest attempt)."""
    store = SqliteCheckpointer(db)
    try:
        events = await store.load("run-1")
    finally:
        await store.close()
    results = [e for e in events if e.step_id.startswith("m1.t1") and e.phase is Phase.RESULT]
    return dict(results[-1].payload) if results else {}


def main() -> int:
    if sys.argv[1:2] == ["--vuelta"]:
        asyncio.run(vuelta(sys.argv[2], sys.argv[3], sys.argv[4] == "1"))
        return 0
    claves = "--claves" in sys.argv[1:]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, InvoiceServer(honour_keys=claves) as servidor:
        db = Path(tmp) / "runs.db"
        for n, crash_at in ((1, "after_publish"), (2, None)):
            args = ("--vuelta", servidor.invoices_url, str(db), "1" if claves else "0")
            proc = child(__file__, *args, crash_at=crash_at)
            ended = (reported(proc) or {}).get("ended", ending(proc))
            rows.append((n, crash_at or "-", ended, len(servidor.invoices), servidor.posts))
        facturas, posts = len(servidor.invoices), servidor.posts
        salida = asyncio.run(resultado(db))
    modo = "honours Idempotency-Key (Stripe-like)" if claves else "ignores Idempotency-Key"
    headers = ["pass", "killed at", "how it ended", "invoices at the server", "POSTs received"]
    table(f"run-1 publishes one invoice; the server {modo}", headers, rows)
    print(f"invoices the server holds: {facturas}")
    print(f"POSTs it received: {posts}")
    print(f"reconcile path: {salida.get('via')} (attempts: {salida.get('attempts')})\n")
    problems = [f"the server holds {facturas} invoices, expected 1"] if facturas != 1 else []
    if rows[0][2] != "killed by SIGKILL":
        problems.append(f"the first pass was not killed after publishing: {rows[0][2]}")
    if rows[1][2] != "closed":
        problems.append(f"the resumed pass did not close: {rows[1][2]}")
    return verdict(problems, "killed between publish and confirm, the invoice exists once")


if __name__ == "__main__":
    sys.exit(main())
