"""LangGraph alone beside LangGraph under asiento, SIGKILLed at random instants; then overhead.

    python bench/langgraph_kills.py [--kills 20] [--reps 9] [--quick] [--dir DIR] [--seed S]

One workload for both sides: LangGraph's quick-start agent (a model node and a
``ToolNode``, ``build`` of tests/integrations/langgraph_graph.py) through ``ChatOpenAI``
against the scripted fake provider of tests/providers/fake_servers.py on 127.0.0.1.
Each run is three model steps and two tool calls: ``lookup`` (read-only) then ``refund``
(an effect: a line appended to an fsynced ledger). Each model answer comes
``--latency`` seconds after its request (the generation is billed on arrival) and each
tool's answer ``--tool-latency`` seconds after its effect, so a kill can land inside a
model call, inside a tool after its effect, or elsewhere (graph, checkpoint or journal
writes, between super-steps).

1. **Random SIGKILLs.** Per side, trials until ``--kills`` kills landed: a fresh run in a
   child process that the parent kills with SIGKILL after a delay drawn uniformly over
   the side's uninterrupted pass (measured first), then passes without a kill until the
   run ends (at most ``MAX_PASSES``). The sides:

   - ``langgraph``: the graph compiled with ``AsyncSqliteSaver``, run with
     ``durability="sync"``, resumed from its last checkpoint (``ainvoke(None, config)``
     when ``aget_state`` has ``next``);
   - ``asiento``: ``durable_run`` on a ``SqliteCheckpointer``, resumed by calling it
     again; a refund left uncertain (``UncertainEffect``) is settled as a person would,
     ``asiento.resolve(..., happened=True)``, and the run counted as needing a person.

   Counted per side, summed over trials: refunds beyond one per run, generations billed
   beyond the three a run needs (and how many of those carried an idempotency key already
   billed, which ``asiento gateway`` answers from the generation it kept), runs that
   needed a person, runs whose final messages (type, text, tool calls without their ids)
   differ from the side's uninterrupted run.
2. **Overhead.** In one process, with a chat model answering at once (scripted, no
   network) and an instant tool: ``STEPS`` model+tool steps then an answer, as the bare
   graph (``graph.ainvoke``, no checkpointer), LangGraph with ``AsyncSqliteSaver``
   (``durability="sync"``) and asiento's ``durable_run`` (SQLite, fsync on), in
   alternating order; medians of ``--reps`` runs, ms per model+tool step and the
   difference against the bare graph (issue #25's target: under 2 ms for asiento);
   then the journal appends of one more asiento run (each a transaction: an fsync).

Figures, never pass/fail. ``--quick`` is the smoke run: 5 kills, fewer steps and reps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from integrations.langgraph_graph import (  # noqa: E402
    SCRIPT,
    TASK,
    ScriptedChat,
    build,
    ledger_line,
    lines,
)
from providers.fake_servers import Answer, FakeProvider  # noqa: E402

ANSWERS = [Answer(text, tuple(calls)) for text, calls in SCRIPT]
MODEL_STEPS = len(SCRIPT)
MAX_PASSES = 6  # a trial's passes: the killed one and the resumes
SIDES = ("langgraph", "asiento")
REFUND_RESULT = "refund of order 42 to ana issued"  # what the person says happened
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _loopback_only() -> None:
    """Refuse any connection of this process to a host that is not this machine."""
    real = socket.socket.connect

    def connect(self: socket.socket, address: Any) -> None:
        host = address[0] if isinstance(address, tuple) else address
        inet = self.family in (socket.AF_INET, socket.AF_INET6)
        if inet and isinstance(host, str) and host not in _LOOPBACK:
            raise ConnectionRefusedError(f"bench/langgraph_kills.py: not loopback: {host}")
        real(self, address)

    socket.socket.connect = connect  # type: ignore[method-assign]


# -- the child: one pass ------------------------------------------------------------------------


def _tools(ledger: Path, latency: float) -> list[Any]:
    """The quick-start graph's tools (tests/integrations/langgraph_graph.py), each line
    stamped with the system's monotonic clock, each answer ``latency`` after its effect."""
    from langchain_core.tools import tool

    @tool
    def lookup(order: int) -> str:
        """Look an order up (read-only)."""
        ledger_line(ledger, f"lookup {order} @{time.monotonic():.6f}")
        time.sleep(latency)
        return f"order {order}: 30 EUR, paid by ana"

    @tool
    def refund(order: int, to: str) -> str:
        """Refund an order (an effect: once)."""
        ledger_line(ledger, f"refund {order} {to} @{time.monotonic():.6f}")
        time.sleep(latency)
        return f"refund of order {order} to {to} issued"

    return [lookup, refund]


