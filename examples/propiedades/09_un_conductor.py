"""Un solo conductor: un run, un conductor; el que se quedó atrás no escribe nada.

The agent first calls ``esperar`` (idempotent: it waits until a file appears),
then ``send`` (not idempotent: sending twice sends twice). Every driver is a
process of its own, on one SQLite file:

1. A drives run-1 with ``Session(..., lease_ttl=2.0)`` and blocks in ``esperar``;
   its lease is renewed in the background, so it outlives its 2 s ttl;
2. B tries run-1 meanwhile: ``RunLocked`` at once, naming A's pid; no call;
3. A is frozen with SIGSTOP; once its lease expired, C takes the run over (the
   fencing token grows), runs ``esperar`` again and ``send`` once, and closes;
4. A is continued with SIGCONT and ``esperar`` returns: its first write is
   refused with ``LeaseLost``; it records nothing and never sends;
5. K drives run-2 with a 30 s lease and is killed with SIGKILL in ``esperar``;
   D takes run-2 over at once (``wait=0``), long before the lease would expire.

Each process counts what it did in fsynced files; this script only reads them
and the journal.

    python examples/propiedades/09_un_conductor.py
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _medir import (
    CountingGateway,
    child,
    ending,
    lines,
    model_calls,
    report,
    reported,
    table,
    tally,
    verdict,
)

from asiento import (
    Agent,
    LeaseLost,
    ModelResponse,
    RunLocked,
    Session,
    SqliteCheckpointer,
    ToolCall,
    tool,
)
from asiento.testing import ENV_VAR

RESPUESTAS = [
    ModelResponse(tool_calls=[ToolCall(name="esperar", arguments={})]),
    ModelResponse(tool_calls=[ToolCall(name="send", arguments={"to": "ana"})]),
    ModelResponse(text="Enviado."),
]
TTL_CORTO = 2.0
TTL_LARGO = 30.0
PLAZO = 20.0  # every wait in this script (and in ``esperar``) ends by then


def agente(work: Path, run: str, who: str) -> Agent:
    """The agent as process ``who`` runs it; its tools count themselves in fsynced files."""

    @tool(idempotent=True)
    async def esperar() -> str:
        """Wait until the file go.RUN appears (at most PLAZO seconds)."""
        tally(work / f"esperar.{who}", repr(time.time()))
        deadline = time.monotonic() + PLAZO
        while not (work / f"go.{run}").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return "listo"

    @tool
    def send(to: str) -> str:
        """Send a message (not idempotent: sending twice sends twice)."""
        tally(work / f"send.{who}", to)
        return "sent"

    return Agent(instructions="Espera y envía.", tools=[esperar, send])


async def conducir(work: Path, run: str, who: str, *, ttl: float, wait: float) -> None:
    """Drive ``run`` as process ``who``; report how it ended and the run's fence."""
    store = SqliteCheckpointer(work / "runs.db")
    gateway = CountingGateway(RESPUESTAS, work / f"model.{who}")
    session = Session(run, gateway, store, lease_ttl=ttl, wait=wait)
    started = time.monotonic()
    try:
        async for _ in agente(work, run, who).run("envía a ana", session=session):
            pass
        ended, message = "closed", ""
    except (RunLocked, LeaseLost) as exc:
        ended, message = type(exc).__name__, str(exc)
    try:
        fence = [r.fence for r in await store.runs() if r.run_id == run]
    finally:
        await store.close()
    seconds = time.monotonic() - started
    report({"ended": ended, "message": message, "fence": fence[0], "seconds": seconds})


async def leer(db: Path, run: str) -> dict[str, Any]:
    """The run as the journal holds it: records, fence, lease expiry."""
    store = SqliteCheckpointer(db)
    try:
        info = next(r for r in await store.runs() if r.run_id == run)
        records = len(await store.load(run))
    finally:
        await store.close()
    return {"records": records, "fence": info.fence, "expires": info.lease_expires}


def arrancar(
    work: Path, run: str, who: str, ttl: float, wait: float = 0.0
) -> subprocess.Popen[str]:
    """Start a driver in the background (``child`` waits for its end; this one must not)."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    argv = [sys.executable, __file__, "--conducir", str(work), run, who, str(ttl), str(wait)]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def conductor(work: Path, run: str, who: str, ttl: float, wait: float) -> dict[str, Any]:
    """A driver in a new process, to its end: what it reported."""
    proc = child(__file__, "--conducir", str(work), run, who, str(ttl), str(wait))
    return reported(proc) or {"ended": ending(proc), "message": "", "fence": None}


def esperar_a(check: Any, what: str) -> None:
    """Poll ``check`` until it holds, for at most PLAZO seconds."""
    deadline = time.monotonic() + PLAZO
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {PLAZO:.0f} s waiting for {what}")
        time.sleep(0.01)


def entrada(work: Path, who: str) -> float:
    """When ``who`` entered ``esperar`` (epoch seconds), from its count file."""
    return float(lines(work / f"esperar.{who}")[0])


def detenido(pid: int) -> bool:
    """Whether ``pid`` is stopped (state T in /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] in {"T", "t"}


