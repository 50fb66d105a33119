"""Abandonar detiene el run: una vez que ``asiento abandon`` vuelve, no empieza ningún efecto.

The agent pays six times in a row, one payment per model turn (``pay``: not
idempotent, about 0.25 s each). Every actor is a process of its own, on one
SQLite file:

1. run-1 is submitted and A drives it;
2. once two payments started, B runs ``asiento abandon run-1 --by ana --reason
   ...``: the command itself (``asiento.cli.main``, what ``python -m asiento``
   runs), loaded ahead so that its start-up (half a second, more on a busy
   machine) does not race the payments. Abandoning takes the run's fence, as a
   takeover does;
3. A stops at its next write with ``RunAbandoned`` ("abandoned by ana"), never
   ``DuplicateRecord``; no payment starts after the command returned. Before
   the fix A went on paying and then failed with ``DuplicateRecord``;
4. a worker looks for work afterwards and claims nothing: the run is closed.

``pay`` writes the time each payment starts and ends to an fsynced file; this
script only reads those files, what the processes said, and the journal.

    python examples/propiedades/12_abandonar_detiene.py
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
    App,
    AsientoError,
    ModelResponse,
    RunAbandoned,
    Session,
    SqliteCheckpointer,
    ToolCall,
    Worker,
    submit,
    tool,
)
from asiento.testing import ENV_VAR

PAGOS = 6
RESPUESTAS = [
    *[ModelResponse(tool_calls=[ToolCall(name="pay", arguments={"n": n})]) for n in range(PAGOS)],
    ModelResponse(text="Seis pagos hechos."),
]
TAREA = "paga seis veces"
RAZON = "se paga de más"
DURA = 0.25  # seconds each payment takes
PLAZO = 20.0  # every wait in this script ends by then


def agente(work: Path, who: str) -> Agent:
    """The agent as process ``who`` runs it; ``pay`` writes when each payment starts and ends."""

    @tool
    async def pay(n: int) -> str:
        """Pay once (not idempotent: paying twice pays twice)."""
        tally(work / f"pay.{who}", f"start {time.time()!r} {n}")
        await asyncio.sleep(DURA)
        tally(work / f"pay.{who}", f"end {time.time()!r} {n}")
        return "pagado"

    return Agent(tools=[pay])


async def conducir(work: Path) -> None:
    """Process A: drive run-1 to its end, or until it is stopped; report how it ended."""
    store = SqliteCheckpointer(work / "runs.db")
    session = Session("run-1", CountingGateway(RESPUESTAS, work / "model.A"), store)
    ended: dict[str, Any] = {"ended": "closed", "message": "", "in_flight": []}
    try:
        async for _ in agente(work, "A").run(TAREA, session=session):
            pass
    except RunAbandoned as exc:
        ended = {"ended": "RunAbandoned", "message": str(exc), "in_flight": list(exc.in_flight)}
    except AsientoError as exc:
        ended = {"ended": type(exc).__name__, "message": str(exc), "in_flight": []}
    finally:
        await store.close()
    report(ended)


async def trabajar(work: Path) -> None:
    """Process W: a worker with the same agent looks for work once."""
    store = SqliteCheckpointer(work / "runs.db")
    app = App(
        agents={"default": agente(work, "W")}, gateway=CountingGateway(RESPUESTAS, work / "model.W")
    )
    try:
        worker = Worker(store, app)
        report({"found": await worker.run_once(), "claimed": worker.stats.claimed})
    finally:
        await store.close()


async def preparar(db: Path) -> None:
    store = SqliteCheckpointer(db)
    try:
        await submit(store, "run-1", TAREA)
    finally:
        await store.close()


async def estado(db: Path) -> str:
    store = SqliteCheckpointer(db)
    try:
        return (await store.runs())[0].status.value
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


def pagos(work: Path, who: str, what: str) -> list[tuple[float, int]]:
    """(time, payment number) of every ``what`` line ``who``'s payments wrote."""
    return [(float(t), int(n)) for _, t, n in (x.split() for x in lines(work / f"pay.{who}", what))]


def abandonar_ya(work: Path) -> None:
    """Process B: the ``asiento`` command itself, loaded before ``ahora`` appears so that
    its start-up does not race the payments; writes when the command returned."""
    from asiento.cli import main as asiento

    deadline = time.monotonic() + PLAZO
    while not (work / "ahora").exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    argv = ["abandon", "run-1", "--by", "ana", "--reason", RAZON, "--store", str(work / "runs.db")]
    try:
        asiento(argv, prog_name="asiento")
    finally:
        tally(work / "abandon", repr(time.time()))


