"""Parada ordenada: SIGTERM deja terminar el paso en curso y no empieza ninguno nuevo.

The agent charges a card with ``cobrar`` (not idempotent), then tells the
customer with ``avisar`` (not idempotent either). Two passes over run-1, each in
its own process, on one SQLite file:

1. the child calls ``asiento.shutdown.install()`` and drives the run; SIGTERM
   arrives while ``cobrar`` is in flight. The charge finishes and its result is
   recorded, nothing new starts (no model request, no ``avisar``), the lease is
   released, and the process exits with ``shutdown.EXIT_CODE`` (75);
2. a new process resumes: ``avisar`` runs once, the run closes, and ``cobrar``
   is not run again.

Each process counts what it did in fsynced files; this script only reads them
and the journal.

    python examples/propiedades/10_parada_ordenada.py
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _medir import CountingGateway, lines, model_calls, report, table, tally, verdict

from asiento import (
    Agent,
    ModelResponse,
    Phase,
    Session,
    ShutdownRequested,
    SqliteCheckpointer,
    ToolCall,
    shutdown,
    tool,
)
from asiento.testing import ENV_VAR

RESPUESTAS = [
    ModelResponse(tool_calls=[ToolCall(name="cobrar", arguments={"importe": 120})]),
    ModelResponse(tool_calls=[ToolCall(name="avisar", arguments={"texto": "cobrados 120"})]),
    ModelResponse(text="Cobrado y avisado."),
]
PLAZO = 20.0  # every wait in this script (and in ``cobrar``) ends by then
CABECERAS = [
    "",
    "how it ended",
    "model calls",
    "cobrar executions",
    "avisar executions",
    "lease",
    "status",
    "tool results recorded",
]
ESPERADO = {
    1: (shutdown.EXIT_CODE, 1, 1, 0, "ShutdownRequested"),
    2: (0, 2, 0, 1, "closed"),
}


def agente(work: Path, n: int) -> Agent:
    """The agent as pass ``n`` runs it; its tools count themselves in fsynced files."""

    @tool
    async def cobrar(importe: int) -> str:
        """Charge the card (not idempotent); holds on until the file ``deja`` appears."""
        tally(work / f"en_vuelo.{n}", "cobrar")
        deadline = time.monotonic() + PLAZO
        while not (work / "deja").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        tally(work / f"cobrar.{n}", f"{importe} stop_requested={shutdown.requested()}")
        return "cobrado"

    @tool
    def avisar(texto: str) -> str:
        """Tell the customer (not idempotent: telling twice sends two messages)."""
        tally(work / f"avisar.{n}", texto)
        return "avisado"

    return Agent(instructions="Cobra y avisa.", tools=[cobrar, avisar])


async def vuelta(work: Path, n: int) -> int:
    """One pass, in this process; the exit status a supervisor would see."""
    store = SqliteCheckpointer(work / "runs.db")
    gateway = CountingGateway(RESPUESTAS, work / f"model.{n}")
    session = Session("run-1", gateway, store)
    try:
        async for _ in agente(work, n).run("cobra 120 y avisa", session=session):
            pass
    except ShutdownRequested as exc:
        report({"ended": "ShutdownRequested", "message": str(exc)})
        return shutdown.EXIT_CODE
    finally:
        await store.close()
    report({"ended": "closed", "message": ""})
    return 0


async def leer(db: Path) -> dict[str, Any]:
    """run-1 as the journal holds it: status, lease holder, the outcome of each tool step."""
    store = SqliteCheckpointer(db)
    try:
        info = next(r for r in await store.runs() if r.run_id == "run-1")
        events = await store.load("run-1")
    finally:
        await store.close()
    results = {
        e.step_id: e.payload.get("status")
        for e in events
        if "." in e.step_id and e.phase is Phase.RESULT
    }
    return {"status": info.status.value, "holder": info.lease_owner, "results": results}


def arrancar(work: Path, n: int) -> subprocess.Popen[str]:
    """Pass ``n`` in a new process, in the background."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    argv = [sys.executable, __file__, "--vuelta", str(work), str(n)]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def esperar_a(check: Any, what: str) -> None:
    """Poll ``check`` until it holds, for at most PLAZO seconds."""
    deadline = time.monotonic() + PLAZO
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {PLAZO:.0f} s waiting for {what}")
        time.sleep(0.01)


