"""Escritura anticipada: la intención está en disco antes del efecto.

The four rows of the seed's write-ahead table, each produced for real: a child
process runs one tool call and is killed with SIGKILL at a chosen point, then
this process resumes the run and counts what the tool did.

| In the journal                          | Replay                 |
|-----------------------------------------|------------------------|
| intent and result                       | skips the step         |
| neither intent nor result               | executes it            |
| intent without result, non-idempotent   | raises UncertainEffect |
| intent without result, idempotent       | executes it            |

    python examples/propiedades/03_escritura_anticipada.py
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from _medir import KILLED, child, ending, lines, table, tally, verdict

from asiento import (
    Agent,
    ModelResponse,
    Session,
    SqliteCheckpointer,
    ToolCall,
    UncertainEffect,
    tool,
)
from asiento.testing import ScriptedGateway

# kind -> (tool name, idempotent)
HERRAMIENTAS = {"no-idempotente": ("transferir", False), "idempotente": ("guardar", True)}

# (row, tool kind, where the child dies, expected: tool runs on resume, UncertainEffect)
FILAS = [
    ("intent and result", "no-idempotente", "after_result", (0, False)),
    ("neither intent nor result", "no-idempotente", "before_intent", (1, False)),
    ("intent, no result, non-idempotent", "no-idempotente", "after_submitted", (0, True)),
    ("intent, no result, idempotent", "idempotente", "after_submitted", (1, False)),
]


def agente(kind: str, log: Path) -> tuple[Agent, ScriptedGateway]:
    """One tool that logs each execution, and a model that calls it once, then answers."""
    name, idempotent = HERRAMIENTAS[kind]

    def efecto(importe: int) -> str:
        """Move money, or store a file: something the world remembers."""
        tally(log)
        return "hecho"

    herramienta = tool(idempotent=idempotent, name=name)(efecto)
    respuestas = [
        ModelResponse(tool_calls=[ToolCall(name=name, arguments={"importe": 100})]),
        ModelResponse(text="hecho"),
    ]
    return Agent(tools=[herramienta]), ScriptedGateway(respuestas)


async def vuelta(db: Path, log: Path, kind: str) -> str:
    """Drive the run once; 'closed', or 'UncertainEffect' if replay refused to guess."""
    agent, gateway = agente(kind, log)
    store = SqliteCheckpointer(db)
    try:
        async for _ in agent.run("paga 100", session=Session("run-1", gateway, store)):
            pass
    except UncertainEffect:
        return "UncertainEffect"
    finally:
        await store.close()
    return "closed"


async def fases(db: Path) -> str:
    """What the journal holds for the tool step m1.t1."""
    store = SqliteCheckpointer(db)
    try:
        records = await store.load_step("run-1", "m1.t1")
    finally:
        await store.close()
    return " + ".join(str(e.phase) for e in records) or "nothing"


def fila(work: Path, n: int, kind: str, crash_at: str) -> tuple[str, int, str, int, str]:
    """Kill a child at ``crash_at``, then resume here; what the journal held and what ran."""
    db, log = work / f"{n}.db", work / f"{n}.tool"
    proc = child(__file__, "--vuelta", str(db), str(log), kind, crash_at=crash_at)
    killed = "killed by SIGKILL" if proc.returncode == KILLED else ending(proc)
    held = asyncio.run(fases(db))
    before = len(lines(log))
    outcome = asyncio.run(vuelta(db, log, kind))
    return killed, before, held, len(lines(log)) - before, outcome


def main() -> int:
    if sys.argv[1:2] == ["--vuelta"]:
        asyncio.run(vuelta(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]))
        return 0
    rows: list[tuple[object, ...]] = []
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, (name, kind, crash_at, expected) in enumerate(FILAS, 1):
            killed, before, held, after, outcome = fila(Path(tmp), n, kind, crash_at)
            uncertain = outcome == "UncertainEffect"
            rows.append((name, crash_at, held, before, after, "yes" if uncertain else "no"))
            if killed != "killed by SIGKILL":
                problems.append(f"{name}: the child was not killed at {crash_at} ({killed})")
            if (after, uncertain) != expected:
                problems.append(f"{name}: measured {(after, uncertain)}, expected {expected}")
    headers = [
        "row",
        "child killed at",
        "journal held (m1.t1)",
        "tool runs before",
        "tool runs on resume",
        "UncertainEffect",
    ]
    table("the write-ahead table, each row produced by a real SIGKILL", headers, rows)
    return verdict(problems, "replay skips, executes, or refuses to guess, as the journal says")


if __name__ == "__main__":
    sys.exit(main())
