"""Fleet throughput on PostgreSQL: asiento workers against a raw INSERT baseline.

    python bench/fleet.py --quick                  # 300 runs per fleet size (under a minute)
    python bench/fleet.py                          # 1500 runs per fleet size (under 5 minutes)
    python bench/fleet.py --dsn postgresql://...   # an existing server (its role needs CREATE)
    python bench/fleet.py --concurrency-table 1,16,64,256   # one SQLite process, 100 ms model
    python bench/fleet.py --quick --workers 1,2,4 --concurrency 64   # PostgreSQL, 100 ms model

Without ``--dsn`` a throwaway PostgreSQL is started from the binaries of the
``pgserver`` package, in a temporary directory, with its default (durable)
settings, and removed at the end. Everything is measured in one run, on one
server:

1. For each fleet size W (1, 2, 4, 8), N runs are submitted to a new schema, then
   W worker processes (``asiento.Worker``, the ``ScriptedGateway``, one no-op
   non-idempotent tool per run by default: 2 model steps and 1 tool step) are started,
   connected, and released at the same instant. Each drains runs until none is
   left. The wall time runs from that instant to the last worker's end. Each
   worker counts its store's write transactions (claims, appends, releases,
   renewals, status changes) and times its claims.
2. The baseline: W processes of plain psycopg doing, between them, the same number
   of write transactions, each one INSERT of a 250-byte row in autocommit, into a
   table of the same schema; three times, the median counts.

It prints runs/s, steps/s, write transactions per run, both commit rates, the
ratio of the fleet's time to the baseline's, and the claim latency (median and
95th percentile), as a table. Figures, never pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from asiento import (
    Agent,
    App,
    ModelRequest,
    ModelResponse,
    ToolCall,
    Worker,
    open_store,
    submit,
    tool,
)
from asiento.journal.memory import MemoryCheckpointer
from asiento.testing import ScriptedGateway
from asiento.testing.postgres import PostgresUnavailable, start_local_postgres

HERE = Path(__file__).resolve()
PAYLOAD = "x" * 250  # about what one journal record of a small step weighs
WRITES = ("append", "claim", "release", "renew", "set_status")
READS = ("load", "load_step", "final", "age", "run")
WORKER_SECONDS = 240.0  # no fleet of this bench runs longer; a worker stops there
BASELINE_REPEATS = 3  # the baseline is short and noisy: its median is the figure


# -- the worker and baseline processes ------------------------------------------------------


def script(tools: int) -> ScriptedGateway:
    """The model: ``tools`` turns asking for one ``step`` each, then a final answer."""

    def answer(request: ModelRequest) -> ModelResponse:
        turn = sum(1 for m in request.messages if m.role == "assistant")
        if turn >= tools:
            return ModelResponse(text="done")
        return ModelResponse(tool_calls=[ToolCall(name="step", arguments={"n": turn})])

    return ScriptedGateway(answer)


@tool
def step(n: int) -> str:
    """A no-op effect: the cost measured is the journal's, not the tool's."""
    return f"step {n} done"


class Counted:
    """The worker's store, counting its write transactions and timing its claims.

    A ``claim_many`` counts as one write (one transaction on a store that claims in one
    round trip; the interim stubs loop ``claim`` inside it, so today's figure is low).
    """

    def __init__(self, store: Any) -> None:
        self._store = store
        self.writes = 0
        self.claims: list[float] = []
        self.spent: dict[str, list[float]] = {}  # operation: [calls, seconds awaited]

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._store, name)
        if name not in (*WRITES, *READS, "claim_many"):
            return found

        async def counted(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = await found(*args, **kwargs)
            took = time.perf_counter() - started
            spent = self.spent.setdefault(name, [0, 0.0])
            spent[0] += 1
            spent[1] += took
            if name in READS:
                return result
            self.writes += 1
            if name in ("claim", "claim_many") and result:
                self.claims.append(took)
            return result

        self.__dict__[name] = counted  # made once: the bench's own cost a call stays small
        return counted


async def worker_process(url: str, tools: int, concurrency: int = 1, latency: float = 0.0) -> None:
    """Connect, say ready, wait for go, drain, print what was done as JSON."""
    store = Counted(await open_store(url))

    def model() -> Any:
        return _SlowModel(script(tools), latency) if latency else script(tools)

    app = App(agents={"default": Agent(tools=[step])}, gateway=model)
    worker = Worker(store, app, poll=0.01, concurrency=concurrency)
    await asyncio.to_thread(ready_then_wait)
    started, cpu = time.monotonic(), time.process_time()
    profile = _profiler()
    await worker.run(until_idle=True, max_seconds=WORKER_SECONDS)
    ended, cpu = time.monotonic(), time.process_time() - cpu
    if profile is not None:
        profile.disable()
        profile.dump_stats(f"{os.environ['FLEET_PROFILE']}.{os.getpid()}")
    await store.close()
    report = {"start": started, "end": ended, "closed": worker.stats.closed, "cpu": cpu}
    report |= {"writes": store.writes, "claims": store.claims, "spent": store.spent}
    print(json.dumps(report), flush=True)


def _profiler() -> Any:
    """cProfile of the worker's drain when ``FLEET_PROFILE`` names where to write it."""
    if not os.environ.get("FLEET_PROFILE"):
        return None
    import cProfile

    profile = cProfile.Profile(time.process_time)  # CPU only: waits do not count
    profile.enable()
    return profile


def baseline_process(dsn: str, commits: int) -> None:
    """``commits`` single-row INSERTs, each its own transaction, like a journal append."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        ready_then_wait()
        started = time.monotonic()
        for n in range(commits):
            conn.execute(
                "INSERT INTO baseline (run_id, step_id, payload) VALUES (%s, %s, %s)",
                (f"run-{os.getpid()}", f"s{n}", PAYLOAD),
            )
        ended = time.monotonic()
    print(json.dumps({"start": started, "end": ended}), flush=True)


def ready_then_wait() -> None:
    print("ready", flush=True)
    sys.stdin.readline()


# -- the orchestration ---------------------------------------------------------------------


@dataclass
class Row:
    workers: int
    runs: int
    steps: int
    seconds: float
    writes: int
    baseline_seconds: float
    claims: list[float]
    cpu: float = 0.0  # the workers' CPU seconds while they drained
    spent: dict[str, list[float]] = field(default_factory=dict)  # op: [calls, s awaited]

    def waits(self) -> str:
        """Per store operation: calls a run, mean ms a call awaited (round trips, pool, loop)."""
        return ", ".join(
            f"{name} {calls / self.runs:.1f}/run {seconds / calls * 1000:.1f} ms"
            for name, (calls, seconds) in sorted(self.spent.items())
            if calls
        )

    def cells(self) -> list[str]:
        ms = sorted(c * 1000 for c in self.claims)
        p95 = ms[min(len(ms) - 1, int(len(ms) * 0.95))] if ms else float("nan")
        return [
            str(self.workers),
            str(self.runs),
            f"{self.runs / self.seconds:.1f}",
            f"{self.steps / self.seconds:.1f}",
            f"{self.writes / self.runs:.2f}",
            f"{self.writes / self.seconds:.0f}",
            f"{self.writes / self.baseline_seconds:.0f}",
            f"{self.seconds / self.baseline_seconds:.2f}",
            f"{statistics.median(ms):.2f}" if ms else "-",
            f"{p95:.2f}",
            f"{self.cpu / (self.seconds * self.workers):.2f}",
        ]


HEADER = [
    "workers",
    "runs",
    "runs/s",
    "steps/s",
    "writes/run",
    "fleet_commits/s",
    "raw_commits/s",
    "time_ratio",
    "claim_p50_ms",
    "claim_p95_ms",
    "worker_cpu",
]


# With --pin: the cores the server's processes run on, and the cores left to the workers.
PINNED: dict[str, str] = {}


def pin_server(base: Path) -> None:
    """The server and every backend it forks later on core 0; the workers on the others."""
    cores = os.cpu_count() or 1
    if cores < 2:
        raise SystemExit("--pin needs at least 2 cores: one for the server, one for the workers")
    postmaster = int((base / "data" / "postmaster.pid").read_text().split()[0])
    subprocess.run(
        ["taskset", "-a", "-p", "-c", "0", str(postmaster)], check=True, stdout=subprocess.DEVNULL
    )
    PINNED.update(server="0", workers=f"1-{cores - 1}" if cores > 2 else "1")


def spawn(*argv: str) -> subprocess.Popen[str]:
    pinned = ["taskset", "-c", PINNED["workers"]] if PINNED else []
    return subprocess.Popen(
        [*pinned, sys.executable, str(HERE), *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def race(children: Sequence[subprocess.Popen[str]], timeout: float) -> list[dict[str, Any]]:
    """Wait until every child is ready, release them at once, collect their reports."""
    for child in children:
        assert child.stdout is not None
        line = child.stdout.readline()
        if line != "ready\n":
            raise RuntimeError(f"a bench process did not start: {line!r}")
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    reports = []
    for child in children:
        out, _ = child.communicate(timeout=timeout)
        if child.returncode != 0:
            raise RuntimeError(f"a bench process failed ({child.returncode})")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def wall(reports: list[dict[str, Any]]) -> float:
    return max(r["end"] for r in reports) - min(r["start"] for r in reports)


def new_schema(admin_dsn: str, name: str) -> str:
    """A fresh schema for one measurement, and a DSN whose tables live in it."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{name}"')
        conn.execute(
            f'CREATE TABLE "{name}".baseline (id bigserial PRIMARY KEY, run_id text NOT NULL,'
            " step_id text NOT NULL, payload text NOT NULL)"
        )
    return make_conninfo(admin_dsn, options=f"-csearch_path={name}")


def as_url(dsn: str) -> str:
    """A libpq DSN as the postgresql:// URL ``open_store`` (and ``asiento worker``) take."""
    params = conninfo_to_dict(dsn)
    dbname = quote(str(params.pop("dbname", "") or ""))
    query = "&".join(f"{key}={quote(str(value))}" for key, value in params.items())
    return f"postgresql:///{dbname}?{query}"


async def submit_all(dsn: str, runs: int) -> None:
    store = await open_store(as_url(dsn))
    try:
        for n in range(runs):
            await submit(store, f"run-{n:05d}", f"task {n}")
    finally:
        await store.close()


def measure(admin_dsn: str, workers: int, runs: int, tools: int, *drive: str) -> Row:
    """One fleet size in a schema of its own, dropped afterwards."""
    name = f"asiento_bench_w{workers}_{uuid.uuid4().hex[:8]}"
    dsn = new_schema(admin_dsn, name)
    try:
        return measure_in(dsn, workers, runs, tools, *drive)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{name}" CASCADE')


def measure_in(dsn: str, workers: int, runs: int, tools: int, *drive: str) -> Row:
    """The fleet draining ``runs`` runs, then the same number of commits, raw.

    ``drive``: the workers' concurrency and model latency, as strings (default 1 and 0).
    """
    asyncio.run(submit_all(dsn, runs))
    reports = race(
        [spawn("--role", "worker", as_url(dsn), str(tools), *drive) for _ in range(workers)],
        600,
    )
    closed = sum(r["closed"] for r in reports)
    if closed != runs:
        raise RuntimeError(f"{workers} workers closed {closed} of {runs} runs")
    writes = sum(r["writes"] for r in reports)
    shares = [writes // workers + (1 if n < writes % workers else 0) for n in range(workers)]
    baselines = [
        wall(race([spawn("--role", "baseline", dsn, str(share)) for share in shares], 600))
        for _ in range(BASELINE_REPEATS)
    ]
    claims = [c for r in reports for c in r["claims"]]
    steps = runs * (2 * tools + 1)
    cpu = sum(r["cpu"] for r in reports)
    spent: dict[str, list[float]] = {}
    for report in reports:
        for name, (calls, seconds) in report["spent"].items():
            total = spent.setdefault(name, [0, 0.0])
            total[0] += calls
            total[1] += seconds
    median = statistics.median(baselines)
    return Row(workers, runs, steps, wall(reports), writes, median, claims, cpu, spent)


def print_table(rows: list[Row]) -> None:
    table = [HEADER, *(row.cells() for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER))]
    for line in table:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)))


