"""An MCP tool call of a traced run and of an untraced one, in a process with no global
tracer provider (so the MCP SDK's own spans are no-ops): what the server got in ``_meta``.

    python mcp_child.py TMP

Prints one JSON line: ``{"traced": meta, "untraced": meta, "execute_tool": [trace, span]}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from asiento import Agent, ModelResponse, Session, SqliteCheckpointer, Telemetry, ToolCall
from asiento.mcp import McpServer
from asiento.testing import ScriptedGateway

SERVER = Path(__file__).parent.parent / "mcp_tools" / "server.py"


async def main(tmp: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metas = tmp / "metas"
    env = {
        "MCP_LEDGER": str(tmp / "ledger"),
        "MCP_GATE": str(tmp / "gate"),
        "MCP_DEDUP": str(tmp / "dedup.db"),
        "MCP_META": str(metas),
    }
    call = ToolCall(name="lookup", arguments={"city": "Lima"})
    telemetry: Any
    for name, telemetry in (("traced", Telemetry(tracer_provider=provider)), ("untraced", False)):
        async with McpServer("notes", command=[sys.executable, str(SERVER), "stdio"], env=env) as s:
            agent = Agent(tools=await s.tools(), telemetry=telemetry)
            gateway = ScriptedGateway([ModelResponse(tool_calls=[call]), ModelResponse(text="ok")])
            store = SqliteCheckpointer(tmp / f"{name}.db")
            try:
                async for _ in agent.run("weather", session=Session("run-1", gateway, store)):
                    pass
            finally:
                await store.close()
    traced, untraced = (json.loads(line) for line in metas.read_text().splitlines())
    (executed,) = [s for s in exporter.get_finished_spans() if s.name == "execute_tool lookup"]
    context = executed.get_span_context()
    assert context is not None
    ids = [f"{context.trace_id:032x}", f"{context.span_id:016x}"]
    print(json.dumps({"traced": traced, "untraced": untraced, "execute_tool": ids}))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
