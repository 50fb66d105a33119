"""A child process that pays six times in a row, one slow payment per model turn.

    python driver.py STORE RUN_ID DIR [--submit]

Each payment (``charge``, not idempotent) appends a fsynced JSON line with the
time it started to DIR/charges.jsonl, then takes 0.25 s, as a real payment API
would. Prints how the pass ended as one JSON line: {"ended": "closed" |
"abandoned" | "lease_lost" | "error", "message": ...}. Exit code 0 in every
case but an unexpected error (1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from asiento import (
    Agent,
    LeaseLost,
    ModelResponse,
    RunAbandoned,
    Session,
    ToolCall,
    open_store,
    tool,
)
from asiento.testing import ScriptedGateway

PAYMENTS = 6
SCRIPT = [
    *(ModelResponse(tool_calls=[ToolCall(name="charge", arguments={"n": n})]) for n in range(6)),
    ModelResponse(text="paid six times"),
]


def build(folder: Path) -> Agent:
    @tool()
    async def charge(n: int) -> str:
        """Charge payment number n."""
        line = json.dumps({"n": n, "at": time.time(), "pid": os.getpid()}) + "\n"
        fd = os.open(folder / "charges.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        await asyncio.sleep(0.25)
        return f"charged {n}"

    return Agent(instructions="pay", tools=[charge])


async def main(store_url: str, run_id: str, folder: Path) -> dict[str, str]:
    store = await open_store(store_url)
    session = Session(run_id, ScriptedGateway(SCRIPT), store, lease_ttl=30)
    try:
        async for _ in build(folder).run("pay six times", session=session):
            pass
    except RunAbandoned as exc:
        return {"ended": "abandoned", "message": str(exc)}
    except LeaseLost as exc:
        return {"ended": "lease_lost", "message": str(exc)}
    finally:
        await store.close()
    return {"ended": "closed", "message": ""}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("run_id")
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.store, args.run_id, args.folder))), flush=True)
    sys.exit(0)
