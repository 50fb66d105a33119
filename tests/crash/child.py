"""The crash-test child: drive one pass of a run (or approve, or resolve) and exit.

    python tests/crash/child.py run DB RUN_ID --effects FILE --models FILE [--approval]
    python tests/crash/child.py approve DB RUN_ID STEP [--fingerprint FP]
    python tests/crash/child.py resolve DB RUN_ID STEP --happened yes|no
    python tests/crash/child.py serve      # fork-server: JSON commands on stdin

Arm a crash point with ``ASIENTO_CRASH_AT=name@N``; in ``serve`` mode a command's
``crash`` field arms it in the forked child, the same way, and ``kill_after``
(seconds) makes the server SIGKILL the forked child after that delay. The
fork-server is asiento.testing's (``_fork``); what runs in it is this file's (see
oracle.py for why).

Two ledgers outlive any SIGKILL because every line is one ``write(2)`` followed
by ``fsync`` before the code goes on: the effects ledger gets one line per real
tool execution, the model ledger one line per model request (one billable call).
The scripted model asks, in turn m1, for ``lookup`` (idempotent) then ``send``
(not idempotent); in m2 for ``send`` then ``lookup``; m3 answers "done". Each
call carries ``ref``, the step id it gets, so the ledger names its step.

Exit codes: 0 closed, suspended, approved or resolved; 3 ``UncertainEffect``
(the step is printed); 1 anything else. The outcome is one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from typing import Any

import asiento
from asiento import (
    Agent,
    ApprovalStep,
    FinalStep,
    ModelRequest,
    ModelResponse,
    Session,
    SqliteCheckpointer,
    ToolCall,
    UncertainEffect,
    require_approval_for,
    tool,
)
from asiento.testing import ENV_VAR, ScriptedGateway, arm, crash_point
from asiento.testing._files import append_line
from asiento.testing._fork import serve

UNCERTAIN_EXIT = 3
TASK = "look up alpha and beta, and send two messages"
INSTRUCTIONS = "You are a crash-test agent."
IDEMPOTENT = {"lookup": True, "send": False}
# The logical tool steps of the script: step id -> (tool, arguments).
TOOL_STEPS: dict[str, tuple[str, dict[str, str]]] = {
    "m1.t1": ("lookup", {"key": "alpha", "ref": "m1.t1"}),
    "m1.t2": ("send", {"to": "x", "ref": "m1.t2"}),
    "m2.t1": ("send", {"to": "y", "ref": "m2.t1"}),
    "m2.t2": ("lookup", {"key": "beta", "ref": "m2.t2"}),
}
MODEL_STEPS = ("m1", "m2", "m3")


def _calls(*steps: str) -> list[ToolCall]:
    return [ToolCall(name=TOOL_STEPS[s][0], arguments=TOOL_STEPS[s][1]) for s in steps]


SCRIPT = (
    ModelResponse(text="", tool_calls=_calls("m1.t1", "m1.t2")),
    ModelResponse(text="", tool_calls=_calls("m2.t1", "m2.t2")),
    ModelResponse(text="done"),
)


def tool_value(step: str) -> str:
    """What the tool of ``step`` returns: a person resolving 'happened' records the same."""
    name, args = TOOL_STEPS[step]
    return f"value-of-{args['key']}" if name == "lookup" else f"sent-to-{args['to']}"


def make_tools(run_id: str, effects: str) -> list[asiento.Tool]:
    """The two tools; each writes its ledger line, then passes ``inside_tool``."""

    def effect(name: str, ref: str) -> None:
        append_line(effects, {"run": run_id, "tool": name, "step": ref, "pid": os.getpid()})
        crash_point("inside_tool")

    @tool(idempotent=True)
    def lookup(key: str, ref: str) -> str:
        """Look a key up; safe to repeat."""
        effect("lookup", ref)
        return f"value-of-{key}"

    @tool
    def send(to: str, ref: str) -> str:
        """Send a message; not safe to repeat."""
        effect("send", ref)
        return f"sent-to-{to}"

    return [lookup, send]


class LedgerGateway:
    """ScriptedGateway that first writes each request's key to the model ledger."""

    def __init__(self, run_id: str, models: str) -> None:
        self.run_id, self.models = run_id, models
        self.inner = ScriptedGateway(SCRIPT)

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        record = {"run": self.run_id, "key": idempotency_key, "pid": os.getpid()}
        append_line(self.models, record)
        return await self.inner.complete(request, idempotency_key=idempotency_key)