# -- a throwaway server ------------------------------------------------------------------------


@contextmanager
def local_server(pin: bool = False) -> Iterator[str]:
    """A PostgreSQL from pgserver's binaries in a temporary directory; its admin DSN."""
    try:
        cluster = start_local_postgres(max_connections=300)
    except PostgresUnavailable as exc:
        raise SystemExit(str(exc)) from exc
    try:
        if pin:
            pin_server(cluster.base)
        yield cluster.dsn
    finally:
        cluster.stop()


# -- concurrency on one process (SQLite) ---------------------------------------------------


class _SlowModel:
    """A model that takes ``latency`` seconds per answer, as a remote one would; with
    ``jitter`` J, each answer takes latency x U(1-J, 1+J), drawn from its run and step
    (``answer_seconds``), so the same answer takes the same time in every run."""

    def __init__(self, inner: ScriptedGateway, latency: float, jitter: float = 0.0) -> None:
        self.inner, self.latency, self.jitter = inner, latency, jitter

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        run_id, step_id, _ = idempotency_key.split(":", 2)
        await asyncio.sleep(answer_seconds(run_id, step_id, self.latency, self.jitter))
        return await self.inner.complete(request, idempotency_key=idempotency_key)


def answer_seconds(run_id: str, step_id: str, latency: float, jitter: float) -> float:
    """How long the model takes to answer step ``step_id`` of ``run_id``."""
    if not jitter:
        return latency
    draw = random.Random(f"{run_id}/{step_id}").uniform(1 - jitter, 1 + jitter)
    return latency * draw


