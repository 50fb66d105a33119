"""An MCP server (the ``mcp`` SDK's MCPServer) whose tools are deduplicated by IdempotencyKeys.

Run by tests/mcp/test_server_dedup.py as a real process:

    python dedup_server.py DIR stdio|http [--ttl S] [--skew S] [--only TOOL]...
                                             [--scope-header] [--plain]

DIR holds the SQLite file (``calls.db``), ``effects.log`` (one line per time a
tool's body ran: the effect the tests count), ``entered-TAG`` (the pid of a
process inside ``hold(tag)``; the tool waits there until ``release-TAG``
exists) and, over HTTP, ``port`` (where the server listens on 127.0.0.1).
``--plain`` serves the same tools without the middleware, so the tests can be
seen to fail without it; ``--skew`` moves asiento's clock (the TTL test);
``--only`` deduplicates only the tools named; ``--scope-header`` scopes keys by
the HTTP header ``x-tenant``.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path
from typing import Any

import anyio
import uvicorn
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from asiento import _clock
from asiento.mcp.server import IdempotencyKeys

_HOLD_LIMIT = 60.0  # seconds a held call waits for its release at most


def build(folder: Path, options: argparse.Namespace) -> MCPServer:
    """The tools: ``pay`` (structured), ``hold`` (waits to be released), ``refuse`` (fails)."""
    scope = _tenant if options.scope_header else None
    keys = IdempotencyKeys(folder / "calls.db", ttl=options.ttl, tools=options.only, scope=scope)
    plain = options.plain
    middleware = [] if plain else [keys]
    server = MCPServer("dedup-test", middleware=middleware)
    effects = folder / "effects.log"

    @server.tool()
    def pay(invoice: str, amount: int) -> dict[str, Any]:
        """Pay an invoice (appends one line to effects.log)."""
        _effect(effects, f"pay {invoice} {amount}")
        return {"invoice": invoice, "amount": amount, "receipt": f"r-{time.monotonic_ns()}"}

    @server.tool()
    async def hold(tag: str) -> str:
        """Enter, then wait for release-TAG before doing the effect."""
        _effect(effects, f"hold-entered {tag}")
        (folder / f"entered-{tag}").write_text(str(os.getpid()))
        with anyio.fail_after(_HOLD_LIMIT):
            while not (folder / f"release-{tag}").exists():
                await anyio.sleep(0.02)
        _effect(effects, f"hold-done {tag}")
        return f"held {tag}"

    @server.tool()
    def refuse(reason: str) -> str:
        """Always fails: a tool error is an outcome too."""
        _effect(effects, f"refuse {reason}")
        raise ToolError(f"refused: {reason} ({time.monotonic_ns()})")

    return server


def _tenant(ctx: ServerRequestContext[Any, Any]) -> str:
    """The caller's tenant, from the header ``x-tenant`` (a real server: its auth's client id)."""
    headers = getattr(ctx.request, "headers", None) or {}
    return str(headers.get("x-tenant", ""))


def _effect(effects: Path, line: str) -> None:
    with effects.open("a") as log:
        log.write(line + "\n")
        log.flush()
        os.fsync(log.fileno())


async def _serve_http(server: MCPServer, folder: Path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # connections wait in the backlog until uvicorn serves them
    port = listener.getsockname()[1]
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning")
    http = uvicorn.Server(config)
    (folder / "port.tmp").write_text(str(port))
    os.replace(folder / "port.tmp", folder / "port")
    await http.serve(sockets=[listener])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("transport", choices=["stdio", "http"])
    parser.add_argument("--ttl", type=float, default=3600.0)
    parser.add_argument("--skew", type=float, default=0.0)
    parser.add_argument("--only", action="append")
    parser.add_argument("--scope-header", action="store_true")
    parser.add_argument("--plain", action="store_true")
    options = parser.parse_args()
    _clock.skew = options.skew
    server = build(options.folder, options)
    if options.transport == "stdio":
        anyio.run(server.run_stdio_async)
    else:
        anyio.run(_serve_http, server, options.folder)


if __name__ == "__main__":
    main()
