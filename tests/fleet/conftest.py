"""Fixtures and helpers of the fleet tests: worker processes, racers, the effect ledger.

The PostgreSQL server and a schema per test come from ``tests/conftest.py``
(``pg_cluster``, ``pg_dsn``). Workers open the store by URL, as ``asiento
worker --store URL`` does; the test's own store connects under another
``application_name``, so that terminating the workers' backends spares it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from asiento import (
    Checkpointer,
    Phase,
    RunInfo,
    RunStatus,
    Session,
    ToolStep,
    approve,
    deny,
    open_store,
    submit,
)
from asiento.journal.postgres import PostgresCheckpointer
from asiento.testing import ScriptedGateway

from .worker_child import Ledger, agents, answer

CHILD = Path(__file__).with_name("worker_child.py")
SETTLED = (RunStatus.CLOSED, RunStatus.SUSPENDED, RunStatus.UNCERTAIN, RunStatus.PARKED)


def seed() -> int:
    """The seed of a random schedule: ASIENTO_FLEET_SEED, or a new one (printed)."""
    chosen = int(os.environ.get("ASIENTO_FLEET_SEED") or time.time_ns() % 1_000_000)
    print(f"ASIENTO_FLEET_SEED={chosen}")
    return chosen


def as_url(dsn: str) -> str:
    """A libpq DSN written as the postgresql:// URL a worker's ``--store`` takes."""
    params = conninfo_to_dict(dsn)
    dbname = quote(str(params.pop("dbname", "")))
    query = "&".join(f"{key}={quote(str(value))}" for key, value in params.items())
    return f"postgresql:///{dbname}?{query}"


def app_name(dsn: str) -> str:
    """The application_name the workers' connections carry in pg_stat_activity."""
    return str(conninfo_to_dict(dsn)["application_name"])


@pytest.fixture
def pg_url(pg_dsn: str) -> str:
    """The test schema's URL, for the workers."""
    return as_url(pg_dsn)


@pytest.fixture
async def pg_store(pg_dsn: str) -> AsyncIterator[PostgresCheckpointer]:
    """The test's own store on its schema, under an application_name of its own."""
    dsn = make_conninfo(pg_dsn, application_name="asiento-test-store")
    async with PostgresCheckpointer(dsn, max_size=2) as store:
        yield store


@pytest.fixture
async def sqlite_store(sqlite_path: Path) -> AsyncIterator[Checkpointer]:
    """The test's own store on the SQLite journal the workers share."""
    store = await open_store(sqlite_path)
    yield store
    await store.close()


class Fleet:
    """Worker processes on one store and folder: start, SIGKILL, SIGTERM, read what they did."""

    def __init__(self, url: str, folder: Path) -> None:
        self.url, self.folder = url, folder
        self.live: list[subprocess.Popen[bytes]] = []
        self.exits: list[int] = []
        self.kills = 0
        # Called with each worker started (to put it in a memory cgroup, say).
        self.confine: Callable[[subprocess.Popen[bytes]], None] | None = None

    def start(self, count: int = 1, *options: str) -> list[subprocess.Popen[bytes]]:
        started = [
            self._spawn("worker", self.url, str(self.folder), *options) for _ in range(count)
        ]
        for worker in started if self.confine is not None else ():
            self.confine(worker)
        self.live += started
        return started

    def _spawn(self, *argv: str) -> subprocess.Popen[bytes]:
        errors = (self.folder / f"stderr.{time.monotonic_ns()}").open("wb")
        with errors:
            return subprocess.Popen(
                [sys.executable, str(CHILD), *argv], stdout=subprocess.DEVNULL, stderr=errors
            )

    def kill(self, worker: subprocess.Popen[bytes]) -> None:
        """SIGKILL one worker and reap it."""
        worker.send_signal(signal.SIGKILL)
        assert worker.wait(timeout=20) == -signal.SIGKILL
        self.live.remove(worker)
        self.kills += 1

    def reap(self) -> list[int]:
        """Forget the workers that exited by themselves; their exit codes."""
        done = [w for w in self.live if w.poll() is not None]
        for worker in done:
            self.live.remove(worker)
        codes = [int(w.returncode) for w in done]
        self.exits += codes
        return codes

    def stop(self) -> list[int]:
        """SIGTERM every live worker: each finishes its step, then exits (75).

        A replacement still starting has not installed its SIGTERM handler yet (the
        signal would kill it, -15): wait until every live worker said it is ready.
        """
        ready = lambda: {e["pid"] for e in self.logs() if e["ev"] == "ready"}  # noqa: E731
        wait_for(lambda: all(w.pid in ready() or w.poll() is not None for w in self.live), 60)
        for worker in self.live:
            worker.send_signal(signal.SIGTERM)
        codes = [w.wait(timeout=120) for w in self.live]  # after an outage, pools reconnect slowly
        self.live = []
        self.exits += codes
        return codes

    def close(self) -> None:
        for worker in self.live:
            with contextlib.suppress(ProcessLookupError):
                worker.kill()
            worker.wait(timeout=20)
        self.live = []

    def ledger(self) -> Counter[str]:
        """How many times each task's effect was applied."""
        return Counter({task: len(pids) for task, pids in ledger(self.folder).items()})

    def logs(self) -> list[dict[str, Any]]:
        """Every worker's log lines (claims, leased appends, restarts, exits)."""
        return [
            json.loads(line)
            for path in sorted(self.folder.glob("log.*.jsonl"))
            for line in path.read_text().splitlines()
            if line.strip()
        ]

    def stderr(self) -> str:
        """What the workers printed on stderr, for failure messages."""
        return "\n".join(p.read_text()[-2000:] for p in sorted(self.folder.glob("stderr.*")))


