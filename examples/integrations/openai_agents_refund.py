"""An OpenAI Agents SDK refund agent, killed with SIGKILL after the refund and resumed twice.

The agent is the SDK's own ``Agent`` with ``OpenAIChatCompletionsModel`` on the
official ``AsyncOpenAI`` client, unchanged; ``durable_run`` runs it with
``Runner.run`` on asiento's journal. Each pass is its own process, against a
scripted Chat Completions server on 127.0.0.1 (started here, no network):

1. the child refunds order 42, then kills itself with SIGKILL once the refund's
   result is durable (``ASIENTO_CRASH_AT=after_result``);
2. a new child resumes: the recorded answer m1 is replayed, the refund is not run
   again, only m2 is asked;
3. a new child resumes the closed run: nothing is asked, nothing runs.

    python examples/integrations/openai_agents_refund.py
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
from typing import Any, ClassVar

os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"  # the SDK exports traces by default

RUN = "refund-42"


# -- the agent, as a team would write it --------------------------------------------------


def build_agent(base_url: str, refunds: Path) -> Any:
    import openai
    from agents import Agent, OpenAIChatCompletionsModel, function_tool

    @function_tool
    def refund(order: int, amount: float) -> str:
        """Refund an order.

        Args:
            order: the order number.
            amount: how much to give back.
        """
        with refunds.open("a") as out:  # the effect: one line per refund made
            out.write(f"{order} {amount}\n")
        return f"refunded {amount} on order {order}"

    client = openai.AsyncOpenAI(api_key="sk-local", base_url=base_url, max_retries=0)
    model = OpenAIChatCompletionsModel(model="gpt-local", openai_client=client)
    return Agent(name="refunds", instructions="You refund orders.", model=model, tools=[refund])


async def one_pass(db: str, base_url: str, refunds: str) -> dict[str, Any]:
    from agents import set_tracing_disabled

    from asiento import SqliteCheckpointer
    from asiento.integrations.openai_agents import durable_run

    set_tracing_disabled(True)
    store = SqliteCheckpointer(db)
    try:
        result = await durable_run(
            build_agent(base_url, Path(refunds)), "refund order 42", run_id=RUN, store=store
        )
    finally:
        await store.close()
    return {"output": result.final_output, "replayed": result.replayed}


# -- a scripted Chat Completions server on 127.0.0.1 --------------------------------------


class _Provider(BaseHTTPRequestHandler):
    generations: ClassVar[list[str]] = []  # the Idempotency-Key of each answer generated

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.generations.append(self.headers.get("Idempotency-Key", ""))
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        message: dict[str, Any] = {"role": "assistant", "content": "order 42 is refunded"}
        if turn == 0:
            call = {"name": "refund", "arguments": json.dumps({"order": 42, "amount": 9.5})}
            tool_call = {"id": "c1", "type": "function", "function": call}
            message = {"role": "assistant", "content": None, "tool_calls": [tool_call]}
        answer = {
            "id": f"chatcmpl-{turn}", "object": "chat.completion", "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if turn == 0 else "stop"}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60},
        }  # fmt: skip
        raw = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Provider)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    with tempfile.TemporaryDirectory() as tmp:
        db, refunds = str(Path(tmp, "runs.db")), Path(tmp, "refunds.txt")
        print(f"{'pass':<6}{'model calls':>12}{'refunds':>9}   ended")
        for number, crash in enumerate(["after_result", None, None], 1):
            asked, made = len(_Provider.generations), _count(refunds)
            env = {k: v for k, v in os.environ.items() if k != "ASIENTO_CRASH_AT"}
            env |= {"ASIENTO_CRASH_AT": crash} if crash else {}
            argv = [sys.executable, __file__, "child", db, url, str(refunds)]
            proc = subprocess.run(
                argv, check=False, env=env, capture_output=True, text=True, timeout=120
            )
            if proc.returncode == 0:
                ended = json.loads(proc.stdout.strip().splitlines()[-1])
                ended_text = "already closed" if ended["replayed"] else f"closed: {ended['output']}"
            elif proc.returncode == -9:
                ended_text = "killed by SIGKILL after the refund"
            else:
                raise SystemExit(proc.stderr)
            calls, made = len(_Provider.generations) - asked, _count(refunds) - made
            print(f"{number:<6}{calls:>12}{made:>9}   {ended_text}")
        print(f"refunds made in all: {_count(refunds)} (the effect happened exactly once)")
    server.shutdown()


def _count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        print(json.dumps(asyncio.run(one_pass(*sys.argv[2:5]))), flush=True)
    else:
        main()