def escritura_libre(db: Path) -> bool:
    """Whether SQLite's write lock on ``db`` is free right now (taken and given back)."""
    probe = sqlite3.connect(db, timeout=0, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        probe.close()


def congelar(proc: subprocess.Popen[str], db: Path) -> None:
    """SIGSTOP ``proc`` between two of its writes.

    A process frozen inside a commit would keep SQLite's write lock, and every
    other process would wait for the lock, lease or no lease; so if a commit is
    in progress (A renewing, or C asking for the run), let it end and freeze again.
    """
    for _ in range(200):
        proc.send_signal(signal.SIGSTOP)
        esperar_a(lambda: detenido(proc.pid), "SIGSTOP to take effect")
        if escritura_libre(db):
            return
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.005)
    raise TimeoutError("the holder was inside a commit at every one of 200 tries")


def fin(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Wait for a background driver; what it reported."""
    out, err = proc.communicate(timeout=60)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return reported(done) or {"ended": ending(done), "message": "", "fence": None}


class Filas:
    """The table's rows, the errors the drivers got, and what did not hold."""

    def __init__(self) -> None:
        self.rows: list[tuple[object, ...]] = []
        self.problems: list[str] = []
        self.messages: list[str] = []

    def add(self, who: str, what: str, model: int, sends: int, stale: object = "-") -> None:
        self.rows.append((who, what, model, sends, stale))

    def expect(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)


def relevo(work: Path) -> dict[str, Any]:
    """run-1: A holds it, B is refused, A is frozen, C takes over, A is continued."""
    db = work / "runs.db"
    m: dict[str, Any] = {}
    a = arrancar(work, "run-1", "A", TTL_CORTO)
    c = None
    try:
        esperar_a(lambda: bool(lines(work / "esperar.A")), "A to enter esperar")
        m["B"] = conductor(work, "run-1", "B", TTL_LARGO, 0)
        c = arrancar(work, "run-1", "C", TTL_LARGO, PLAZO)  # waits for the run
        # Freeze A only once it outlived its ttl: only the renewals kept its lease alive.
        time.sleep(max(0.0, entrada(work, "A") + 1.5 * TTL_CORTO - time.time()))
        congelar(a, db)
        m["stopped"], m["frozen"] = time.time(), asyncio.run(leer(db, "run-1"))
        m["A model"], m["A sends"] = model_calls(work / "model.A"), len(lines(work / "send.A"))
        (work / "go.run-1").touch()
        m["C"] = fin(c)
        m["taken"] = asyncio.run(leer(db, "run-1"))
        a.send_signal(signal.SIGCONT)
        m["A"] = fin(a)
    finally:
        for proc in (a, c):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.communicate(timeout=60)
    m["after"], m["A pid"] = asyncio.run(leer(db, "run-1")), a.pid
    return m


def filas_relevo(work: Path, m: dict[str, Any], filas: Filas) -> None:
    """The four rows of run-1, each figure read from the count files and the journal."""
    fence, held = m["frozen"]["fence"], m["stopped"] - entrada(work, "A")
    what = f"holds run-1 (fence {fence}, lease_ttl={TTL_CORTO}), in esperar {held:.1f} s"
    filas.add("A", f"{what}, lease renewed; then SIGSTOP", m["A model"], m["A sends"])
    what = f"{m['B']['ended']} in {m['B'].get('seconds', 0):.2f} s, naming A's pid {m['A pid']}"
    filas.add("B", what, model_calls(work / "model.B"), len(lines(work / "send.B")))
    late = entrada(work, "C") - m["frozen"]["expires"]
    what = f"took over {late:.1f} s after A's lease expired, fence {fence} → {m['C']['fence']}"
    sends = len(lines(work / "send.C"))
    filas.add("C", f"{what}; {m['C']['ended']}", model_calls(work / "model.C"), sends)
    stale = m["after"]["records"] - m["taken"]["records"]
    model = model_calls(work / "model.A") - m["A model"]
    sends = len(lines(work / "send.A")) - m["A sends"]
    filas.add("A", f"SIGCONT, esperar returns: {m['A']['ended']}", model, sends, stale)
    filas.messages += [f"B got: RunLocked: {m['B']['message']}"]
    filas.messages += [f"A got: LeaseLost: {m['A']['message']}"]


def juzgar_relevo(work: Path, m: dict[str, Any], filas: Filas) -> None:
    """What must hold on run-1."""
    b, c, frozen = m["B"], m["C"], m["frozen"]
    filas.expect(b["ended"] == "RunLocked", f"B was not refused: {b['ended']}")
    filas.expect(f"pid {m['A pid']} " in b["message"], "B's error does not name A's pid")
    filas.expect(lines(work / "model.B") == [], "B called the model")
    filas.expect(frozen["expires"] > m["stopped"], "A's lease was not kept alive past its ttl")
    filas.expect(c["ended"] == "closed", f"C did not close the run: {c['ended']}")
    filas.expect(c["fence"] == frozen["fence"] + 1, f"the fence did not grow: {frozen} → {c}")
    late = entrada(work, "C") - frozen["expires"]
    filas.expect(late >= 0, f"C took over {-late:.2f} s before A's lease expired")
    filas.expect(m["A"]["ended"] == "LeaseLost", f"A did not lose its lease: {m['A']['ended']}")
    stale = m["after"]["records"] - m["taken"]["records"]
    filas.expect(stale == 0, f"A wrote {stale} records after the takeover")
    filas.expect(model_calls(work / "model.A") == 1, "A called the model after the takeover")
    sends = {w: len(lines(work / f"send.{w}")) for w in "ABC"}
    filas.expect(sends == {"A": 0, "B": 0, "C": 1}, f"send ran {sends}, expected once, by C")


def muerto(work: Path, k: subprocess.Popen[str]) -> dict[str, Any]:
    """run-2: K holds it with a 30 s lease and is killed; D takes over with wait=0."""
    db = work / "runs.db"
    m: dict[str, Any] = {}
    try:
        esperar_a(lambda: bool(lines(work / "esperar.K")) or k.poll() is not None, "K")
        if k.poll() is not None:
            out, err = k.communicate(timeout=60)
            raise RuntimeError(f"K ended before it entered esperar:\n{out}{err}")
    finally:
        k.send_signal(signal.SIGKILL)
        k.communicate(timeout=60)
    m["killed"], m["K"] = time.time(), ending(fin_de(k))
    m["held"] = asyncio.run(leer(db, "run-2"))
    (work / "go.run-2").touch()
    m["D"] = conductor(work, "run-2", "D", TTL_LARGO, 0)
    m["took"] = entrada(work, "D") - m["killed"] if lines(work / "esperar.D") else float("nan")
    m["left"] = m["held"]["expires"] - m["killed"]
    return m


def fin_de(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    """A background process that already ended, as ``ending`` reads it."""
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", "")


def filas_muerto(work: Path, m: dict[str, Any], filas: Filas) -> None:
    """The two rows of run-2, and what must hold on it."""
    fence, d = m["held"]["fence"], m["D"]
    what = f"holds run-2 (fence {fence}, lease_ttl={TTL_LARGO:.0f}), in esperar; {m['K']}"
    filas.add("K", what, model_calls(work / "model.K"), len(lines(work / "send.K")))
    what = f"took over {m['took']:.1f} s after the SIGKILL, with {m['left']:.0f} s of K's lease"
    what += f" left, fence {fence} → {d['fence']}; {d['ended']}"
    filas.add("D", what, model_calls(work / "model.D"), len(lines(work / "send.D")))
    filas.expect(m["K"] == "killed by SIGKILL", f"K was not killed: {m['K']}")
    filas.expect(d["ended"] == "closed", f"D did not take run-2 over at once: {d['ended']}")
    filas.expect(m["took"] < m["left"], "D took run-2 over only after K's lease expired")
    filas.expect(d["fence"] == fence + 1, f"the fence did not grow: {m['held']} → {d}")
    sends = len(lines(work / "send.K")) + len(lines(work / "send.D"))
    filas.expect(sends == 1, f"send ran {sends} times on run-2, expected once")


def main() -> int:
    if sys.argv[1:2] == ["--conducir"]:
        folder, run, who, ttl, wait = sys.argv[2:7]
        asyncio.run(conducir(Path(folder), run, who, ttl=float(ttl), wait=float(wait)))
        return 0
    filas = Filas()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        k = arrancar(work, "run-2", "K", TTL_LARGO)  # starts up while run-1 is played out
        try:
            relevado = relevo(work)
        except BaseException:
            k.kill()
            k.communicate(timeout=60)
            raise
        muerte = muerto(work, k)
        filas_relevo(work, relevado, filas)
        juzgar_relevo(work, relevado, filas)
        filas_muerto(work, muerte, filas)
    headers = [
        "",
        "what happened",
        "model calls",
        "send executions",
        "stale records after takeover",
    ]
    table("run-1 and run-2: one driver at a time", headers, filas.rows)
    for message in filas.messages:
        print(message)
    print()
    return verdict(
        filas.problems,
        "one driver at a time; the stale holder wrote nothing and sent nothing; send ran once",
    )


if __name__ == "__main__":
    sys.exit(main())
