"""El journal: qué se guarda (y qué no).

The journal records which steps happened and their results, not the
conversation. This script runs a small agent (two tool calls, then an answer)
on a SQLite file, reads the timeline back with ``Checkpointer.load`` and prints
every record with the size of its payload. It fails if any payload holds the
conversation: a ``messages`` key, the task's text or the instructions.

    python examples/propiedades/01_journal.py
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from _medir import table, verdict

from asiento import Agent, ModelResponse, Session, SqliteCheckpointer, ToolCall, tool
from asiento.testing import ScriptedGateway

TAREA = "Lee /x y /y, y dime si dicen lo mismo."
INSTRUCCIONES = "Eres un agente que lee ficheros con cuidado."
RESPUESTAS = [
    ModelResponse(tool_calls=[ToolCall(name="read", arguments={"path": "/x"})]),
    ModelResponse(tool_calls=[ToolCall(name="read", arguments={"path": "/y"})]),
    ModelResponse(text="Sí: los dos dicen «hola»."),
]


@tool(idempotent=True)
def read(path: str) -> str:
    """Read a file."""
    return "hola"


def keys(value: Any) -> set[str]:
    """Every key of every object nested in ``value``."""
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in keys(v)}
    return set()


async def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteCheckpointer(Path(tmp) / "runs.db")
        agente = Agent(instructions=INSTRUCCIONES, tools=[read])
        session = Session("run-1", ScriptedGateway(RESPUESTAS), store)
        async for _ in agente.run(TAREA, session=session):
            pass
        timeline = await store.load("run-1")
        await store.close()
    sizes = [len(json.dumps(e.payload, separators=(",", ":")).encode()) for e in timeline]
    rows = [
        (e.step_id, e.phase, e.decision or "", size)
        for e, size in zip(timeline, sizes, strict=True)
    ]
    headers = ["step_id", "phase", "decision", "payload bytes"]
    table("run-1: the journal, as Checkpointer.load returns it", headers, rows)
    average = sum(sizes) / max(len(sizes), 1)
    print(f"{len(timeline)} records, {sum(sizes)} payload bytes, {average:.0f} bytes per record")
    stats = session.stats
    print(f"model calls made: {stats.model_calls}, tool calls made: {stats.tool_calls}")
    texts = [json.dumps(e.payload, ensure_ascii=False) for e in timeline]
    found = {
        "a 'messages' key": any("messages" in keys(e.payload) for e in timeline),
        "the task's text": any(TAREA in t for t in texts),
        "the instructions": any(INSTRUCCIONES in t for t in texts),
    }
    for what, present in found.items():
        print(f"payloads holding {what}: {'yes' if present else 'no'}")
    problems = [f"the journal stores {what}" for what, present in found.items() if present]
    if (session.stats.model_calls, session.stats.tool_calls) != (3, 2) or not timeline:
        problems.append("the run did not make its 3 model calls and 2 tool calls")
    return verdict(problems, "the journal stores steps and results, not the conversation")


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