def _messages(state: Any) -> list[list[Any]]:
    """The final messages as compared: type, text, tool calls (name and arguments)."""
    return [
        [m.type, str(m.content), [[c["name"], c["args"]] for c in getattr(m, "tool_calls", [])]]
        for m in state["messages"]
    ]


def _ready() -> float:
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    return time.perf_counter()


async def _child_pass(args: argparse.Namespace) -> dict[str, Any]:
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(model="gpt-test", base_url=args.base_url, api_key="sk-test", max_retries=0)
    graph = build(model, _tools(Path(args.ledger), args.tool_latency))
    task = {"messages": [("user", TASK)]}
    if args.child == "langgraph":
        from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

        async with AsyncSqliteSaver.from_conn_string(args.db) as saver:
            saved = graph.builder.compile(checkpointer=saver)
            config: Any = {"configurable": {"thread_id": args.run_id}}
            started = _ready()
            state = await saved.aget_state(config)
            if state.next:  # resumed from its last checkpoint
                output = await saved.ainvoke(None, config, durability="sync")
            elif state.values:  # it ended before the kill took the process
                output = state.values
            else:
                output = await saved.ainvoke(task, config, durability="sync")
        seconds = time.perf_counter() - started
        return {"ended": "closed", "messages": _messages(output), "seconds": seconds}
    from asiento import SqliteCheckpointer, UncertainEffect
    from asiento.integrations.langgraph import durable_run

    store = SqliteCheckpointer(args.db)
    started = _ready()
    try:
        result = await durable_run(
            graph, task, run_id=args.run_id, store=store, idempotent=["lookup"]
        )
    except UncertainEffect as exc:
        return {"ended": "uncertain", "step": exc.step_id}
    finally:
        await store.close()
    seconds = time.perf_counter() - started
    return {"ended": "closed", "messages": _messages(result.output), "seconds": seconds}


# -- the parent: trials -------------------------------------------------------------------------


@dataclass
class Tally:
    """One side's counts, summed over its trials."""

    trials: int = 0
    kills: int = 0
    passes: int = 0
    duplicated: int = 0  # refund lines beyond 1 per run
    lookups_again: int = 0  # lookup lines beyond 1 per run (read-only: harmless)
    repaid: int = 0  # generations beyond MODEL_STEPS per run
    repaid_same_key: int = 0  # of those, sent under a key already billed
    person: int = 0  # runs that needed a person (an uncertain refund)
    differ: int = 0  # runs whose final messages differ from the uninterrupted run's
    unfinished: int = 0  # runs not closed within MAX_PASSES
    landed: dict[str, int] = field(default_factory=dict)  # where the kills landed
    reference: float = 0.0  # seconds of the uninterrupted pass


@dataclass(frozen=True)
class Knobs:
    latency: float
    tool_latency: float
    folder: Path


def _argv(side: str, where: Path, url: str, knobs: Knobs) -> list[str]:
    return [
        sys.executable, __file__, "--child", side, "--base-url", url,
        "--db", str(where / "runs.db"), "--ledger", str(where / "ledger"),
        "--run-id", "run", "--tool-latency", str(knobs.tool_latency),
    ]  # fmt: skip


