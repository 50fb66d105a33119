"""Child processes of the fleet tests: workers, single sessions and racers on one store.

    python worker_child.py worker URL DIR [--ttl S] [--max-attempts N] [--delay S] [--seconds S]
                                         [--concurrency N] [--model-delay S]
                                         [--tool-timeout S] [--grace S]
    python worker_child.py session URL DIR RUN_ID [--ttl S] [--wait S]
    python worker_child.py race URL DIR

URL is what ``open_store`` takes (a SQLite path or a ``postgresql://`` URL). The
app's agents are named by their instructions, and the scripted model answers
each from the task (which the tests make unique per run):

- ``send``: one non-idempotent ``send(to=task)``, then "done".
- ``approve``: ``pay(to=task)``, which needs a person's approval, then "done".
- ``crash``: an idempotent ``explode()`` that SIGKILLs its own process.
- ``hog``: an idempotent ``hog()`` that allocates memory until the kernel kills its
  process (run the worker in a memory cgroup), bounded at 8 GiB.
- ``gated``: ``gated_send(to=task)`` writes DIR/started.TASK, waits for DIR/go, then sends.
- ``hold``: ``wait_go(to=task)`` (idempotent: DIR/started.TASK, waits for DIR/go), then ``send``.
- ``race``: ``note()`` (idempotent), then ``send_held(to=task)``, which sends and then
  waits for DIR/release.TASK before it returns.
- ``long``: ``long_send(to=task)``, a sync tool that sleeps ``--delay`` s, then sends.
- ``busy``: ``spin`` (an async tool that holds the loop with CPU work for ``--delay`` / 200 s),
  then ``long_send``.
- ``gates``: three idempotent ``gate`` steps; gate N writes DIR/started.TASK.N and waits
  for DIR/go.TASK.N.
- ``stuck``: ``stuck_lookup(to=task)``, an idempotent sync tool that writes
  DIR/started.TASK and waits for DIR/go (a lookup that hangs), then "done".

Every send appends ``TASK PID`` to DIR/ledger (O_APPEND, fsynced): the effect ledger.
A worker logs what its store did to DIR/log.PID.jsonl, one JSON object a line:
claims (run, token), appends under a lease (run, token, keys) and refused ones
(lease-lost), supervisor restarts, and its exit.

worker: drives runs with ``asiento.Worker`` until SIGTERM (exit 75) or ``--seconds``
(exit 0). Its ``Worker.run`` is restarted when it raises ``JournalError`` (the
server went away): the core has no such loop (see the fleet tests' module doc).
session: exit 0 closed, 76 lease lost, 77 run locked.
race: prints "ready", then for each line "go RUN_ID" on stdin tries to resume that run
and prints "drove RUN_ID PID", "locked RUN_ID" or "replayed RUN_ID".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asiento import (
    Agent,
    App,
    FinalStep,
    JournalError,
    LeaseLost,
    ModelRequest,
    ModelResponse,
    RunLocked,
    Session,
    Tool,
    ToolCall,
    Worker,
    open_store,
    require_approval_for,
    shutdown,
    tool,
)
from asiento.testing import ScriptedGateway

WAIT_LIMIT = 30.0  # seconds a gated tool waits for the test before it gives up
MAX_RESTARTS = 100


def wait_for_file(path: Path, seconds: float = WAIT_LIMIT) -> None:
    """Block (the tool runs in the loop's thread) until ``path`` exists, bounded."""
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class Ledger:
    """The effect ledger: one fsynced line per effect applied, and the worker's own log."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.log_path = folder / f"log.{os.getpid()}.jsonl"

    def apply(self, to: str) -> None:
        fd = os.open(self.folder / "ledger", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{to} {os.getpid()}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def log(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ev": event, "pid": os.getpid(), "t": time.monotonic(), **fields})
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def tools(ledger: Ledger, delay: float) -> dict[str, Tool]:
    folder = ledger.folder

    @tool
    async def send(to: str) -> str:
        """Send something that must happen once."""
        if delay:
            await asyncio.sleep(delay)
        ledger.apply(to)
        return f"sent to {to}"

    @tool
    def pay(to: str) -> str:
        """Pay someone: needs a person's approval first."""
        ledger.apply(to)
        return f"paid {to}"

    @tool(idempotent=True)
    def explode() -> str:
        """Kill this worker, as a segfaulting library or the OOM killer would."""
        os.kill(os.getpid(), signal.SIGKILL)
        return "unreachable"

    @tool(idempotent=True)
    def hog() -> str:
        """Allocate until the kernel's OOM killer ends this worker (bounded: 8 GiB)."""
        held = [bytearray(b"\x01") * (64 << 20) for _ in range(128)]
        return f"unreachable: {len(held)} blocks"

    @tool
    def gated_send(to: str) -> str:
        """Say it started, wait for the test's go, then send once."""
        (folder / f"started.{to}").touch()
        wait_for_file(folder / "go")
        ledger.apply(to)
        return f"sent to {to}"

    @tool(idempotent=True)
    def wait_go(to: str) -> str:
        """Say it started and wait for the test's go (safe to repeat)."""
        (folder / f"started.{to}").write_text(str(os.getpid()))
        wait_for_file(folder / "go")
        return "went"

    @tool(idempotent=True)
    def note(to: str) -> str:
        """A harmless first step, so that racers resume a run with history."""
        return f"noted {to}"

    @tool
    def send_held(to: str) -> str:
        """Send once, then hold the run until the test releases it."""
        ledger.apply(to)
        wait_for_file(folder / f"release.{to}", 20)
        return f"sent to {to}"

    @tool
    def long_send(to: str) -> str:
        """A plain (sync) tool that takes ``--delay`` seconds, then sends once."""
        time.sleep(delay)
        ledger.apply(to)
        return f"sent to {to}"

    @tool(idempotent=True)
    def gate(to: str) -> str:
        """One of several steps: say it started, wait for DIR/go.TO (safe to repeat)."""
        (folder / f"started.{to}").touch()
        wait_for_file(folder / f"go.{to}")
        return f"passed {to}"

    @tool(idempotent=True)
    async def spin(to: str) -> str:
        """Hold the event loop with CPU work for ``--delay`` / 200 s (a busy loop)."""
        end = time.monotonic() + delay / 400
        while time.monotonic() < end:
            pass
        return f"spun {to}"

    @tool(idempotent=True)
    def stuck_lookup(to: str) -> str:
        """A read that hangs until DIR/go (safe to repeat); DIR/returned.TO once it returns."""
        (folder / f"started.{to}").touch()
        wait_for_file(folder / "go")
        (folder / f"returned.{to}").touch()
        return f"looked {to} up"

    every = [
        *(send, pay, explode, hog, gated_send, wait_go, note, send_held, long_send, gate, spin),
        stuck_lookup,
    ]
    return {t.name: t for t in every}


# Per agent: the tools the model asks for, one per turn, each with the task as "to".
SCRIPTS: dict[str, list[str]] = {
    "send": ["send"],
    "approve": ["pay"],
    "crash": ["explode"],
    "hog": ["hog"],
    "gated": ["gated_send"],
    "hold": ["wait_go", "send"],
    "race": ["note", "send_held"],
    "long": ["long_send"],
    "gates": ["gate", "gate", "gate"],
    "busy": ["spin", "long_send"],
    "stuck": ["stuck_lookup"],
}
NO_ARGS = {"explode", "hog"}
POISON = {"crash", "hog"}  # agents whose model answers at once, whatever --model-delay says


def answer(request: ModelRequest) -> ModelResponse:
    """The scripted model: the agent is named by its instructions, the turn by the request."""
    script = SCRIPTS[request.instructions]
    turn = sum(1 for m in request.messages if m.role == "assistant")
    if turn >= len(script):
        return ModelResponse(text="done")
    name = script[turn]
    task = str(request.messages[0].content)
    arguments = {} if name in NO_ARGS else {"to": task}
    if name == "gate":  # each gate of the run has its own files: TASK.1, TASK.2...
        arguments = {"to": f"{task}.{turn + 1}"}
    return ModelResponse(tool_calls=[ToolCall(name=name, arguments=arguments)])


def agents(ledger: Ledger, delay: float = 0.0) -> dict[str, Agent]:
    """Every agent of the app, by name."""
    available = tools(ledger, delay)
    made = {}
    for name, script in SCRIPTS.items():
        policy = require_approval_for("pay") if name == "approve" else None
        used = [available[t] for t in dict.fromkeys(script)]
        made[name] = Agent(instructions=name, tools=used, policy=policy, max_turns=5)
    return made


class SlowModel(ScriptedGateway):
    """The scripted model, taking ``delay`` seconds an answer (but for the poison agents)."""

    def __init__(self, delay: float) -> None:
        super().__init__(answer)
        self.delay = delay

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        if request.instructions not in POISON:
            await asyncio.sleep(self.delay)
        return await super().complete(request, idempotency_key=idempotency_key)


class Observed:
    """The worker's store, seen through its log: claims and leased appends, nothing changed."""

    def __init__(self, store: Any, ledger: Ledger) -> None:
        self._store, self._ledger = store, ledger

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def claim(self, holder: Any, **limits: Any) -> Any:
        claim = await self._store.claim(holder, **limits)
        if claim is not None:
            lease = claim.lease
            self._ledger.log("claim", run=lease.run_id, token=lease.token, n=claim.attempts)
        return claim

    async def claim_many(self, holder: Any, *, limit: int, **limits: Any) -> list[Any]:
        claims = await self._store.claim_many(holder, limit=limit, **limits)
        for claim in claims:
            lease = claim.lease
            self._ledger.log("claim", run=lease.run_id, token=lease.token, n=claim.attempts)
        self._ledger.log("claim-many", limit=limit, got=len(claims))
        return claims

    async def renew(self, lease: Any, *, ttl: float) -> Any:
        renewed = await self._store.renew(lease, ttl=ttl)
        self._ledger.log("renew", run=lease.run_id, token=lease.token)
        return renewed

    async def append(self, *events: Any, lease: Any = None, **closing: Any) -> None:
        keys = [[e.step_id, str(e.phase)] for e in events]
        try:
            await self._store.append(*events, lease=lease, **closing)
        except LeaseLost:
            self._ledger.log("lease-lost", run=lease.run_id, token=lease.token, keys=keys)
            raise
        if lease is not None:
            self._ledger.log("append", run=lease.run_id, token=lease.token, keys=keys)


async def work(args: argparse.Namespace) -> int:
    """One worker process: claim and drive until told to stop; survive a server outage."""
    ledger = Ledger(Path(args.dir))
    store = Observed(await open_store(args.url), ledger)
    app = App(
        agents=agents(ledger, args.delay),
        gateway=lambda: SlowModel(args.model_delay),
        lease_ttl=args.ttl,
        max_attempts=args.max_attempts,
        tool_timeout=args.tool_timeout,
        shutdown_grace=args.grace,
    )
    worker = Worker(store, app, poll=args.poll, concurrency=args.concurrency)
    ledger.log("ready")
    code = await supervise(worker, ledger, args.seconds)
    stats = worker.stats
    ledger.log("exit", code=code, claimed=stats.claimed, closed=stats.closed)
    await store.close()
    return code


async def supervise(worker: Worker, ledger: Ledger, seconds: float) -> int:
    """``Worker.run`` again after a ``JournalError``, a bounded number of times."""
    deadline = time.monotonic() + seconds
    for _ in range(MAX_RESTARTS):
        try:
            await worker.run(max_seconds=max(0.0, deadline - time.monotonic()))
        except shutdown.ShutdownRequested:
            return shutdown.EXIT_CODE
        except JournalError as exc:
            ledger.log("restart", error=f"{type(exc).__name__}: {exc}"[:300])
            await asyncio.sleep(0.2)
            continue
        return shutdown.EXIT_CODE if shutdown.requested() else 0
    return 70


async def drive_one(args: argparse.Namespace) -> int:
    """One Session on one run (agent ``hold``): 0 closed, 76 lease lost, 77 run locked."""
    ledger = Ledger(Path(args.dir))
    store = await open_store(args.url)
    session = Session(
        args.run_id, ScriptedGateway(answer), store, lease_ttl=args.ttl, wait=args.wait
    )
    try:
        async for _ in agents(ledger)["hold"].run(args.run_id, session=session):
            pass
    except LeaseLost:
        return 76
    except RunLocked:
        return 77
    finally:
        await store.close()
    return 0


async def race(args: argparse.Namespace) -> int:
    """Resume the run each "go RUN_ID" line names, at once with the other racers."""
    ledger = Ledger(Path(args.dir))
    store = await open_store(args.url)
    agent = agents(ledger)["race"]
    print("ready", flush=True)
    while line := await asyncio.to_thread(sys.stdin.readline):
        command, run_id = line.split()
        if command != "go":
            break
        print(await race_once(agent, store, run_id), flush=True)
    await store.close()
    return 0


async def race_once(agent: Agent, store: Any, run_id: str) -> str:
    session = Session(run_id, ScriptedGateway(answer), store, lease_ttl=30)
    try:
        steps = [step async for step in agent.run(run_id, session=session)]
    except RunLocked:
        return f"locked {run_id}"
    last = steps[-1]
    if isinstance(last, FinalStep) and last.replayed:
        return f"replayed {run_id}"
    return f"drove {run_id} {os.getpid()}"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    jobs = parser.add_subparsers(dest="job", required=True)
    worker, session, racer = (jobs.add_parser(name) for name in ("worker", "session", "race"))
    for sub in (worker, session, racer):
        sub.add_argument("url")
        sub.add_argument("dir")
    worker.add_argument("--ttl", type=float, default=2.0)
    worker.add_argument("--max-attempts", type=int, default=5)
    worker.add_argument("--poll", type=float, default=0.05)
    worker.add_argument("--delay", type=float, default=0.0)
    worker.add_argument("--seconds", type=float, default=120.0)
    worker.add_argument("--concurrency", type=int, default=1)
    worker.add_argument("--model-delay", type=float, default=0.0)
    worker.add_argument("--tool-timeout", type=float, default=None)
    worker.add_argument("--grace", type=float, default=30.0)
    session.add_argument("run_id")
    session.add_argument("--ttl", type=float, default=30.0)
    session.add_argument("--wait", type=float, default=0.0)
    return parser.parse_args(argv)


JOBS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "worker": work,
    "session": drive_one,
    "race": race,
}

if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    if arguments.job == "worker":
        shutdown.install()  # SIGTERM: finish the step in flight, then exit 75
    sys.exit(asyncio.run(JOBS[arguments.job](arguments)))