def ideal_seconds(run_ids: list[str], concurrency: int, latency: float, jitter: float) -> float:
    """The time the runs would take with nothing but the model's answers: each run's two
    answers back to back, the runs taken oldest first by ``concurrency`` slots."""
    slots = [0.0] * concurrency
    for run_id in run_ids:
        took = sum(answer_seconds(run_id, s, latency, jitter) for s in ("m1", "m2"))
        heapq.heappush(slots, heapq.heappop(slots) + took)
    return max(slots)


async def _one_sqlite_worker(
    path: Path | None, runs: int, concurrency: int, latency: float, jitter: float = 0.0
) -> dict[str, Any]:
    """One worker at ``concurrency`` over ``runs`` runs on the SQLite file ``path``, or,
    with ``path`` None, on the in-memory journal: the same worker with a journal that
    costs no commit, the ceiling of what a faster store could give it."""
    store = MemoryCheckpointer() if path is None else await open_store(str(path))
    run_ids = [f"run-{n:05d}" for n in range(runs)]
    for n, run_id in enumerate(run_ids):
        await submit(store, run_id, f"task {n}")

    @tool
    def step(n: int) -> str:
        """A trivial tool."""
        return f"step {n}"

    counted = Counted(store)
    app = App(
        agents={"default": Agent(tools=[step])},
        gateway=lambda: _SlowModel(script(1), latency, jitter),
    )
    worker = Worker(counted, app, poll=0.05, concurrency=concurrency)  # type: ignore[arg-type]
    started = time.monotonic()
    await worker.run(until_idle=True, max_seconds=WORKER_SECONDS)
    seconds = time.monotonic() - started
    await store.close()
    steps = 3 * runs  # 2 model steps and 1 tool step a run
    ideal = ideal_seconds(run_ids, concurrency, latency, jitter)
    model_steps = 2 * runs
    return {
        "concurrency": concurrency,
        "runs": runs,
        "closed": worker.stats.closed,
        "steps_per_s": steps / seconds,
        "model_steps_per_s": model_steps / seconds,
        "ideal_model_steps_per_s": model_steps / ideal,
        "commits_per_step": counted.writes / steps,
    }