def abandonar(work: Path) -> dict[str, Any]:
    """A drives run-1; B abandons it once two payments started; then a worker looks."""
    asyncio.run(preparar(work / "runs.db"))
    a = proceso(__file__, "--conducir", str(work))
    b = proceso(__file__, "--abandonar", str(work))
    deadline = time.monotonic() + PLAZO
    while len(pagos(work, "A", "start")) < 2 and a.poll() is None:
        if time.monotonic() > deadline:
            a.kill()
            break
        time.sleep(0.005)
    m: dict[str, Any] = {"ran": time.time()}
    (work / "ahora").touch()
    m["B"] = fin(b)
    m["returned"] = float((lines(work / "abandon") or ["nan"])[0])
    m["A"] = reported(fin(a)) or {"ended": "no report", "message": "", "in_flight": []}
    m["status"] = asyncio.run(estado(work / "runs.db"))
    m["W"] = reported(fin(proceso(__file__, "--trabajar", str(work)))) or {"found": "no report"}
    m["starts"] = pagos(work, "A", "start")
    m["ends"] = {n: t for t, n in pagos(work, "A", "end")}
    m["W calls"] = model_calls(work / "model.W") + len(lines(work / "pay.W"))
    m["A calls"] = model_calls(work / "model.A")
    return m


def mostrar(m: dict[str, Any]) -> None:
    """Each payment A started, then what every process said, as measured."""
    ran, returned, ends = m["ran"], m["returned"], m["ends"]
    rows = []
    for t, n in m["starts"]:
        end = f"{ends[n] - returned:+.2f}" if n in ends else "-"
        when = "before" if t < ran else "while it ran" if t < returned else "AFTER it returned"
        rows.append((n + 1, f"m{n + 1}.t1", f"{t - returned:+.2f}", end, when))
    headers = ["payment", "step", "started (s)", "ended (s)", "started, relative to abandon"]
    table("run-1: abandoned while A pays (seconds from asiento abandon returning)", headers, rows)
    before = sum(1 for t, _ in m["starts"] if t < ran)
    b, w = m["B"], m["W"]
    said = b.stdout.strip().splitlines() or [b.stderr.strip()]
    print(f"payments started after asiento abandon returned: {late(m)}")
    print(f"payments in all: {len(m['starts'])} of {PAGOS} ({before} before abandon ran)")
    print(f"asiento abandon: exit {b.returncode}: " + " / ".join(said))
    print(f"A ended: {m['A']['ended']}: {m['A']['message']}")
    print(f"status in the index: {m['status']}")
    print(f"a worker afterwards: found work {w.get('found')}, claimed {w.get('claimed')}, ", end="")
    print(f"model calls and payments {m['W calls']} (A made {m['A calls']} model calls)\n")


def late(m: dict[str, Any]) -> int:
    """Payments that started once asiento abandon had returned."""
    return sum(1 for t, _ in m["starts"] if t >= m["returned"])


def juzgar(m: dict[str, Any]) -> list[str]:
    """What must hold once asiento abandon returned."""
    b, a, w, starts = m["B"], m["A"], m["W"], m["starts"]
    problems = []
    if m["returned"] != m["returned"]:  # nan: B never said it returned
        problems.append("asiento abandon never returned")
    if late(m):
        problems.append(f"{late(m)} payment(s) started after asiento abandon returned")
    if b.returncode != 0:
        problems.append(f"asiento abandon failed: {b.stderr.strip()}")
    if sum(1 for t, _ in starts if t < m["returned"]) >= PAGOS:
        problems.append("abandon came after every payment started: nothing was measured")
    if a["ended"] != "RunAbandoned" or "abandoned by ana" not in a["message"]:
        problems.append(f"A did not stop with RunAbandoned naming ana: {a}")
    named = sorted(s.split("'")[1] for s in b.stdout.splitlines() if " was in flight" in s)
    lost = sorted(s for s in a["in_flight"] if "." in s)  # "m3" alone: a model answer
    last = [f"m{starts[-1][1] + 1}.t1"] if starts else []
    if named != lost or named not in ([], last):
        problems.append(f"in flight: abandon named {named}, A lost {lost}, last paid {last}")
    if m["status"] != "closed" or w.get("found") is not False or m["W calls"]:
        problems.append(f"the run is not closed to workers: {m['status']}, {w}")
    return problems


def main() -> int:
    if sys.argv[1:2] == ["--abandonar"]:
        abandonar_ya(Path(sys.argv[2]))  # exits with the command's status
    if sys.argv[1:2] in (["--conducir"], ["--trabajar"]):
        job = conducir if sys.argv[1] == "--conducir" else trabajar
        asyncio.run(job(Path(sys.argv[2])))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        medido = abandonar(Path(tmp))
    mostrar(medido)
    return verdict(juzgar(medido), "once asiento abandon returned, no payment started; A stopped")


if __name__ == "__main__":
    sys.exit(main())
