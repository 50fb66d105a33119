"""One pass of the quick-start graph through ``ChatOpenAI`` against a fake provider,
in its own process (armed by ``ASIENTO_CRASH_AT`` to die with SIGKILL at a crash point).

    python langgraph_child.py DB LEDGER BASE_URL RUN_ID

Prints one JSON line: how the pass ended and the final messages.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from langchain_openai import ChatOpenAI

from asiento import SqliteCheckpointer, UncertainEffect
from asiento.integrations.langgraph import durable_run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from langgraph_graph import TASK, build, make_tools


def model(base_url: str) -> ChatOpenAI:
    return ChatOpenAI(model="gpt-test", base_url=base_url, api_key="sk-test", max_retries=0)


async def durable(db: str, ledger: str, base_url: str, run_id: str) -> dict[str, object]:
    graph = build(model(base_url), make_tools(Path(ledger)))
    store = SqliteCheckpointer(db)
    try:
        result = await durable_run(
            graph, {"messages": [("user", TASK)]}, run_id=run_id, store=store, idempotent=["lookup"]
        )
    except UncertainEffect as exc:
        return {"ended": "uncertain", "step": exc.step_id}
    finally:
        await store.close()
    return {"ended": "closed", "messages": [str(m.content) for m in result.output["messages"]]}


if __name__ == "__main__":
    db, ledger, base_url, run_id = sys.argv[1:5]
    print(json.dumps(asyncio.run(durable(db, ledger, base_url, run_id))), flush=True)
