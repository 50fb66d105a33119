"""Durabilidad: una inferencia ya pagada no se paga otra vez.

Three passes over the same run, each in its own process, on one SQLite file:

1. the model asks for read("/x"), the tool runs and its result is recorded;
   then the process is killed with SIGKILL inside the second model call;
2. a new process with a new gateway resumes: model ×1, tool ×0, the run closes;
3. a new process resumes the closed run: model ×0, tool ×0.

Each process counts what it did in fsynced files; this script only reads them.

    python examples/propiedades/02_durabilidad.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _medir import (
    CountingGateway,
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

from asiento import Agent, FinalStep, ModelResponse, Session, SqliteCheckpointer, ToolCall, tool

RESPUESTAS = [
    ModelResponse(tool_calls=[ToolCall(name="read", arguments={"path": "/x"})]),
    ModelResponse(text="/x dice: hola"),
]
ESPERADO = {1: (1, 1, "killed by SIGKILL"), 2: (1, 0, "closed"), 3: (0, 0, "already closed")}
NOTAS = {
    1: "← el proceso muere aquí",
    2: "← solo ocurre lo que no llegó a ocurrir",
    3: "← un run cerrado no se reabre",
}


async def vuelta(db: Path, work: Path, n: int) -> None:
    """One pass, in this process: drive run-1 as far as it goes."""
    tool_log = work / f"tool.{n}"

    @tool(idempotent=True)
    def read(path: str) -> str:
        """Read a file."""
        tally(tool_log, path)
        return "hola"

    agente = Agent(instructions="Di qué contiene el fichero.", tools=[read])
    store = SqliteCheckpointer(db)
    gateway = CountingGateway(RESPUESTAS, work / f"model.{n}")
    ended = "not closed"
    try:
        async for paso in agente.run("lee /x", session=Session("run-1", gateway, store)):
            if isinstance(paso, FinalStep):
                ended = "already closed" if paso.replayed else "closed"
    finally:
        await store.close()
    report({"ended": ended})


def main() -> int:
    if run_pass(vuelta):
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        measured = {}
        for n, crash_at in ((1, "inside_model_call@2"), (2, None), (3, None)):
            proc = pass_child(__file__, work, n, crash_at=crash_at)
            ended = (reported(proc) or {}).get("ended", ending(proc))
            tools = len(lines(work / f"tool.{n}"))
            measured[n] = (model_calls(work / f"model.{n}"), tools, ended)
    rows = [(n, m, t, e, NOTAS[n]) for n, (m, t, e) in measured.items()]
    headers = ["pass", "model calls", "tool calls", "how it ended", "note"]
    table("run-1, «lee /x», three processes", headers, rows)
    problems = [
        f"pass {n}: measured {measured[n]}, expected {ESPERADO[n]}"
        for n in ESPERADO
        if measured[n] != ESPERADO[n]
    ]
    return verdict(problems, "a recorded answer is not paid again; a closed run is not reopened")


if __name__ == "__main__":
    sys.exit(main())
