"""One pass over a run whose tool is an MCP server's, in its own process: what the tests kill.

    python child.py --db runs.db --run run-1 --tool NAME --args JSON
        (--stdio | --url URL) [--trusted] [--keys --ttl S] [--destructive-policy]

The model (scripted) calls ``--tool`` once with ``--args``, then answers "done". The
pass prints one JSON line, how it ended: closed, uncertain, suspended, diverged,
unavailable, lost or shutdown (the exit status says it too). SIGTERM asks for a
graceful stop (``asiento.shutdown``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from asiento import (
    Agent,
    ApprovalStep,
    FinalStep,
    McpCallLost,
    McpServerUnavailable,
    ModelResponse,
    ReplayDivergence,
    Session,
    ShutdownRequested,
    ToolCall,
    UncertainEffect,
    open_store,
    require_approval_for_destructive,
    shutdown,
)
from asiento.mcp import McpServer
from asiento.testing import ScriptedGateway

SERVER = Path(__file__).with_name("server.py")
EXIT = {"closed": 0, "suspended": 0, "uncertain": 3, "lost": 4, "unavailable": 5}


def mcp_server(args: argparse.Namespace) -> McpServer:
    where: dict[str, Any] = (
        {"url": args.url} if args.url else {"command": [sys.executable, str(SERVER), "stdio"]}
    )
    env = {k: v for k, v in os.environ.items() if k.startswith("MCP_") or k == "PYTHONPATH"}
    return McpServer(
        "notes",
        **where,
        env=env,
        trusted=args.trusted,
        honours_keys=args.keys,
        key_ttl=args.ttl,
        key_margin=0.0 if args.keys else None,
        in_progress_wait=args.wait,
    )


async def one_pass(args: argparse.Namespace) -> dict[str, Any]:
    call = ToolCall(name=args.tool, arguments=json.loads(args.args))
    gateway = ScriptedGateway([ModelResponse(tool_calls=[call]), ModelResponse(text="done")])
    store = await open_store(args.db)
    try:
        async with mcp_server(args) as server:
            tools = await server.tools()
            policy = require_approval_for_destructive(tools) if args.destructive_policy else None
            agent = Agent(instructions="Use the notes server.", tools=tools, policy=policy)
            return await _drive(agent, Session(args.run, gateway, store))
    except McpServerUnavailable as exc:
        return {"ended": "unavailable", "why": str(exc)}
    finally:
        await store.close()


async def _drive(agent: Agent, session: Session) -> dict[str, Any]:
    ended: dict[str, Any] = {"ended": "not closed"}
    try:
        async for step in agent.run("take notes", session=session):
            if isinstance(step, FinalStep):
                ended = {"ended": "closed", "replayed": step.replayed}
            elif isinstance(step, ApprovalStep):
                ended = {"ended": "suspended", "step_id": step.step_id}
    except UncertainEffect as exc:
        ended = {"ended": "uncertain", "step_id": exc.step_id, "why": str(exc)}
    except ReplayDivergence as exc:
        ended = {"ended": "diverged", "why": str(exc)}
    except McpCallLost as exc:
        ended = {"ended": "lost", "why": str(exc)}
    except McpServerUnavailable as exc:
        ended = {"ended": "unavailable", "why": str(exc)}
    except ShutdownRequested:
        ended = {"ended": "shutdown"}
    return ended


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--tool", required=True)
    parser.add_argument("--args", default="{}")
    parser.add_argument("--url")
    parser.add_argument("--stdio", action="store_true")
    parser.add_argument("--trusted", action="store_true")
    parser.add_argument("--keys", action="store_true")
    parser.add_argument("--ttl", type=float, default=None)
    parser.add_argument("--wait", type=float, default=30.0)
    parser.add_argument("--destructive-policy", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    shutdown.install()
    ended = asyncio.run(one_pass(parse(argv)))
    print(json.dumps(ended), flush=True)
    return EXIT.get(ended["ended"], 6)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