def ledger(folder: Path) -> dict[str, list[int]]:
    """The effect ledger: for each task, the pids of the processes that applied it."""
    path = folder / "ledger"
    found: dict[str, list[int]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        task, pid = line.split()
        found.setdefault(task, []).append(int(pid))
    return found


def applied(folder: Path, task: str) -> bool:
    """Whether the effect of ``task`` is in the ledger."""
    return task in ledger(folder)


@pytest.fixture
def fleet_factory(tmp_path: Path) -> Iterator[Callable[[str], Fleet]]:
    """Make fleets on a store URL; every worker left alive is killed at the end."""
    made: list[Fleet] = []

    def make(url: str) -> Fleet:
        made.append(Fleet(url, tmp_path))
        return made[-1]

    yield make
    for fleet in made:
        fleet.close()


async def submit_runs(
    store: Checkpointer, count: int, agent: str, prefix: str = "job"
) -> list[str]:
    """Submit ``count`` runs whose task is their own run id."""
    run_ids = [f"{prefix}-{n:03d}" for n in range(count)]
    for run_id in run_ids:
        await submit(store, run_id, run_id, agent=agent)
    return run_ids


async def settle(
    store: Checkpointer,
    seconds: float,
    *,
    until: Callable[[list[RunInfo]], bool] | None = None,
    tick: Callable[[], object] | None = None,
) -> list[RunInfo]:
    """Poll the run listing until every run is settled (or ``until`` holds), bounded."""
    done = until or (lambda runs: all(r.status in SETTLED for r in runs))
    deadline = time.monotonic() + seconds
    while True:
        runs = await store.runs()
        if done(runs):
            return runs
        if time.monotonic() > deadline:
            counts = Counter(str(r.status) for r in runs)
            raise AssertionError(f"runs not settled after {seconds}s: {dict(counts)}")
        if tick is not None:
            tick()
        await asyncio.sleep(0.05)


async def fencing_violations(store: Checkpointer, logs: list[dict[str, Any]]) -> list[str]:
    """Records written under an older lease after records of a newer one, run by run.

    Each leased append is logged with its token; the journal keeps the order of
    writing. A stale holder that wrote after a takeover shows as a token going
    down. Records whose writer was killed before it could log are skipped.
    """
    token_of: dict[tuple[str, str, str], int] = {}
    for entry in logs:
        if entry["ev"] == "append":
            for step_id, phase in entry["keys"]:
                token_of[(entry["run"], step_id, phase)] = entry["token"]
    problems = []
    for run_id in sorted({run for run, _, _ in token_of}):
        tokens = [
            token_of[key]
            for e in await store.load(run_id)
            if (key := (run_id, e.step_id, str(e.phase))) in token_of
        ]
        if tokens != sorted(tokens):
            problems.append(f"{run_id}: tokens in journal order {tokens}")
    return problems


def claims_by_run(logs: list[dict[str, Any]]) -> dict[str, list[int]]:
    """The fencing tokens each run was claimed with, in log order."""
    found: dict[str, list[int]] = {}
    for entry in logs:
        if entry["ev"] == "claim":
            found.setdefault(entry["run"], []).append(entry["token"])
    return found


# -- racers: processes resuming the same run at the same instant ------------------------------


class Racers:
    """Long-lived ``worker_child.py race`` processes, told at once to resume one run."""

    def __init__(self, url: str, folder: Path, count: int) -> None:
        self.folder = folder
        self.lines: queue.Queue[str] = queue.Queue()
        self.procs = [self._spawn(url, n) for n in range(count)]
        self.readers = [threading.Thread(target=self._read, args=(p,)) for p in self.procs]
        for proc, reader in zip(self.procs, self.readers, strict=True):
            assert proc.stdout is not None
            assert proc.stdout.readline() == "ready\n", self.stderr()
            reader.start()

    def _spawn(self, url: str, n: int) -> subprocess.Popen[str]:
        with (self.folder / f"stderr.racer.{n}").open("wb") as errors:
            return subprocess.Popen(
                [sys.executable, str(CHILD), "race", url, str(self.folder)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
            )

    def stderr(self) -> str:
        return "\n".join(p.read_text()[-2000:] for p in self.folder.glob("stderr.racer.*"))

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.put(line.strip())

    def go(self, run_id: str) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(f"go {run_id}\n")
            proc.stdin.flush()

    def answers(self, count: int, seconds: float = 20.0) -> list[str]:
        """The next ``count`` answers, whoever gives them; fails if they do not come."""
        got = []
        deadline = time.monotonic() + seconds
        while len(got) < count:
            try:
                got.append(self.lines.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                message = f"only {got} of {count} answers in {seconds}s\n{self.stderr()}"
                raise AssertionError(message) from None
        return got

    def close(self) -> list[int]:
        for proc in self.procs:
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
        return [proc.wait(timeout=20) for proc in self.procs]

    def kill(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=20)
        for reader in self.readers:
            reader.join(timeout=10)  # the pipes are at their end: the readers are done
        for proc in self.procs:
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()


async def start_race_run(store: Checkpointer, folder: Path, run_id: str) -> None:
    """Drive ``run_id`` (agent ``race``) through its first tool step here, then stop."""
    agent = agents(Ledger(folder))["race"]
    session = Session(run_id, ScriptedGateway(answer), store)
    async with aclosing(agent.run(run_id, session=session)) as steps:
        async for step in steps:
            if isinstance(step, ToolStep):
                return
    raise AssertionError("the race agent's first tool step never came")


async def race_rounds(store: Checkpointer, url: str, folder: Path, rounds: int) -> None:
    """Each round: 4 processes resume one run at once; one drives it, 3 get RunLocked."""
    racers = await asyncio.to_thread(Racers, url, folder, 4)
    try:
        for n in range(rounds):
            run_id = f"race-{n:02d}"
            await start_race_run(store, folder, run_id)
            racers.go(run_id)
            losers = await asyncio.to_thread(racers.answers, 3)
            assert losers == [f"locked {run_id}"] * 3, (n, losers)
            sent = functools.partial(applied, folder, run_id)
            await asyncio.to_thread(wait_for, sent, 20, "the winner's send")
            (folder / f"release.{run_id}").touch()
            [winner] = await asyncio.to_thread(racers.answers, 1)
            assert winner.split()[:2] == ["drove", run_id], winner
            assert ledger(folder)[run_id] == [int(winner.split()[2])]
        assert await asyncio.to_thread(racers.close) == [0] * 4
    finally:
        await asyncio.to_thread(racers.kill)
    assert {run: len(pids) for run, pids in ledger(folder).items()} == {
        f"race-{n:02d}": 1 for n in range(rounds)
    }
    closed = await store.runs(status=RunStatus.CLOSED)
    assert len(closed) == rounds


def wait_for(check: Callable[[], bool], seconds: float = 30.0, what: str = "") -> None:
    """Poll ``check`` until it holds, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.01)


# -- scenarios that run the same on SQLite and PostgreSQL --------------------------------------


async def decided_runs_resume(store: Checkpointer, fleet: Fleet) -> None:
    """Suspended runs wait; approved, a worker pays once and closes; denied, it closes unpaid."""
    await submit_runs(store, 3, "approve", prefix="pay")
    fleet.start(2)
    runs = await settle(store, 60)
    assert [(r.status, r.fence) for r in runs] == [(RunStatus.SUSPENDED, 1)] * 3, fleet.stderr()
    assert fleet.ledger() == Counter()
    await approve(store, "pay-000", "m1.t1", by="ana", reason="ok")
    await deny(store, "pay-001", "m1.t1", by="ana", reason="not this month")
    decided = {"pay-000", "pay-001"}

    def closed(runs: list[RunInfo]) -> bool:
        return all(r.status is RunStatus.CLOSED for r in runs if r.run_id in decided)

    await settle(store, 60, until=closed)
    await asyncio.sleep(0.5)  # the workers poll every 0.05 s: the undecided run stays put
    runs = await store.runs()
    assert [(r.run_id, r.status, r.fence) for r in runs] == [
        ("pay-000", RunStatus.CLOSED, 2),
        ("pay-001", RunStatus.CLOSED, 2),
        ("pay-002", RunStatus.SUSPENDED, 1),
    ]
    assert fleet.ledger() == Counter({"pay-000": 1})
    denied = {e.phase: e.payload for e in await store.load_step("pay-001", "m1.t1")}
    assert denied[Phase.RESULT]["status"] == "denied"
    assert fleet.stop() == [75, 75]


async def poison_run_is_parked(store: Checkpointer, fleet: Fleet) -> None:
    """A run whose tool SIGKILLs every worker driving it is parked after 3 claims, saying why."""
    await submit(store, "poison", "poison", agent="crash")
    run_ids = await submit_runs(store, 3, "send")
    options = ("--ttl", "1", "--max-attempts", "3")
    fleet.start(1, *options)

    def respawn() -> None:
        for code in fleet.reap():
            assert code == -signal.SIGKILL, fleet.stderr()
            fleet.start(1, *options)

    runs = await settle(store, 60, tick=respawn)
    by_id = {r.run_id: r for r in runs}
    poison = by_id["poison"]
    assert (poison.status, poison.attempts, poison.fence) == (RunStatus.PARKED, 3, 3)
    assert poison.reason is not None
    assert poison.reason == (
        "parked after 3 claims without reaching a stable state; last failure: its worker"
        " died while its tool step m1.t1/3 was in flight"
    )
    assert fleet.exits.count(-signal.SIGKILL) == 3
    assert [by_id[r].status for r in run_ids] == [RunStatus.CLOSED] * 3
    assert fleet.ledger() == Counter(dict.fromkeys(run_ids, 1))
    await asyncio.sleep(1.5)  # past the lease: a parked run is never claimed again
    assert (await info(store, "poison")).fence == 3
    assert fleet.stop() == [75]


async def info(store: Checkpointer, run_id: str) -> RunInfo:
    [found] = [r for r in await store.runs() if r.run_id == run_id]
    return found


async def drain_while_killing(
    store: Checkpointer, fleet: Fleet, *, workers: int, runs: int, kills: int, seed: int
) -> Counter[str]:
    """``workers`` drain ``runs`` runs while random workers are SIGKILLed and replaced.

    Every run must end closed or uncertain (or parked, had it crashed its workers too
    often), no effect may be applied twice, no stale lease may write after a takeover.
    Returns how many runs ended in each status.
    """
    rng = random.Random(seed)
    run_ids = await submit_runs(store, runs, "send")
    options = ("--ttl", "2", "--delay", "0.02")
    fleet.start(workers, *options)
    all_ready = lambda: sum(e["ev"] == "ready" for e in fleet.logs()) >= workers  # noqa: E731
    await asyncio.to_thread(wait_for, all_ready, 30, "workers ready")
    for number in range(kills):
        # The first kill comes early, while runs are surely in flight: their tools' delays
        # alone take runs x 0.02 s / workers to drain, however fast the machine.
        await asyncio.sleep(rng.uniform(0.05, 0.15) if number == 0 else rng.uniform(0.15, 0.45))
        runs = await store.runs()
        if all(r.status in SETTLED for r in runs):
            break
        # A worker that holds a lease, so that the kill leaves a run to take over: an
        # idle one (its neighbours claimed everything) would prove nothing.
        holders = {r.lease_pid for r in runs if r.status is RunStatus.RUNNING}
        fleet.kill(rng.choice([w for w in fleet.live if w.pid in holders] or fleet.live))
        fleet.start(1, *options)
    final = await settle(store, 120)
    assert fleet.stop() == [75] * workers, fleet.stderr()
    assert fleet.kills > 0
    return await check_drained(store, fleet, run_ids, final)


async def check_drained(
    store: Checkpointer, fleet: Fleet, run_ids: list[str], final: list[RunInfo]
) -> Counter[str]:
    """The invariants of a drained fleet; returns how many runs ended in each status."""
    statuses = Counter(str(r.status) for r in final)
    assert sorted(r.run_id for r in final) == run_ids
    assert set(statuses) <= {"closed", "uncertain", "parked"}, statuses
    effects = fleet.ledger()
    assert max(effects.values(), default=0) <= 1, effects.most_common(3)
    for run in final:
        if run.status is RunStatus.CLOSED:
            assert effects[run.run_id] == 1, run.run_id
        elif run.status is RunStatus.UNCERTAIN:  # killed between submitted and result
            phases = {e.phase for e in await store.load_step(run.run_id, "m1.t1")}
            assert phases == {Phase.INTENT, Phase.SUBMITTED}, (run.run_id, phases)
    logs = fleet.logs()
    assert await fencing_violations(store, logs) == []
    for run_id, tokens in claims_by_run(logs).items():
        assert len(set(tokens)) == len(tokens), (run_id, tokens)
    assert any(r.fence > 1 for r in final), "no run was taken over from a killed worker"
    return statuses