def _pass(argv: list[str], kill_after: float | None) -> tuple[dict[str, Any] | None, float | None]:
    """One child pass: its JSON line (None when killed) and the instant of the kill."""
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        first = child.stdout.readline()  # blocks until the child is ready (or dies)
        killed_at = None
        if first.strip() == "ready" and kill_after is not None:
            try:
                child.wait(timeout=kill_after)
            except subprocess.TimeoutExpired:
                killed_at = time.monotonic()
                child.send_signal(signal.SIGKILL)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if child.returncode == -signal.SIGKILL and killed_at is not None:
        return None, killed_at
    if child.returncode != 0 or first.strip() != "ready":
        raise SystemExit(f"a pass failed ({child.returncode}): {err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1]), None


class _Provider(FakeProvider):
    """The fake provider, quiet about the connections a killed child drops."""

    def __init__(self, script: list[Answer]) -> None:
        super().__init__(script)
        self._server.handle_error = lambda request, address: None  # type: ignore[method-assign]


def _where(killed_at: float, provider: FakeProvider, ledger: Path, knobs: Knobs) -> str:
    """Where a kill landed: inside a model call, inside a tool (after its effect), else."""
    if any(r.at <= killed_at < r.at + knobs.latency for r in list(provider.requests)):
        return "model call"
    for line in lines(ledger):
        at = float(line.rsplit("@", 1)[1])
        if at <= killed_at < at + knobs.tool_latency:
            return "tool"
    return "elsewhere"


async def _settle(db: Path, step_id: str) -> None:
    from asiento import SqliteCheckpointer, resolve

    store = SqliteCheckpointer(db)
    try:
        await resolve(store, "run", step_id, happened=True, result=REFUND_RESULT, by="ops")
    finally:
        await store.close()


def _run(
    side: str, where: Path, knobs: Knobs, kill_after: float | None, tally: Tally | None
) -> dict[str, Any]:
    """One run driven to its end on a fresh provider: its first pass killed at
    ``kill_after`` (None: not killed); counted into ``tally``."""
    where.mkdir(parents=True)
    ledger = where / "ledger"
    with _Provider(ANSWERS) as provider:
        argv = _argv(side, where, provider.openai_url, knobs)
        out: dict[str, Any] | None = None
        needed_person = False
        passes = 0
        for n in range(MAX_PASSES):
            for turn in range(MODEL_STEPS):  # every generation of this pass comes late
                provider.delay_turn(turn, knobs.latency)
            passes += 1
            out, killed_at = _pass(argv, kill_after if n == 0 else None)
            if killed_at is not None and tally is not None:
                tally.kills += 1
                spot = _where(killed_at, provider, ledger, knobs)
                tally.landed[spot] = tally.landed.get(spot, 0) + 1
            if out is not None and out["ended"] == "uncertain":
                needed_person = True
                asyncio.run(_settle(where / "runs.db", out["step"]))
            if out is not None and out["ended"] == "closed":
                break
        keys = list(provider.generations)
    if tally is not None:
        written = lines(ledger)
        tally.passes += passes
        tally.duplicated += max(0, sum(x.startswith("refund") for x in written) - 1)
        tally.lookups_again += max(0, sum(x.startswith("lookup") for x in written) - 1)
        tally.repaid += max(0, len(keys) - MODEL_STEPS)
        tally.repaid_same_key += sum(1 for i, k in enumerate(keys) if k and k in keys[:i])
        tally.person += needed_person
        if out is None or out["ended"] != "closed":
            tally.unfinished += 1
    return out or {"ended": "unfinished"}


def _side(side: str, kills: int, knobs: Knobs, seed: int, budget: float) -> Tally:
    """One side's trials; both draw the same fractions of their own uninterrupted pass."""
    rng = random.Random(seed)
    tally = Tally()
    clean = _run(side, knobs.folder / side / "clean", knobs, None, None)
    if clean["ended"] != "closed":
        raise SystemExit(f"{side}: the uninterrupted run did not close: {clean}")
    tally.reference = float(clean["seconds"])
    stop = time.monotonic() + budget
    for n in range(2 * kills + 5):  # a kill drawn past the pass's end does not land
        if tally.kills >= kills or time.monotonic() > stop:
            break
        tally.trials += 1
        delay = rng.random() * tally.reference
        out = _run(side, knobs.folder / side / f"trial-{n}", knobs, delay, tally)
        if out.get("messages") != clean["messages"]:
            tally.differ += 1
    done = f"{tally.trials} trials, {tally.kills} kills, {tally.passes} passes"
    print(f"  {side}: {done}", flush=True)
    return tally


_ROWS = (
    ("runs (trials)", "trials"),
    ("SIGKILLs landed", "kills"),
    ("passes", "passes"),
    ("duplicated refunds", "duplicated"),
    ("re-paid generations", "repaid"),
    ("  of which under a key already billed", "repaid_same_key"),
    ("runs that needed a person", "person"),
    ("final messages differ", "differ"),
    ("runs not closed", "unfinished"),
    ("lookups run again (read-only)", "lookups_again"),
)


_SPOTS = (
    ("model call", "  in a model call"),
    ("tool", "  in a tool, after its effect"),
    ("elsewhere", "  elsewhere (graph, checkpoints, journal)"),
)


def _print_kills(tallies: dict[str, Tally]) -> None:
    lg, asi = tallies["langgraph"], tallies["asiento"]
    print(f"\n{'random SIGKILLs':<44}{'langgraph':>11}{'asiento':>10}")
    for label, name in _ROWS:
        print(f"{label:<44}{getattr(lg, name):>11}{getattr(asi, name):>10}")
    for spot, label in _SPOTS:
        print(f"{label:<44}{lg.landed.get(spot, 0):>11}{asi.landed.get(spot, 0):>10}")
    print(f"{'uninterrupted pass (s)':<44}{lg.reference:>11.2f}{asi.reference:>10.2f}")
    for label, name in (("duplicated refunds", "duplicated"), ("re-paid generations", "repaid")):
        a, b = getattr(lg, name), getattr(asi, name)
        ratio = f"{a / b:.1f}x" if b else ("none on either side" if a == 0 else "asiento none")
        print(f"{label}, langgraph / asiento: {ratio}")


# -- overhead -----------------------------------------------------------------------------------


def _instant_model(steps: int) -> Any:
    """A chat model that answers at once: a ``lookup`` call per turn, then a text."""
    turns = [("", [("lookup", {"order": turn})]) for turn in range(steps)]
    return ScriptedChat(script=[*turns, ("done", [])])


def _counted(store: Any) -> list[int]:
    """Count ``store``'s appends (each one transaction, so one fsync with durability='full')."""
    count = [0]
    append = store.append

    async def counted(*events: Any, **kwargs: Any) -> None:
        count[0] += 1
        await append(*events, **kwargs)

    store.append = counted
    return count


async def _overhead(steps: int, reps: int, folder: Path) -> tuple[dict[str, list[float]], int]:
    from langchain_core.tools import tool
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    from asiento import SqliteCheckpointer
    from asiento.integrations.langgraph import durable_run

    @tool
    def lookup(order: int) -> str:
        """Look an order up (read-only)."""
        return f"order {order}: 30 EUR, paid by ana"

    graph = build(_instant_model(steps), [lookup])
    task = {"messages": [("user", TASK)]}
    limit = {"recursion_limit": 4 * steps + 10}
    store = SqliteCheckpointer(folder / "asiento.db")
    light = SqliteCheckpointer(folder / "asiento-process.db", durability="process")
    names = ("bare graph", "langgraph-sqlite", "asiento", "asiento-process")
    times: dict[str, list[float]] = {name: [] for name in names}
    async with AsyncSqliteSaver.from_conn_string(str(folder / "langgraph.db")) as saver:
        saved = graph.builder.compile(checkpointer=saver)

        async def bare(n: int) -> Any:
            return await graph.ainvoke(task, limit)

        async def checkpointed(n: int) -> Any:
            config: Any = {**limit, "configurable": {"thread_id": f"t-{n}"}}
            return await saved.ainvoke(task, config, durability="sync")

        async def durable(n: int, on: Any = store) -> Any:
            result = await durable_run(graph, task, run_id=f"r-{n}", store=on, config=limit)
            if (result.stats.model_calls, result.stats.tool_calls) != (steps + 1, steps):
                raise SystemExit(f"r-{n}: not {steps + 1} model calls and {steps} tool calls")
            return result.output

        async def process(n: int) -> Any:
            return await durable(n, light)

        modes = {
            "bare graph": bare,
            "langgraph-sqlite": checkpointed,
            "asiento": durable,
            "asiento-process": process,
        }
        try:
            for run in modes.values():  # warm up: imports, schemas, first connections
                await run(-1)
            for n in range(reps):
                order = list(modes.items())
                if n % 2:
                    order.reverse()
                for mode, run in order:
                    start = time.perf_counter()
                    output = await run(n)
                    times[mode].append(time.perf_counter() - start)
                    if output["messages"][-1].content != "done":
                        raise SystemExit(f"{mode} run {n} did not end with 'done'")
            appends = _counted(store)
            await durable(reps)  # one run more, its journal appends counted
        finally:
            await store.close()
            await light.close()
    return times, appends[0]


def _print_overhead(measured: tuple[dict[str, list[float]], int], steps: int) -> None:
    times, appends = measured
    base = statistics.median(times["bare graph"]) * 1000 / steps
    print(f"\noverhead, {steps} model+tool steps a run, an instant model (medians)")
    print(f"{'mode':<18}{'reps':>6}{'ms/run':>10}{'ms/step':>10}{'x bare':>9}{'ms/step over':>14}")
    for mode, samples in times.items():
        ms = statistics.median(samples) * 1000
        per = ms / steps
        over = "-" if mode == "bare graph" else f"{per - base:.2f}"
        line = f"{mode:<18}{len(samples):>6}{ms:>10.1f}{per:>10.2f}{per / base:>9.2f}{over:>14}"
        print(line)
    print(
        "(asiento: SQLite fsynced at each commit; asiento-process: durability='process', no\n"
        " fsync; langgraph-sqlite: AsyncSqliteSaver, durability='sync'. Issue #25's target:\n"
        " asiento under 2 ms per model+tool step over the bare graph)"
    )
    print(
        f"asiento's journal appends (transactions) a run: {appends}, {appends / steps:.2f} a step"
    )


# -- main ---------------------------------------------------------------------------------------


def _versions() -> str:
    from importlib.metadata import version

    names = ("asiento", "langgraph", "langgraph-checkpoint-sqlite", "langchain-openai")
    found = []
    for name in names:
        try:
            found.append(f"{name} {version(name)}")
        except Exception:
            found.append(f"{name} -")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    python = sys.version.split()[0]
    return ", ".join(found) + f", Python {python}, {os.cpu_count()} cpus, load {load}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=None, help="SIGKILLs per side (20)")
    parser.add_argument("--reps", type=int, default=None, help="overhead repetitions (9)")
    parser.add_argument("--steps", type=int, default=None, help="model+tool steps a run (50)")
    parser.add_argument("--latency", type=float, default=0.2, help="seconds a model answer takes")
    parser.add_argument("--tool-latency", type=float, default=0.2, help="a tool's answer, s")
    parser.add_argument("--budget", type=float, default=900.0, help="seconds of trials per side")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="5 kills, 20 steps, 3 reps")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    for name in ("--base-url", "--db", "--ledger", "--run-id"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.simplefilter("ignore", DeprecationWarning)
    _loopback_only()
    if args.child:
        sys.stdout.write(json.dumps(asyncio.run(_child_pass(args))) + "\n")
        return
    kills = args.kills if args.kills is not None else (5 if args.quick else 20)
    reps = args.reps if args.reps is not None else (3 if args.quick else 9)
    steps = args.steps if args.steps is not None else (20 if args.quick else 50)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(_versions())
    print(
        f"seed {seed}, {kills} kills a side, model latency {args.latency} s, "
        f"tool latency {args.tool_latency} s"
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        knobs = Knobs(args.latency, args.tool_latency, folder)
        tallies = {side: _side(side, kills, knobs, seed, args.budget) for side in SIDES}
        _print_kills(tallies)
        _print_overhead(asyncio.run(_overhead(steps, reps, folder)), steps)


if __name__ == "__main__":
    main()
