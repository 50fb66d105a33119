"""A child process that drives one run, for lease and shutdown tests.

    python child.py DB RUN_ID DIR [--ttl SECONDS] [--wait SECONDS] [--shutdown]

Script: m1 asks for `slow` (idempotent: writes DIR/slow.started, then waits for
DIR/slow.go, at most 20 s), m2 asks for `send` (non-idempotent: appends a line
to DIR/send.ledger, fsynced), m3 answers. Exit codes: 0 closed, 75 stopped by a
shutdown request, 76 lease lost, 77 run locked.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from asiento import (
    Agent,
    LeaseLost,
    ModelResponse,
    RunLocked,
    Session,
    SqliteCheckpointer,
    ToolCall,
    shutdown,
    tool,
)
from asiento.testing import ScriptedGateway

SCRIPT = [
    ModelResponse(tool_calls=[ToolCall(name="slow", arguments={})]),
    ModelResponse(tool_calls=[ToolCall(name="send", arguments={"to": "ana"})]),
    ModelResponse(text="done"),
]


def build(folder: Path) -> Agent:
    @tool(idempotent=True)
    def slow() -> str:
        """Wait until the test lets go."""
        (folder / "slow.started").write_text(str(os.getpid()))
        deadline = time.monotonic() + 20
        while not (folder / "slow.go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return "slow done"

    @tool()
    def send(to: str) -> str:
        """Send something that must happen once."""
        with open(folder / "send.ledger", "a") as ledger:
            ledger.write(f"{os.getpid()} {to}\n")
            ledger.flush()
            os.fsync(ledger.fileno())
        return "sent"

    return Agent(instructions="lease test", tools=[slow, send])


async def main(args: argparse.Namespace) -> int:
    store = SqliteCheckpointer(args.db)
    session = Session(
        args.run_id, ScriptedGateway(SCRIPT), store, lease_ttl=args.ttl, wait=args.wait
    )
    try:
        async for _ in build(Path(args.dir)).run("task", session=session):
            pass
    except shutdown.ShutdownRequested:
        return shutdown.EXIT_CODE
    except LeaseLost:
        return 76
    except RunLocked:
        return 77
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("run_id")
    parser.add_argument("dir")
    parser.add_argument("--ttl", type=float, default=30.0)
    parser.add_argument("--wait", type=float, default=0.0)
    parser.add_argument("--shutdown", action="store_true")
    arguments = parser.parse_args()
    if arguments.shutdown:
        shutdown.install()
    sys.exit(asyncio.run(main(arguments)))