async def run_pass(cmd: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One pass of the run: until it closes, suspends or stops uncertain."""
    run_id = cmd["run"]
    policy = require_approval_for("send") if cmd.get("approval") else None
    agent = Agent(
        instructions=INSTRUCTIONS, tools=make_tools(run_id, cmd["effects"]), policy=policy
    )
    store = SqliteCheckpointer(cmd["db"])
    session = Session(run_id, LedgerGateway(run_id, cmd["models"]), store)
    last = None
    try:
        async for step in agent.run(TASK, session=session):
            last = step
    except UncertainEffect as exc:
        return UNCERTAIN_EXIT, {"outcome": "uncertain", "step": exc.step_id, "tool": exc.tool}
    finally:
        await store.close()
    if isinstance(last, FinalStep):
        return 0, {"outcome": "closed", "replayed": last.replayed}
    if isinstance(last, ApprovalStep):
        return 0, {"outcome": "suspended", "step": last.step_id, "fingerprint": last.fingerprint}
    raise RuntimeError(f"the pass ended on {last!r}")


async def approve(cmd: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """What a person's harness does: approve the step, while no loop runs."""
    store = SqliteCheckpointer(cmd["db"])
    try:
        await asiento.approve(
            store, cmd["run"], cmd["step"], by="crash-test", fingerprint=cmd.get("fingerprint")
        )
    finally:
        await store.close()
    return 0, {"outcome": "approved", "step": cmd["step"]}


async def resolve(cmd: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """What a person does after checking the destination: record whether it happened."""
    store = SqliteCheckpointer(cmd["db"])
    step, happened = cmd["step"], bool(cmd["happened"])
    result = tool_value(step.split("/", 1)[0]) if happened else None
    try:
        await asiento.resolve(
            store, cmd["run"], step, happened=happened, by="crash-test", result=result
        )
    finally:
        await store.close()
    return 0, {"outcome": "resolved", "step": step, "happened": happened}


OPS = {"run": run_pass, "approve": approve, "resolve": resolve}


def execute(cmd: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return asyncio.run(OPS[cmd["op"]](cmd))


# -- fork-server -------------------------------------------------------------------


class ForkedChild:
    """What asiento.testing's fork-server serves: each command in a freshly forked process."""

    def warm_up(self) -> None:
        """Drive throwaway runs once, so that forked children find every lazy import done."""
        with tempfile.TemporaryDirectory() as tmp:
            paths = {k: os.path.join(tmp, k) for k in ("db", "effects", "models")}
            execute(paths | {"op": "run", "run": "warm-up"})
            _, out = execute(paths | {"op": "run", "run": "warm-up-2", "approval": True})
            execute(paths | {"op": "approve", "run": "warm-up-2", "step": out["step"]})

    def execute(self, cmd: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Arm the command's crash point as a new interpreter would, by the core's own
        ASIENTO_CRASH_AT (not the harness's observer), then run it."""
        os.environ.pop(ENV_VAR, None)
        if cmd.get("crash"):
            os.environ[ENV_VAR] = cmd["crash"]
        arm(os.environ.get(ENV_VAR))  # what importing asiento does in a new interpreter
        return execute(cmd)


# -- command line ------------------------------------------------------------------


def parse(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="child.py")
    sub = parser.add_subparsers(dest="op", required=True)
    sub.add_parser("serve")
    run = sub.add_parser("run")
    approve = sub.add_parser("approve")
    resolve = sub.add_parser("resolve")
    for p in (run, approve, resolve):
        p.add_argument("db")
        p.add_argument("run")
    run.add_argument("--effects", required=True)
    run.add_argument("--models", required=True)
    run.add_argument("--approval", action="store_true")
    approve.add_argument("step")
    approve.add_argument("--fingerprint")
    resolve.add_argument("step")
    resolve.add_argument("--happened", choices=("yes", "no"), required=True)
    cmd = vars(parser.parse_args(argv))
    if "happened" in cmd:
        cmd["happened"] = cmd["happened"] == "yes"
    return cmd


def main(argv: list[str]) -> int:
    cmd = parse(argv)
    if cmd["op"] == "serve":
        return serve(ForkedChild())
    code, out = execute(cmd)
    print(json.dumps(out), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
