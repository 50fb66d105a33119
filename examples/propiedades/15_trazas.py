"""Trazas: one trace per run across processes; a replayed step is never reported as run.

An agent with ``telemetry=Telemetry(...)`` pays an invoice (a tool with an effect)
and answers, on one SQLite file, in three processes:

1. pass 1 is killed with SIGKILL right after the tool ran and its outcome was
   recorded (crash point ``after_result``), before the second model call;
2. pass 2 resumes: m1 and the tool are read back from the journal, m2 is asked;
3. pass 3 finds the run closed.

Each process exports its spans with the real OpenTelemetry SDK to a JSON-lines
file (one span a line, flushed and fsynced as it ends), counts the generations
its model answered and the invoices its tool issued in fsynced files. The parent
prints the run's trace as a tree and compares the spans with those counts.

    python examples/propiedades/15_trazas.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _medir import (
    CountingGateway,
    ending,
    lines,
    model_calls,
    pass_child,
    run_pass,
    table,
    tally,
    verdict,
)

from asiento import Agent, ModelResponse, Session, SqliteCheckpointer, Telemetry, ToolCall, tool

FACTURA = ToolCall(name="facturar", arguments={"cliente": "ana", "total": 42})
GUION = [
    ModelResponse(tool_calls=[FACTURA]),
    ModelResponse(text="Factura emitida."),
]


def exportador(path: Path) -> Any:
    """A TracerProvider whose every ended span is one fsynced JSON line of ``path``."""
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class Lineas(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            for span in spans:
                tally(path, span.to_json(indent=None))
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Lineas()))
    return provider


async def vuelta(db: Path, work: Path, n: int) -> None:
    """Pass ``n`` of the run, its spans to ``work/spans.jsonl``."""
    facturas = work / "facturas"

    @tool
    def facturar(cliente: str, total: int) -> str:
        """Issue an invoice (an effect: once)."""
        tally(facturas, f"{cliente} {total}")
        return f"factura {len(lines(facturas))}"

    provider = exportador(work / "spans.jsonl")
    agent = Agent(tools=[facturar], name="facturas", telemetry=Telemetry(tracer_provider=provider))
    store = SqliteCheckpointer(db)
    gateway = CountingGateway(GUION, work / "model")
    async for _ in agent.run("factura 42 a ana", session=Session("run-1", gateway, store)):
        pass
    await store.close()
    provider.shutdown()


def arbol(spans: list[dict[str, Any]]) -> list[str]:
    """The trace as an indented tree, children in the order they started."""
    by_id = {s["context"]["span_id"]: s for s in spans}
    kids: dict[str | None, list[dict[str, Any]]] = {}
    for span in sorted(spans, key=lambda s: s["start_time"]):
        parent = span["parent_id"] if span["parent_id"] in by_id else None
        kids.setdefault(parent, []).append(span)
    out: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for span in kids.get(parent, []):
            a = span["attributes"]
            notes = [
                f"{k.removeprefix('asiento.')}={a[k]}"
                for k in (
                    "asiento.pass.fence",
                    "asiento.pass.cause",
                    "asiento.pass.died",
                    "asiento.run.status",
                    "asiento.replayed.model_calls",
                    "asiento.replayed.tool_calls",
                    "asiento.step.id",
                    "asiento.outcome",
                )
                if k in a
            ]
            out.append(f"{'  ' * depth}{span['name']}  [{', '.join(notes)}]")
            walk(span["context"]["span_id"], depth + 1)

    walk(None, 0)
    return out


def main() -> int:
    if run_pass(vuelta):
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for n, crash in ((1, "after_result"), (2, None), (3, None)):
            before = (model_calls(work / "model"), len(lines(work / "facturas")))
            proc = pass_child(__file__, work, n, crash_at=crash)
            after = (model_calls(work / "model"), len(lines(work / "facturas")))
            rows.append((n, ending(proc), after[0] - before[0], after[1] - before[1]))
        spans = [json.loads(line) for line in lines(work / "spans.jsonl")]
        invoices, generations = len(lines(work / "facturas")), model_calls(work / "model")
    headers = ["pass", "ended", "model calls", "invoices"]
    table("run-1: paid, killed after the tool, resumed", headers, rows)
    print("the run's trace:\n")
    for line in arbol(spans):
        print(f"  {line}")
    traces = {s["context"]["trace_id"] for s in spans}
    chats = [s for s in spans if s["name"].startswith("chat")]
    tools = [s for s in spans if s["name"].startswith("execute_tool")]
    ids = {s["context"]["span_id"] for s in spans}
    orphans = [s["name"] for s in spans if s["parent_id"] and s["parent_id"] not in ids]
    print(f"\ntrace ids: {len(traces)}")
    print(f"chat spans: {len(chats)}, generations the model answered: {generations}")
    print(f"execute_tool spans: {len(tools)}, invoices issued: {invoices}")
    print(f"spans whose parent is missing: {len(orphans)}")
    problems = []
    if len(traces) != 1:
        problems.append(f"{len(traces)} trace ids, not one")
    if len(chats) != generations or generations != 2:
        problems.append(f"{len(chats)} chat spans for {generations} generations")
    if len(tools) != invoices or invoices != 1:
        problems.append(f"{len(tools)} tool spans for {invoices} invoices")
    if orphans:
        problems.append(f"spans without their parent: {orphans}")
    if os.environ.get("ASIENTO_CRASH_AT"):
        problems.append("the parent was armed to crash")
    return verdict(problems, "one trace across three processes; replayed steps emit no span")


if __name__ == "__main__":
    sys.exit(main())