def concurrency_table(
    folder: Path, levels: list[int], latency: float, runs_per_slot: int, jitter: float = 0.0
) -> None:
    """One process on SQLite at each concurrency: steps/s against the ideal, commits a step."""
    rows, ceilings = [], []
    for level in levels:
        runs = max(8, level * runs_per_slot)
        path = folder / f"concurrency-{level}.db"
        rows.append(asyncio.run(_one_sqlite_worker(path, runs, level, latency, jitter)))
        ceilings.append(asyncio.run(_one_sqlite_worker(None, runs, level, latency, jitter)))
    base = rows[0]["model_steps_per_s"]
    spread = f" x U({1 - jitter:g}, {1 + jitter:g})" if jitter else ""
    print(
        f"\none worker process on SQLite, model latency {latency * 1000:.0f} ms{spread},"
        " 3 steps a run"
    )
    print(
        f"{'concurrency':>11} {'runs':>6} {'closed':>6} {'steps/s':>9} {'model/s':>9}"
        f" {'ideal':>8} {'of_ideal':>8} {'vs_c1':>7} {'commits/step':>12}"
        f" {'memory_of_ideal':>15} {'vs_memory':>9}"
    )
    for row, ceiling in zip(rows, ceilings, strict=True):
        of_memory = ceiling["model_steps_per_s"] / ceiling["ideal_model_steps_per_s"]
        print(
            f"{row['concurrency']:>11} {row['runs']:>6} {row['closed']:>6}"
            f" {row['steps_per_s']:>9.1f} {row['model_steps_per_s']:>9.1f}"
            f" {row['ideal_model_steps_per_s']:>8.1f}"
            f" {row['model_steps_per_s'] / row['ideal_model_steps_per_s']:>8.2f}"
            f" {row['model_steps_per_s'] / base:>7.1f} {row['commits_per_step']:>12.2f}"
            f" {of_memory:>15.2f} {row['model_steps_per_s'] / ceiling['model_steps_per_s']:>9.2f}"
        )
    print(
        "\nideal: model answers a second if the runs took nothing but the model's time"
        "\n(concurrency / latency without --jitter). commits/step: the store's write"
        "\ntransactions (claims, appends, renewals, releases, status changes) per step."
        "\nmemory_of_ideal: the same worker on the in-memory journal (no commit at all),"
        "\nmeasured right after; vs_memory: SQLite's throughput against it."
    )


