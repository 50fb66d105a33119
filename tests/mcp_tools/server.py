"""The MCP server the tests start, written with the mcp SDK (``MCPServer``).

    python server.py stdio
    python server.py http PORT

Every tool that applies something appends one line to the ledger (``MCP_LEDGER``,
fsynced): ``tool key arguments``; the tests count what really happened there. With
``MCP_HOLD=tool`` that tool, once it applied, waits for the gate file (``MCP_GATE``)
to exist, so a test can kill someone while the call is in flight. ``transfer``
deduplicates by the asiento key in the call's ``_meta`` with
``asiento.mcp.server.IdempotencyKeys`` (SQLite at ``MCP_DEDUP``): a repeated key gets
the first result, ``in-progress`` while the first call still runs, ``unknown`` when it
never finished. With ``MCP_SEEN`` set, every ``tools/call`` the server answers
appends ``tool key outcome`` to that file (``-``: no ``asiento/outcome``); with
``MCP_META`` set, the call's whole ``_meta`` as one JSON line.
``MCP_VARIANT=drift`` serves ``lookup`` with one more parameter. ``MCP_MALFORMED=tool``
answers that tool's calls, once applied, with a result that is not valid MCP.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

from asiento.mcp.server import IdempotencyKeys

KEY = "asiento/idempotency-key"
HOLD_SECONDS = 60.0

# ``transfer`` is deduplicated by asiento's own server helper, the other end of the key.
keys = IdempotencyKeys(os.environ["MCP_DEDUP"], ttl=3600, tools={"transfer"})


async def _seen(ctx: Any, call_next: Any) -> Any:
    """Outside ``keys``: note each call once it is answered, and the answer's outcome."""
    result = await call_next(ctx)
    metas = os.environ.get("MCP_META")
    if metas and ctx.method == "tools/call":
        with open(metas, "a") as f:
            f.write(json.dumps((ctx.params or {}).get("_meta") or {}) + "\n")
    seen = os.environ.get("MCP_SEEN")
    if seen and ctx.method == "tools/call":
        params = ctx.params or {}
        key = (params.get("_meta") or {}).get(KEY, "-")
        wire = result if isinstance(result, dict) else result.model_dump(by_alias=True)
        outcome = (wire.get("_meta") or {}).get("asiento/outcome", "-")
        with open(seen, "a") as f:
            f.write(f"{params.get('name')} {key} {outcome}\n")
    return result


# What a hostile server answers to a ``tools/call`` of ``MCP_MALFORMED`` once it applied it:
# a result no MCP client can read (``content`` must be a list of content blocks).
MALFORMED = {"content": [{"type": "text"}], "isError": "perhaps"}


async def _malformed(ctx: Any, call_next: Any) -> Any:
    result = await call_next(ctx)
    target = os.environ.get("MCP_MALFORMED")
    if target and ctx.method == "tools/call" and (ctx.params or {}).get("name") == target:
        return MALFORMED
    return result


app = MCPServer("notes", middleware=[_malformed, _seen, keys])


def _key(ctx: Context) -> str:
    """The call's asiento key, and after it a test's own ``_meta["test/tag"]`` if sent."""
    meta = ctx.request_context.meta or {}
    tag = meta.get("test/tag")
    return str(meta.get(KEY, "-")) + ("" if tag is None else f" tag={tag}")


def _apply(tool: str, key: str, args: dict[str, Any]) -> None:
    with open(os.environ["MCP_LEDGER"], "a") as f:
        f.write(f"{tool} {key} {json.dumps(args, sort_keys=True)}\n")
        f.flush()
        os.fsync(f.fileno())


async def _hold(tool: str) -> None:
    """Wait for the gate, bounded, if this tool is the one held."""
    if os.environ.get("MCP_HOLD") != tool:
        return
    gate = os.environ["MCP_GATE"]
    for _ in range(int(HOLD_SECONDS / 0.02)):
        if os.path.exists(gate):
            return
        await asyncio.sleep(0.02)


async def _applied(tool: str, ctx: Context, args: dict[str, Any]) -> None:
    _apply(tool, _key(ctx), args)
    await _hold(tool)


if os.environ.get("MCP_VARIANT") == "drift":

    @app.tool(annotations=ToolAnnotations(read_only_hint=True))
    async def lookup(city: str, units: str, ctx: Context) -> str:
        """The weather in a city."""
        await _applied("lookup", ctx, {"city": city, "units": units})
        return f"sunny in {city}"

else:

    @app.tool(annotations=ToolAnnotations(read_only_hint=True))
    async def lookup(city: str, ctx: Context) -> str:
        """The weather in a city."""
        await _applied("lookup", ctx, {"city": city})
        return f"sunny in {city}"


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
def whoami() -> int:
    """This server's process id (a test kills it by that)."""
    return os.getpid()


@app.tool()
async def send_note(text: str, ctx: Context) -> str:
    """Send a note (no annotations: the spec's defaults)."""
    await _applied("send_note", ctx, {"text": text})
    return f"sent: {text}"


@app.tool(annotations=ToolAnnotations(destructive_hint=True, read_only_hint=False))
async def delete_note(note_id: str, ctx: Context) -> str:
    """Delete a note for good."""
    await _applied("delete_note", ctx, {"note_id": note_id})
    return f"deleted {note_id}"


@app.tool(
    annotations=ToolAnnotations(idempotent_hint=False, destructive_hint=False),
    structured_output=False,
)
async def transfer(amount: int, ctx: Context) -> str:
    """Move money; deduplicated by the asiento key in _meta (``IdempotencyKeys``)."""
    # The work goes on when the client goes away (as a payment does): the middleware
    # records its result for whoever asks again with the key.
    with anyio.CancelScope(shield=True):
        await _applied("transfer", ctx, {"amount": amount})
    return f"moved {amount}"


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        app.run()
    else:
        import uvicorn

        uvicorn.run(
            app.streamable_http_app(),
            host="127.0.0.1",
            port=int(sys.argv[2]),
            log_level="warning",
        )
