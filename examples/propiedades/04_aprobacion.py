"""Denegación y aprobación humana: un efecto aprobado ocurre exactamente una vez.

1. pass 1 → ModelStep · ToolStep(awaiting_approval, decision=require_approval) ·
   ApprovalStep; the run is suspended on disk and the process ends;
2. another process (a person's script) calls ``asiento.approve``: the loop is
   not running, the harness writes the approval into the journal;
3. pass 2, in a new process → the run goes on where it was, the payment
   happens exactly once;
4. pass 3, in a new process → zero model calls, zero payments.

    python examples/propiedades/04_aprobacion.py
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

from _medir import (
    CountingGateway,
    child,
    ending,
    lines,
    model_calls,
    pass_child,
    report,
    reported,
    run_pass,
    table,
    tally,
    verdict,
)

from asiento import (
    Agent,
    ApprovalStep,
    FinalStep,
    ModelResponse,
    Session,
    SqliteCheckpointer,
    Step,
    ToolCall,
    ToolStep,
    approve,
    require_approval_for,
    tool,
)

RESPUESTAS = [
    ModelResponse(tool_calls=[ToolCall(name="pagar", arguments={"importe": 120})]),
    ModelResponse(text="Pagado."),
]
PASO = "m1.t1"
ESPERADO = {
    1: (1, 0, "ModelStep · ToolStep(awaiting_approval, require_approval) · ApprovalStep"),
    2: (1, 1, "ToolStep(ok, approved) · ModelStep · FinalStep"),
    3: (0, 0, "FinalStep(replayed=True)"),
}


def nombre(paso: Step) -> str:
    if isinstance(paso, ToolStep):
        return f"ToolStep({paso.status}, {paso.decision})"
    if isinstance(paso, FinalStep) and paso.replayed:
        return "FinalStep(replayed=True)"
    return type(paso).__name__


async def vuelta(db: Path, work: Path, n: int) -> None:
    """One pass in this process; reports the steps it yielded and the run's status."""
    log = work / f"tool.{n}"

    @tool
    def pagar(importe: int) -> str:
        """Pay an amount (not idempotent: paying twice pays twice)."""
        tally(log, str(importe))
        return "ok"

    agente = Agent(tools=[pagar], policy=require_approval_for("pagar"))
    store = SqliteCheckpointer(db)
    gateway = CountingGateway(RESPUESTAS, work / f"model.{n}")
    try:
        pasos = [p async for p in agente.run("paga 120", session=Session("run-1", gateway, store))]
        estado = [r.status.value for r in await store.runs()]
    finally:
        await store.close()
    fp = [p.fingerprint for p in pasos if isinstance(p, ApprovalStep)]
    report({"steps": " · ".join(nombre(p) for p in pasos), "status": estado, "fp": fp})


async def aprobar(db: Path, fingerprint: str) -> None:
    """The person's side: record the approval of exactly the arguments shown."""
    store = SqliteCheckpointer(db)
    try:
        event = await approve(store, "run-1", PASO, by="ana", fingerprint=fingerprint)
        estado = [r.status.value for r in await store.runs()]
    finally:
        await store.close()
    report({"decision": str(event.decision), "pid": os.getpid(), "status": estado})


def medir_vuelta(work: Path, n: int) -> tuple[tuple[object, ...], tuple[object, ...], str]:
    """Pass ``n`` in a new process: its table row, what was measured, the fingerprint shown."""
    proc = pass_child(__file__, work, n)
    seen = reported(proc) or {"steps": ending(proc), "status": [], "fp": []}
    measured = (model_calls(work / f"model.{n}"), len(lines(work / f"tool.{n}")), seen["steps"])
    row = (f"pass {n}", measured[0], measured[1], ",".join(seen["status"]), seen["steps"])
    return row, measured, "".join(seen["fp"])


def aprobar_en_otro_proceso(work: Path, fingerprint: str) -> tuple[tuple[object, ...], str]:
    """Ana approves in a process of her own: the table row, and the decision recorded."""
    proc = child(__file__, "--aprobar", str(work / "runs.db"), fingerprint)
    decided = reported(proc) or {"decision": ending(proc), "pid": "?", "status": []}
    what = f"{decided['decision']} by ana, in another process (pid {decided['pid']})"
    return ("approve", "", "", ",".join(decided["status"]), what), decided["decision"]


def main() -> int:
    if run_pass(vuelta):
        return 0
    if sys.argv[1:2] == ["--aprobar"]:
        asyncio.run(aprobar(Path(sys.argv[2]), sys.argv[3]))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        row1, pass1, shown = medir_vuelta(work, 1)
        approval, decision = aprobar_en_otro_proceso(work, shown)
        row2, pass2, _ = medir_vuelta(work, 2)
        row3, pass3, _ = medir_vuelta(work, 3)
    headers = ["", "model calls", "payments", "status after", "steps yielded"]
    table("run-1: a payment that needs a person", headers, [row1, approval, row2, row3])
    problems = [
        f"pass {n}: measured {measured}, expected {ESPERADO[n]}"
        for n, measured in ((1, pass1), (2, pass2), (3, pass3))
        if measured != ESPERADO[n]
    ]
    if decision != "approved":
        problems.append(f"the approval was not recorded: {decision}")
    return verdict(problems, "the approved payment happened exactly once, in pass 2")


if __name__ == "__main__":
    sys.exit(main())
