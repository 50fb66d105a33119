"""An MCP server on the SDK's low-level ``Server``, deduplicated by IdempotencyKeys.

    python lowlevel_server.py DIR

Over stdio. ``count`` appends a line to DIR/effects.log and answers how many
lines there are; ``crash`` appends one and raises (a handler's exception, which
the low-level server sends as a protocol error). Used by test_lowlevel_dedup.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.server.stdio import stdio_server

from asiento.mcp.server import IdempotencyKeys

_TOOLS = [
    types.Tool(name=name, input_schema={"type": "object", "properties": {}})
    for name in ("count", "crash")
]


def build(folder: Path) -> Server[Any]:
    effects = folder / "effects.log"

    async def list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=_TOOLS)

    async def call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        with effects.open("a") as log:
            log.write(params.name + "\n")
        if params.name == "crash":
            raise RuntimeError("the handler broke after its effect")
        lines = len(effects.read_text().splitlines())
        return types.CallToolResult(content=[types.TextContent(type="text", text=str(lines))])

    server: Server[Any] = Server("lowlevel", on_list_tools=list_tools, on_call_tool=call_tool)
    server.middleware.append(IdempotencyKeys(folder / "calls.db", ttl=3600))
    return server


async def main(folder: Path) -> None:
    server = build(folder)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]))
