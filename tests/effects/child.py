"""One pass over an effect run, in its own process: the program the crash tests kill.

    python child.py --db runs.db --run run-1 http --url URL [--keys] [--ttl S] [--lookup]
    python child.py --db runs.db --run run-1 file --root DIR --log FILE

``--db`` is anything ``open_store`` opens (a SQLite path, a PostgreSQL DSN);
``--skew S`` runs the pass on a clock S seconds ahead (behind when negative).

The model (scripted) asks for one effect, then answers "done". The pass prints
one JSON line: {"ended": "closed"} or {"ended": "uncertain", "step_id": ...}
(exit 3). Armed with ASIENTO_CRASH_AT, it kills itself with SIGKILL there.

The test modules import the effect classes from here, so the in-process tests
and the killed children publish through the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

import asiento._clock
from asiento import (
    Agent,
    FinalStep,
    ModelResponse,
    Session,
    Tool,
    ToolCall,
    UncertainEffect,
    open_store,
)
from asiento.effects import HttpEffect, Published, WriteFile
from asiento.testing import ScriptedGateway

INVOICE = {"customer": "ACME S.L.", "amount": 120000, "number": "F-2026-0001"}
REPORT = {"path": "out/report.txt", "content": "total: 1200,00 EUR\n"}
UNCERTAIN_EXIT = 3


class PublishInvoice(HttpEffect):
    """Publish an invoice to the billing API."""

    name = "publish_invoice"
    backoff = 0.01

    def prepare(self, customer: str, amount: int, number: str) -> dict[str, Any]:
        """Publish an invoice.

        Args:
            customer: who pays
            amount: in cents
            number: the invoice number, unique per business
        """
        return {"customer": customer, "amount": amount, "number": number}


class PublishInvoiceWithLookup(PublishInvoice):
    """An invoice effect that can find itself by its business id, the invoice number."""

    async def lookup(self, payload: Any) -> Published | None:
        async with httpx.AsyncClient(timeout=10.0) as client:
            response = await client.get(self.url, params={"number": payload["number"]})
        response.raise_for_status()
        found = response.json()["data"]
        return Published(remote_id=found[0]["id"], result=found[0]) if found else None


def invoice_effect(url: str, *, keys: bool, ttl: float | None, lookup: bool) -> PublishInvoice:
    """An invoice effect that honours keys (with ``ttl``) or not, with a lookup or not."""
    base = PublishInvoiceWithLookup if lookup else PublishInvoice
    cls = type(base.__name__, (base,), {"honours_keys": keys, "key_ttl": ttl})
    return cls(url)


class CountingWriteFile(WriteFile):
    """``WriteFile`` that appends a line to an fsynced log each time it wrote the file."""

    def __init__(self, root: str, log: str) -> None:
        super().__init__(root)
        self.log = Path(log)

    async def publish(self, payload: Any, idem_key: str) -> Published:
        published = await super().publish(payload, idem_key)
        with self.log.open("a") as f:
            f.write(idem_key + "\n")
            f.flush()
            os.fsync(f.fileno())
        return published


def script(tool: Tool, arguments: dict[str, Any]) -> ScriptedGateway:
    """The model: call ``tool`` once with ``arguments``, then answer "done"."""
    call = ToolCall(name=tool.name, arguments=arguments)
    return ScriptedGateway([ModelResponse(tool_calls=[call]), ModelResponse(text="done")])


async def one_pass(db: str, run_id: str, tool: Tool, arguments: dict[str, Any]) -> dict[str, Any]:
    """Drive the run as far as it goes; how it ended."""
    agent = Agent(instructions="Publish what you are asked to.", tools=[tool])
    store = await open_store(db)
    session = Session(run_id, script(tool, arguments), store)
    ended: dict[str, Any] = {"ended": "not closed"}
    try:
        async for step in agent.run("publish it", session=session):
            if isinstance(step, FinalStep):
                ended = {"ended": "closed", "replayed": step.replayed}
    except UncertainEffect as exc:
        ended = {"ended": "uncertain", "step_id": exc.step_id, "why": str(exc)}
    finally:
        await store.close()
    return ended


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--skew", type=float, default=0.0)
    kinds = parser.add_subparsers(dest="kind", required=True)
    http = kinds.add_parser("http")
    http.add_argument("--url", required=True)
    http.add_argument("--keys", action="store_true")
    http.add_argument("--ttl", type=float, default=None)
    http.add_argument("--lookup", action="store_true")
    files = kinds.add_parser("file")
    files.add_argument("--root", required=True)
    files.add_argument("--log", required=True)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    asiento._clock.skew = args.skew
    if args.kind == "http":
        effect = invoice_effect(args.url, keys=args.keys, ttl=args.ttl, lookup=args.lookup)
        tool, arguments = effect.as_tool(), INVOICE
    else:
        tool, arguments = CountingWriteFile(args.root, args.log).as_tool(), REPORT
    ended = asyncio.run(one_pass(args.db, args.run, tool, arguments))
    print(json.dumps(ended), flush=True)
    return UNCERTAIN_EXIT if ended["ended"] == "uncertain" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
