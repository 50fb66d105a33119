"""Una decisión no se pierde: aprobar mientras otro proceso relee el run.

The agent looks up three things (``consultar``, idempotent), then pays
(``pay``, behind ``require_approval_for("pay")``). Every step is a process of
its own, on one SQLite file:

1. pass 1 records the three lookups and suspends the run on the payment;
2. A resumes it through a journal that is slow to read (``DiarioLento``: its
   ``load`` reads, then waits until a file appears, like a big journal on a
   slow disk), so A holds a snapshot from before the decision;
3. meanwhile B approves with the real command, ``asiento approve RUN STEP --by ana``;
4. A goes on: it pays exactly once, in that same pass, and closes the run.
   Before the fix A wrote ``suspended`` over the approval and no worker would
   ever claim the run again;
5. a second resume makes zero calls; approving the closed run is refused and
   writes nothing.

Each process counts what it did in fsynced files; this script only reads them
and the journal.

    python examples/propiedades/11_decision_durante_replay.py
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _medir import CountingGateway, lines, model_calls, report, reported, table, tally, verdict

from asiento import (
    Agent,
    FinalStep,
    ModelResponse,
    Phase,
    Session,
    SqliteCheckpointer,
    StepEvent,
    ToolCall,
    ToolStep,
    require_approval_for,
    tool,
)
from asiento.testing import ENV_VAR

RESPUESTAS = [
    *[ModelResponse(tool_calls=[ToolCall(name="consultar", arguments={"que": q})]) for q in "abc"],
    ModelResponse(tool_calls=[ToolCall(name="pay", arguments={"importe": 120})]),
    ModelResponse(text="Pagado."),
]
PASO = "m4.t1"
PLAZO = 20.0  # every wait in this script (and in ``DiarioLento.load``) ends by then


class DiarioLento(SqliteCheckpointer):
    """A journal slow to read: ``load`` reads, says so, then waits until ``sigue`` appears."""

    def __init__(self, path: Path, work: Path) -> None:
        super().__init__(path)
        self.work = work

    async def load(self, run_id: str) -> list[StepEvent]:
        events = await super().load(run_id)
        approved = any(e.phase is Phase.APPROVAL for e in events)
        tally(self.work / "leido", f"{len(events)} records, approval among them: {approved}")
        deadline = time.monotonic() + PLAZO
        while not (self.work / "sigue").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return events


def nombre(paso: Any) -> str:
    if isinstance(paso, ToolStep):
        return f"ToolStep({paso.status}, {paso.decision})"
    if isinstance(paso, FinalStep) and paso.replayed:
        return "FinalStep(replayed=True)"
    return type(paso).__name__


def resumen(pasos: list[str]) -> str:
    """The steps a pass yielded: how many, and the last three."""
    cuantos = f"{len(pasos)} step{'s' * (len(pasos) != 1)}: " + "… · " * (len(pasos) > 3)
    return cuantos + " · ".join(pasos[-3:])


async def vuelta(work: Path, who: str) -> None:
    """One pass as process ``who`` (A reads through ``DiarioLento``); reports what it yielded."""

    @tool(idempotent=True)
    def consultar(que: str) -> str:
        """Look something up (reading twice changes nothing)."""
        tally(work / f"consultar.{who}", que)
        return f"{que}: ok"

    @tool
    def pay(importe: int) -> str:
        """Pay an amount (not idempotent: paying twice pays twice)."""
        tally(work / f"pay.{who}", str(importe))
        return "pagado"

    db = work / "runs.db"
    store = DiarioLento(db, work) if who == "A" else SqliteCheckpointer(db)
    agente = Agent(tools=[consultar, pay], policy=require_approval_for("pay"))
    session = Session("run-1", CountingGateway(RESPUESTAS, work / f"model.{who}"), store)
    try:
        pasos = [nombre(p) async for p in agente.run("consulta y paga 120", session=session)]
    finally:
        await store.close()
    report({"steps": pasos})


async def leer(db: Path) -> tuple[str, int]:
    """The run's status in the index and its number of journal records."""
    store = SqliteCheckpointer(db)
    try:
        return (await store.runs())[0].status.value, len(await store.load("run-1"))
    finally:
        await store.close()