def terminar(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Wait for a pass to end: its exit status and what it reported."""
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    said = out.strip().splitlines()
    last = err.strip().splitlines()[-1:]
    seen = json.loads(said[-1]) if said else {"ended": f"no report: {last}", "message": ""}
    return {"code": proc.returncode, **seen}


def pasada(work: Path, n: int, *, sigterm: bool) -> dict[str, Any]:
    """Pass ``n``; with ``sigterm``, SIGTERM arrives while ``cobrar`` is in flight."""
    proc = arrancar(work, n)
    if sigterm:
        try:
            esperar_a(lambda: bool(lines(work / f"en_vuelo.{n}")), "cobrar to start")
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)  # the request is in; only now may the charge finish
        finally:
            (work / "deja").touch()
    seen = terminar(proc)
    journal = asyncio.run(leer(work / "runs.db"))
    cobros = lines(work / f"cobrar.{n}")
    return {
        **seen,
        **journal,
        "model": model_calls(work / f"model.{n}"),
        "sent": len(lines(work / f"model.{n}", "sent ")),
        "cobrar": len(cobros),
        "avisar": len(lines(work / f"avisar.{n}")),
        "during": [c.split("stop_requested=")[1] for c in cobros],
    }


def fila(n: int, m: dict[str, Any]) -> tuple[object, ...]:
    """Pass ``n`` as a table row."""
    lease = "held" if m["holder"] else "released"
    results = ", ".join(f"{step} {status}" for step, status in m["results"].items())
    what = f"{m['ended']}, exit {m['code']}"
    return (f"pass {n}", what, m["model"], m["cobrar"], m["avisar"], lease, m["status"], results)


def juzgar(pasos: dict[int, dict[str, Any]]) -> list[str]:
    """What must hold over the two passes."""
    problems = []
    for n, m in pasos.items():
        got = (m["code"], m["model"], m["cobrar"], m["avisar"], m["ended"])
        if got != ESPERADO[n]:
            problems.append(f"pass {n}: measured {got}, expected {ESPERADO[n]}")
        if m["holder"]:
            problems.append(f"pass {n} ended without releasing the lease")
    first = pasos[1]
    if first["during"] != ["True"]:
        problems.append(f"the stop was not requested while cobrar ran: {first['during']}")
    if first["sent"] != 1:
        problems.append(f"pass 1 sent {first['sent']} model requests after the stop")
    if first["results"] != {"m1.t1": "ok"} or first["status"] != "running":
        problems.append(f"pass 1 left {first['results']}, {first['status']}")
    return problems


def main() -> int:
    if sys.argv[1:2] == ["--vuelta"]:
        shutdown.install()  # before asyncio.run, so SIGTERM and SIGINT both request a stop
        return asyncio.run(vuelta(Path(sys.argv[2]), int(sys.argv[3])))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pasos = {1: pasada(work, 1, sigterm=True), 2: pasada(work, 2, sigterm=False)}
    rows = [fila(n, m) for n, m in pasos.items()]
    table("run-1: SIGTERM while cobrar is in flight", CABECERAS, rows)
    print(f"pass 1 said: {pasos[1]['message']}")
    print(f"cobrar saw the stop requested while it ran: {', '.join(pasos[1]['during'])}\n")
    return verdict(
        juzgar(pasos), "the charge in flight finished and was recorded, and never ran again"
    )


if __name__ == "__main__":
    sys.exit(main())
