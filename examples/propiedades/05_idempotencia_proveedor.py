"""Idempotencia hacia el proveedor: la clave es (run_id, step_id, huella del cuerpo).

A child process sends the first model request and is killed with SIGKILL inside
the call, after the request left and before the answer was recorded. On resume
the replay asks again, and that request must carry the identical key, so a
provider that honours keys answers it without a second bill. The body's
fingerprint is part of the key: the same run_id with another task, or with other
instructions, is another request and gets another key.

    python examples/propiedades/05_idempotencia_proveedor.py
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from _medir import KILLED, CountingGateway, child, ending, lines, table, verdict

from asiento import Agent, ModelResponse, Session, SqliteCheckpointer
from asiento.testing import ScriptedGateway

INSTRUCCIONES = "Responde en una frase."
RESPUESTAS = [ModelResponse(text="hola")]


async def primera_clave(db: Path, task: str, instructions: str) -> str:
    """Drive run-1 on ``db`` and return the key its first model request carried."""
    gateway = ScriptedGateway(RESPUESTAS)
    store = SqliteCheckpointer(db)
    try:
        agente = Agent(instructions=instructions)
        async for _ in agente.run(task, session=Session("run-1", gateway, store)):
            pass
    finally:
        await store.close()
    return gateway.keys[0]


async def hasta_morir(db: Path, log: Path) -> None:
    """The child: its gateway logs the key, then the process dies inside the call."""
    store = SqliteCheckpointer(db)
    try:
        agente = Agent(instructions=INSTRUCCIONES)
        gateway = CountingGateway(RESPUESTAS, log)
        async for _ in agente.run("lee /x", session=Session("run-1", gateway, store)):
            pass
    finally:
        await store.close()


def main() -> int:
    if sys.argv[1:2] == ["--hasta-morir"]:
        asyncio.run(hasta_morir(Path(sys.argv[2]), Path(sys.argv[3])))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        log = work / "model.log"
        argv = ["--hasta-morir", str(work / "a.db"), str(log)]
        proc = child(__file__, *argv, crash_at="inside_model_call")
        sent, answered = lines(log, "sent "), lines(log, "answered ")
        killed = sent[0].removeprefix("sent ") if sent else "(nothing sent)"
        cases = [
            ("resumed after the SIGKILL", work / "a.db", "lee /x", INSTRUCCIONES, True),
            ("same request, another store", work / "b.db", "lee /x", INSTRUCCIONES, True),
            ("same run_id, another task", work / "c.db", "lee /y", INSTRUCCIONES, False),
            ("same run_id, other instructions", work / "d.db", "lee /x", "Sé breve.", False),
        ]
        keys = [asyncio.run(primera_clave(db, task, ins)) for _, db, task, ins, _ in cases]
    print(f"child: {ending(proc)}; requests sent {len(sent)}, answers received {len(answered)}")
    rows = [("killed inside the model call", "m1", killed, "")]
    problems = []
    if proc.returncode != KILLED or len(sent) != 1 or answered:
        problems.append("the child was not killed inside its first model call")
    for (name, *_, same), key in zip(cases, keys, strict=True):
        rows.append((name, "m1", key, "yes" if key == killed else "no"))
        if (key == killed) != same:
            problems.append(f"{name}: key {key} {'differs from' if same else 'equals'} {killed}")
    headers = ["request", "step", "key", "same key as the killed one?"]
    table("idempotency keys of the first model request", headers, rows)
    return verdict(problems, "a resumed request repeats its key; another request gets another key")


if __name__ == "__main__":
    sys.exit(main())