# -- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 runs per fleet size")
    parser.add_argument("--dsn", help="an existing server's DSN (else one is started)")
    parser.add_argument("--runs", type=int, help="runs per fleet size (300 quick, 1500 default)")
    parser.add_argument("--tools", type=int, default=1, help="tool steps per run (1)")
    parser.add_argument("--workers", default="1,2,4,8", help="fleet sizes, comma-separated")
    parser.add_argument(
        "--concurrency-table",
        metavar="LEVELS",
        help="one SQLite worker process at each concurrency, e.g. 1,16,64,256 (no PostgreSQL)",
    )
    parser.add_argument("--latency", type=float, help="model latency, s (0.1 with concurrency)")
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="--concurrency-table: each answer takes latency x U(1-J, 1+J) (0: all alike)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="PostgreSQL fleets: runs each worker drives at once (1: as before; >1 uses --latency)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="PostgreSQL: the server on core 0, the workers on the other cores (taskset)",
    )
    parser.add_argument("--dir", help="where the SQLite files go (a temporary directory)")
    parser.add_argument("--role", choices=["worker", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("role_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "worker":
        url, tools, *drive = args.role_args
        concurrency, latency = (int(drive[0]), float(drive[1])) if drive else (1, 0.0)
        asyncio.run(worker_process(url, int(tools), concurrency, latency))
        return
    if args.role == "baseline":
        baseline_process(args.role_args[0], int(args.role_args[1]))
        return
    if args.concurrency_table:
        import tempfile

        levels = [int(c) for c in args.concurrency_table.split(",")]
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            latency = 0.1 if args.latency is None else args.latency
            runs_per_slot = 2 if args.quick else 4
            concurrency_table(Path(folder), levels, latency, runs_per_slot, args.jitter)
        return
    runs = args.runs or (300 if args.quick else 1500)
    sizes = [int(w) for w in args.workers.split(",")]
    started = time.monotonic()
    driven = args.concurrency > 1 or args.latency is not None
    if driven and args.latency is None:
        args.latency = 0.1
    drive = (str(args.concurrency), str(args.latency)) if driven else ()
    with server(args.dsn, args.pin) as admin_dsn:
        rows = [measure(admin_dsn, w, runs, args.tools, *drive) for w in sizes]
    cores = os.cpu_count()
    steps = 2 * args.tools + 1
    print(f"\nfleet on PostgreSQL: {runs} runs per fleet size, {steps} steps a run, {cores} cores")
    print_table(rows)
    print("\nwhat a run awaited from the store, per operation:")
    for row in rows:
        print(f"  {row.workers} workers: {row.waits()}")
    if drive:
        print(
            f"\nconcurrency {args.concurrency} a worker,"
            f" model latency {args.latency * 1000:.0f} ms:"
        )
        for row in rows:
            model_steps = row.runs * (args.tools + 1) / row.seconds
            ideal = row.workers * args.concurrency / args.latency
            print(
                f"  {row.workers} workers: {model_steps:.1f} model answers/s of an ideal"
                f" {ideal:.0f} ({model_steps / ideal:.2f}),"
                f" {row.writes / row.steps:.2f} commits/step"
            )
    print(
        "\ntime_ratio: the fleet's wall time over the raw baseline's (the same number of write"
        "\ntransactions, one INSERT each, by as many processes). Workers and the server share"
        f"\nthe machine's cores. Total {time.monotonic() - started:.0f}s."
    )


@contextmanager
def server(dsn: str | None, pin: bool = False) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    with local_server(pin) as started:
        yield started


if __name__ == "__main__":
    main()
