"""A Pydantic AI agent, unchanged, killed with SIGKILL after its refund and resumed twice.

    python examples/integrations/pydantic_ai_refund.py

The agent is a plain ``pydantic_ai.Agent`` on ``OpenAIChatModel`` (the official
``openai`` client) talking to a scripted Chat Completions server on 127.0.0.1 that
counts the generations it bills and the ``Idempotency-Key`` each came with. Each pass
runs in its own process through ``asiento.integrations.pydantic_ai.durable_run``; the
first is killed right after the refund's result is recorded.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

RUN = "refund-A1"


def _answer(turn: int, n: int) -> dict[str, Any]:
    """Turn 0 asks for the refund, turn 1 answers in words."""
    if turn == 0:
        arguments = json.dumps({"order": "A1"})
        call = {"id": "call_1", "type": "function",
                "function": {"name": "refund", "arguments": arguments}}  # fmt: skip
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        finish = "tool_calls"
    else:
        message, finish = {"role": "assistant", "content": "Refunded order A1."}, "stop"
    return {
        "id": f"req_{n}", "object": "chat.completion", "created": 0, "model": "gpt-test",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60},
    }  # fmt: skip


class _Provider(BaseHTTPRequestHandler):
    billed: list[str | None] = []  # noqa: RUF012 - one server per process

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        self.billed.append(self.headers.get("idempotency-key"))
        out = json.dumps(_answer(turn, len(self.billed))).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: Any) -> None:
        pass


async def _pass(db: str, base_url: str, effects: str) -> dict[str, Any]:
    """One pass in this process: the agent as its author wrote it, run durably."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from asiento import SqliteCheckpointer
    from asiento.integrations.pydantic_ai import durable_run

    model = OpenAIChatModel("gpt-test", provider=OpenAIProvider(base_url=base_url, api_key="sk"))
    agent = Agent(model, instructions="Refund what you are asked to.")

    @agent.tool_plain
    def refund(order: str) -> str:
        """Refund an order (the effect: one line in a file)."""
        with Path(effects).open("a") as f:
            f.write(order + "\n")
        return f"refunded {order}"

    store = SqliteCheckpointer(db)
    try:
        result = await durable_run(agent, "Refund order A1", run_id=RUN, store=store)
    finally:
        await store.close()
    return {"ended": "already closed" if result.replayed else "closed", "output": result.output}


def main() -> None:
    if sys.argv[1:2] == ["pass"]:
        print(json.dumps(asyncio.run(_pass(*sys.argv[2:5]))))
        return
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Provider)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    with tempfile.TemporaryDirectory() as tmp:
        db, effects = str(Path(tmp) / "runs.db"), Path(tmp) / "effects.log"
        print(f"{'pass':<6}{'model calls':>12}{'refunds':>9}  ended")
        for number, crash in ((1, "after_result"), (2, None), (3, None)):
            env = {k: v for k, v in os.environ.items() if k != "ASIENTO_CRASH_AT"}
            if crash:
                env["ASIENTO_CRASH_AT"] = crash
            billed, refunds = len(_Provider.billed), _lines(effects)
            argv = [sys.executable, __file__, "pass", db, url, str(effects)]
            proc = subprocess.run(
                argv, env=env, capture_output=True, text=True, timeout=120, check=False
            )
            if proc.returncode == -9:
                ended = "killed by SIGKILL"
            elif proc.returncode == 0:
                ended = json.loads(proc.stdout.strip().splitlines()[-1])["ended"]
            else:
                sys.exit(proc.stderr)
            model_calls = len(_Provider.billed) - billed
            print(f"{number:<6}{model_calls:>12}{_lines(effects) - refunds:>9}  {ended}")
        keys = ", ".join(k or "-" for k in _Provider.billed)
        print(f"generations billed: {len(_Provider.billed)}, under keys: {keys}")
        print(f"refunds made: {_lines(effects)}")
    server.shutdown()


def _lines(path: Path) -> int:
    return len(path.read_text().split()) if path.exists() else 0


if __name__ == "__main__":
    main()