def proceso(*argv: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    return subprocess.Popen(
        [sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def fin(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    """Wait (bounded) for a process started with ``proceso``."""
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def pase(work: Path, who: str) -> tuple[Any, ...]:
    """Pass ``who`` in a new process, to its end: model calls, payments, last steps."""
    done = reported(fin(proceso(__file__, "--vuelta", str(work), who)))
    steps = resumen(done["steps"]) if done else "did not end (see its stderr)"
    return model_calls(work / f"model.{who}"), len(lines(work / f"pay.{who}")), steps


def aprobar(db: Path) -> subprocess.CompletedProcess[str]:
    """The person: the real command, in a process of its own."""
    argv = ["-m", "asiento", "approve", "run-1", PASO, "--by", "ana", "--store", str(db)]
    return fin(proceso(*argv))


def esperar_a(path: Path, what: str) -> str:
    """The first line of ``path``, once it was written (at most PLAZO seconds)."""
    deadline = time.monotonic() + PLAZO
    while not lines(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {PLAZO:.0f} s waiting for {what}")
        time.sleep(0.01)
    return lines(path)[0]


def decidir(work: Path) -> dict[str, Any]:
    """Pass 1, then A (slow to read) and B (approving) at once, then C, then approve again."""
    db = work / "runs.db"
    m: dict[str, Any] = {"P": pase(work, "P"), "P after": asyncio.run(leer(db))}
    a = proceso(__file__, "--vuelta", str(work), "A")
    try:
        m["read"] = esperar_a(work / "leido", "A to read the journal")
        m["read after"] = asyncio.run(leer(db))
        m["B"] = aprobar(db)
        m["B after"] = asyncio.run(leer(db))
    finally:
        (work / "sigue").touch()
        done = reported(fin(a))
    steps = resumen(done["steps"]) if done else "did not end (see its stderr)"
    m["A"] = (model_calls(work / "model.A"), len(lines(work / "pay.A")), steps)
    m["A after"] = asyncio.run(leer(db))
    m["C"] = pase(work, "C")
    m["C after"] = asyncio.run(leer(db))
    m["again"] = aprobar(db)
    m["again after"] = asyncio.run(leer(db))
    m["pays"] = sum(len(lines(work / f"pay.{w}")) for w in "PAC")
    return m


def mostrar(m: dict[str, Any]) -> None:
    said = (m["B"].stdout.strip().splitlines() or [""])[0].split(";")[0]
    records = f"records {m['C after'][1]} → {m['again after'][1]}"
    rows = [
        ("pass 1", *m["P"][:2], m["P after"][0], m["P"][2]),
        ("A reads", "", "", m["read after"][0], f"the journal: {m['read']}; its disk is slow"),
        ("B", "", "", m["B after"][0], f"asiento approve: exit {m['B'].returncode}: {said}"),
        ("A goes on", *m["A"][:2], m["A after"][0], m["A"][2]),
        ("pass C", *m["C"][:2], m["C after"][0], m["C"][2]),
        ("approve again", "", "", m["again after"][0], f"exit {m['again'].returncode}, {records}"),
    ]
    headers = ["", "model calls", "payments", "status after", "what happened"]
    table("run-1: approved while a pass was replaying it", headers, rows)
    print(f"approve again said: {m['again'].stderr.strip()}")
    print(f"payments in all: {m['pays']}\n")


def juzgar(m: dict[str, Any]) -> list[str]:
    """What must hold, whatever A had read before the decision."""
    problems = []
    if m["P after"][0] != "suspended" or m["P"][:2] != (4, 0):
        problems.append(f"pass 1 did not suspend on the payment: {m['P']}, {m['P after']}")
    if not m["read"].endswith("among them: False"):
        problems.append(f"A read the journal after the approval: {m['read']}")
    if m["B"].returncode != 0 or m["B after"][0] != "running":
        problems.append(f"the approval did not leave the run running: {m['B after']}")
    a, a_status = m["A"], m["A after"][0]
    if a[:2] != (1, 1) or not a[2].endswith("FinalStep") or a_status != "closed":
        problems.append(f"A did not pay once and close: {a}, status {a_status}")
    if m["pays"] != 1:
        problems.append(f"pay ran {m['pays']} times, expected once")
    if m["C"][:2] != (0, 0) or m["C after"][0] != "closed":
        problems.append(f"the second resume made calls: {m['C']}, {m['C after']}")
    refused = m["again"].stderr
    if m["again"].returncode != 1 or "is closed" not in refused or m["again after"] != m["C after"]:
        problems.append(f"approving the closed run was not refused cleanly: {refused.strip()}")
    return problems


def main() -> int:
    if sys.argv[1:2] == ["--vuelta"]:
        asyncio.run(vuelta(Path(sys.argv[2]), sys.argv[3]))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        medido = decidir(Path(tmp))
    mostrar(medido)
    holds = "the approval made while A replayed was kept; A paid once, in that pass, and closed"
    return verdict(juzgar(medido), holds)


if __name__ == "__main__":
    sys.exit(main())
