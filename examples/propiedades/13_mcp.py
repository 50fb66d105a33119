"""MCP: una herramienta de otro servidor tiene las mismas garantías que una local.

This script is also the MCP server (``--servidor``, written with the mcp SDK, spoken
to over stdio): ``consultar`` is read-only, ``enviar`` has no annotations (the spec's
defaults: not idempotent), ``cobrar`` deduplicates by the asiento key that travels in
the call's ``_meta``. The server counts every call it receives and every one it
applies, in an fsynced file. For each tool, two passes over one run, each in its own
process (the server trusted, ``cobrar`` declared key-honouring):

1. the agent calls the tool; the child is killed with SIGKILL after the server
   answered and before the run recorded it (``after_tool``);
2. a new child resumes: ``consultar`` runs again (repeating is free), ``cobrar`` is
   called again with the same key and the server answers its first result (applied
   once), ``enviar`` stops with ``UncertainEffect`` (never a second call).

    python examples/propiedades/13_mcp.py
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import tempfile
from pathlib import Path

from _medir import child, ending, lines, report, reported, table, tally, verdict
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

from asiento import Agent, ModelResponse, Session, SqliteCheckpointer, ToolCall, UncertainEffect
from asiento.mcp import McpServer
from asiento.testing import ScriptedGateway

CLAVE = "asiento/idempotency-key"
LLAMADAS = {"consultar": {"ciudad": "Lima"}, "enviar": {"texto": "hola"}, "cobrar": {"euros": 5}}


def servidor(cuenta: Path, claves: Path) -> None:
    """The MCP server: each call received and each applied is a line in ``cuenta``."""
    app = MCPServer("tienda")

    def aplica(tool: str, ctx: Context) -> str:
        key = str((ctx.request_context.meta or {}).get(CLAVE))
        tally(cuenta, f"received {tool} {key}")
        return key

    @app.tool(annotations=ToolAnnotations(read_only_hint=True))
    def consultar(ciudad: str, ctx: Context) -> str:
        """The weather in a city."""
        tally(cuenta, f"applied consultar {aplica('consultar', ctx)}")
        return f"sol en {ciudad}"

    @app.tool()
    def enviar(texto: str, ctx: Context) -> str:
        """Send a note."""
        tally(cuenta, f"applied enviar {aplica('enviar', ctx)}")
        return f"enviado: {texto}"

    @app.tool(annotations=ToolAnnotations(destructive_hint=False), structured_output=False)
    def cobrar(euros: int, ctx: Context) -> str:
        """Charge a card, once per key."""
        key = aplica("cobrar", ctx)
        with sqlite3.connect(claves) as db:
            db.execute("CREATE TABLE IF NOT EXISTS k (key TEXT PRIMARY KEY, result TEXT)")
            row = db.execute("SELECT result FROM k WHERE key = ?", (key,)).fetchone()
            if row is not None:
                return str(row[0])
            tally(cuenta, f"applied cobrar {key}")
            result = f"cobrados {euros} EUR"
            db.execute("INSERT INTO k VALUES (?, ?)", (key, result))
        return result

    app.run()


async def vuelta(tool: str, db: str, cuenta: str, claves: str) -> None:
    """One pass, in this process: the model calls ``tool`` once, then says it is done."""
    comando = [sys.executable, __file__, "--servidor", cuenta, claves]
    llamada = ToolCall(name=tool, arguments=LLAMADAS[tool])
    gateway = ScriptedGateway([ModelResponse(tool_calls=[llamada]), ModelResponse(text="hecho")])
    store = SqliteCheckpointer(db)
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    server = McpServer(
        "tienda", command=comando, env=env, trusted=True, honours_keys=(tool == "cobrar")
    )
    try:
        async with server:
            agente = Agent(instructions="Usa la tienda.", tools=await server.tools())
            async for _ in agente.run("una tarea", session=Session("run-1", gateway, store)):
                pass
        report({"ended": "closed"})
    except UncertainEffect:
        report({"ended": "UncertainEffect"})
    finally:
        await store.close()


def main() -> int:
    if sys.argv[1:2] == ["--servidor"]:
        servidor(Path(sys.argv[2]), Path(sys.argv[3]))
        return 0
    if sys.argv[1:2] == ["--vuelta"]:
        asyncio.run(vuelta(*sys.argv[2:6]))
        return 0
    rows, counts = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for tool in LLAMADAS:
            db, cuenta = Path(tmp) / f"{tool}.db", Path(tmp) / f"{tool}.log"
            args = ("--vuelta", tool, str(db), str(cuenta), str(Path(tmp) / f"{tool}-k.db"))
            first = child(__file__, *args, crash_at="after_tool")
            second = child(__file__, *args)
            ended = (reported(second) or {}).get("ended", ending(second))
            received = len(lines(cuenta, f"received {tool}"))
            applied = len(lines(cuenta, f"applied {tool}"))
            keys = {x.split()[-1] for x in lines(cuenta, f"received {tool}")}
            counts[tool] = (ended, received, applied, len(keys))
            rows.append((tool, ending(first), ended, received, applied, len(keys)))
    headers = ["tool", "pass 1", "pass 2", "calls received", "applied", "keys sent"]
    table("one MCP tool call per run, killed after the server answered", headers, rows)
    print()
    expected = {
        "consultar": ("closed", 2, 2, 1),
        "enviar": ("UncertainEffect", 1, 1, 1),
        "cobrar": ("closed", 2, 1, 1),
    }
    problems = [
        f"{tool}: got {counts[tool]}, expected {want}"
        for tool, want in expected.items()
        if counts[tool] != want
    ]
    return verdict(problems, "the MCP call read-only runs again, the keyed one applies once")


if __name__ == "__main__":
    sys.exit(main())
