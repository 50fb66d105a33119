"""The crash-point matrix, the kill storm and their replays.

A storm trial is one run driven from its start to its end, with a fault
chosen for each operation by the trial's own random generator (seeded with
the trial's seed): replaying the seed drives the same choices again. Armed
crash points replay exactly; a SIGKILL at a random instant replays at the
same delay, which lands where the machine's speed puts it.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._drive import NO_FAULT, Fault, ParentFaults, RunDriver, Runner, drive
from ._server import ForkServer
from .invariants import RunHistory
from .report import Report

if TYPE_CHECKING:
    from .harness import CrashHarness, Plan

CLOSING_OPS = 12  # a finished trial gets this many clean operations to close
FAULTY_OPS = 24  # operations of a trial that may get a fault
MAX_KILLS_IN_A_ROW = 6  # then a clean operation, so that every run moves on
RUNS_PER_WORKER = 3  # live at once per worker, so that their records interleave


# -- the matrix ------------------------------------------------------------------------


def cases(plan: Plan) -> list[tuple[int, str, int]]:
    """(operation index, crash point, passage) for every passage of the clean run."""
    return [
        (index, point, n)
        for index, (_, passages) in enumerate(plan.ops)
        for point, count in sorted(passages.items())
        for n in range(1, count + 1)
    ]


def case_name(index: int, point: str, n: int) -> str:
    return f"op{index}:{point}@{n}"


def parse_case(case: str) -> tuple[int, str, int]:
    where, _, spec = case.partition(":")
    point, _, n = spec.partition("@")
    return int(where.removeprefix("op")), point, int(n or 1)


def run_case(harness: CrashHarness, runner: Runner, case: str) -> tuple[RunDriver, bool]:
    """Drive a run with ``case`` armed in its operation; (driver, driven to an end)."""
    index, point, n = parse_case(case)
    driver = harness.driver("m", case=case)

    def choose(d: RunDriver, op: str) -> Fault:
        return Fault(crash=f"{point}@{n}") if len(d.ops) == index else NO_FAULT

    return driver, drive(driver, runner, choose, max_ops=harness.max_ops)


def matrix(harness: CrashHarness) -> Report:
    started = time.monotonic()
    report = Report("every crash point", harness.backend)
    with harness.servers(harness.workers) as servers:
        plan = harness.dry_run(servers[0], report)
        report.coverage = plan.coverage()
        never = [p for p, n in report.coverage.items() if n == 0]
        if never:
            report.notes.append(f"crash points this app never passes: {', '.join(never)}")
        todo = [case_name(*c) for c in cases(plan)]
        shares = [todo[i :: len(servers)] for i in range(len(servers))]
        with ThreadPoolExecutor(len(servers)) as pool:
            futures = [
                pool.submit(_run_cases, harness, s, share)
                for s, share in zip(servers, shares, strict=True)
            ]
            results = [item for f in futures for item in f.result()]
    histories = []
    for driver, ended in results:
        histories.append(driver.history(ended=ended))
        index = parse_case(str(driver.case))[0]
        if index < len(driver.ops) and driver.ops[index].killed:
            report.kills += 1
            report.faults["SIGKILL at a crash point"] += 1
        else:
            report.missed.append(str(driver.case))
    harness.check_histories(report, histories, plan)
    harness.check_store(report)
    report.trials, report.seconds = len(results), time.monotonic() - started
    return report


def _run_cases(
    harness: CrashHarness, server: ForkServer, share: list[str]
) -> list[tuple[RunDriver, bool]]:
    return [run_case(harness, server, case) for case in share]


# -- the storm -------------------------------------------------------------------------


def choose_fault(
    rng: random.Random, driver: RunDriver, op: str, plan: Plan, postgres: bool
) -> Fault:
    """A fault for the next operation of a storm trial (or none)."""
    if driver.kills_in_a_row() >= MAX_KILLS_IN_A_ROW or len(driver.ops) >= FAULTY_OPS:
        return NO_FAULT
    dice, points = rng.random(), plan.points(op)
    seconds = plan.seconds.get(op, 0.05)
    if dice < 0.45 and points:
        point = rng.choice(sorted(points))
        return Fault(crash=f"{point}@{rng.randint(1, points[point])}")
    if dice < 0.80:
        return Fault(kill_after=rng.uniform(0.0, seconds * 1.2))
    if postgres and op == "run":
        commits = points.get("inside_commit", 0)
        if dice < 0.87 and commits:
            delay = rng.uniform(0.0, 0.003) if rng.random() < 0.5 else None
            return Fault(pg_cut=(rng.randint(1, commits), delay))
        if dice < 0.94:
            return Fault(pg_kill_after=rng.uniform(0.0, seconds))
    return NO_FAULT


def trial_seed(seed: int, segment: int, worker: int, serial: int) -> int:
    return random.Random(f"{seed}/{segment}/{worker}/{serial}").getrandbits(48)


@dataclass
class Storm:
    """What the workers of one storm share: the budget, the clock, the report so far."""

    plan: Plan
    report: Report
    kills_wanted: int
    deadline: float
    tally: Counter[str] = field(default_factory=Counter)
    infra: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    aborted: bool = False

    def kills(self) -> int:
        return sum(n for kind, n in self.tally.items() if kind.startswith("SIGKILL"))

    def over(self) -> bool:
        with self.lock:
            spent = self.kills() >= self.kills_wanted or time.monotonic() > self.deadline
            return spent or self.aborted

    def count(self, kind: str | None) -> None:
        if kind is not None:
            with self.lock:
                self.tally[kind] += 1

    def settle(self, harness: CrashHarness, driver: RunDriver, ended: bool) -> None:
        """Check a finished run now, keep its summary, and let its snapshots go."""
        history = driver.history(ended=ended)
        with self.lock:
            harness.check_histories(self.report, [history], self.plan)
            self.report.trials += 1
            self.infra.update(infra_outcomes(history))

    def conclude(self, harness: CrashHarness) -> None:
        """The store-wide checks, and the tallies into the report."""
        harness.check_store(self.report)
        self.report.faults.update(self.tally)
        self.report.kills += self.kills()
        if self.infra:
            self.report.notes.append(
                "passes under database faults: "
                + ", ".join(f"{k}: {n}" for k, n in sorted(self.infra.items()))
            )


def infra_outcomes(history: RunHistory) -> Counter[str]:
    """How the passes that had their database cut under them ended."""
    return Counter(
        f"{_infra_kind(op.fault)} -> {op.outcome if not op.killed else 'killed'}"
        for op in history.ops
        if op.infra_fault
    )


def _infra_kind(label: str | None) -> str:
    text = label or ""
    if text.startswith("connections cut"):
        return "cut in a commit" + (" (delayed)" if "+" in text else "")
    return text.split(" after ")[0]


def fault_kind(reply: dict[str, object], fault: Fault) -> str | None:
    """How to count what happened to an operation."""
    if reply.get("rc") == -9:
        if reply.get("timer_killed"):
            return "SIGKILL at a random instant"
        return "SIGKILL at a crash point"
    if fault.pg_cut is not None:
        return "connections cut in a commit"
    if fault.pg_kill_after is not None:
        return "connections terminated"
    if fault.restart_after is not None:
        return "server restarts"
    return None


class Worker:
    """One fork-server driving its own interleaved runs, each with its own seed."""

    def __init__(
        self, harness: CrashHarness, storm: Storm, index: int, server: ForkServer, seed: int
    ) -> None:
        self.harness, self.storm, self.index, self.server = harness, storm, index, server
        self.seed, self.segment = seed, 0
        self.pick = random.Random(f"{seed}/pick/{index}")
        self.rngs: dict[str, random.Random] = {}
        self.parent = harness.parent_faults(index)
        self.serial = 0

    def campaign(self, segment: int) -> None:
        self.segment = segment
        try:
            self._campaign()
        except BaseException:
            self.storm.aborted = True
            raise

    def _campaign(self) -> None:
        active: list[RunDriver] = []
        for _ in range(1_000_000):
            if self.storm.over():
                break
            while len(active) < RUNS_PER_WORKER:
                active.append(self._new_run())
            driver = self.pick.choice(active)
            rng = self.rngs[driver.run_id]
            step(
                self.harness,
                driver,
                rng=rng,
                runner=self.server,
                storm=self.storm,
                parent=self.parent,
            )
            if driver.closed or len(driver.ops) >= FAULTY_OPS:
                active.remove(driver)
                self._finish(driver)
        for driver in active:
            self._finish(driver)

    def _new_run(self) -> RunDriver:
        self.serial += 1
        seed = trial_seed(self.seed, self.segment, self.index, self.serial)
        driver = self.harness.driver("s", seed=seed)
        self.rngs[driver.run_id] = random.Random(seed)
        return driver

    def _finish(self, driver: RunDriver) -> None:
        ended = drive(driver, self.server, max_ops=CLOSING_OPS)
        self.storm.settle(self.harness, driver, ended)
        del self.rngs[driver.run_id]


def step(
    harness: CrashHarness,
    driver: RunDriver,
    *,
    rng: random.Random,
    runner: Runner,
    storm: Storm,
    parent: ParentFaults,
) -> None:
    """One operation of a storm trial, with the fault its generator chooses."""
    op = str(driver.next_command()["op"])
    postgres = harness.backend == "postgresql"
    fault = choose_fault(rng, driver, op, storm.plan, postgres)
    driver.advance(runner, fault, parent)
    storm.count(fault_kind(driver.replies[-1], fault))


def storm(
    harness: CrashHarness, kills: int, seed: int, max_seconds: float, restarts: int
) -> Report:
    started = time.monotonic()
    report = Report("random SIGKILLs", harness.backend, seed=seed)
    restarts = restarts if harness.pg_restart is not None else 0
    with harness.servers(harness.workers) as servers:
        state = Storm(harness.dry_run(servers[0], report), report, 0, started + max_seconds)
        workers = [Worker(harness, state, i, s, seed) for i, s in enumerate(servers)]
        for segment in range(restarts + 1):
            if segment:
                _restart_trial(harness, servers[0], state, seed, segment)
            state.kills_wanted = math.ceil(kills * (segment + 1) / (restarts + 1))
            with ThreadPoolExecutor(len(workers)) as pool:
                for future in [pool.submit(w.campaign, segment) for w in workers]:
                    future.result()
        errors = [e for w in workers for e in w.parent.errors]
    state.conclude(harness)
    report.notes += [f"a database fault failed: {e}" for e in errors[:10]]
    report.seconds = time.monotonic() - started
    if state.kills() < kills:
        report.notes.append(f"stopped at {max_seconds:.0f} s after {state.kills()} kills")
    return report


def _restart_trial(
    harness: CrashHarness, server: ForkServer, state: Storm, seed: int, segment: int
) -> None:
    """A run whose pass sees the server restarted under it, then is driven to its end."""
    rng = random.Random(f"{seed}/restart/{segment}")
    driver = harness.driver("r")
    delay = rng.uniform(0.0, 0.3 * state.plan.seconds.get("run", 0.05))  # early: mid-pass
    parent = harness.parent_faults(0)
    driver.advance(server, Fault(restart_after=delay), parent)
    if parent.errors:
        state.report.notes += [f"a server restart failed: {e}" for e in parent.errors]
    else:
        state.count("server restarts")
    state.settle(harness, driver, drive(driver, server, max_ops=CLOSING_OPS))


# -- replay ----------------------------------------------------------------------------


def replay(harness: CrashHarness, seed: int | None, case: str | None) -> Report:
    started = time.monotonic()
    report = Report("replay", harness.backend, seed=seed)
    with harness.servers(2 if case and case.startswith("race:") else 1) as servers:
        plan = harness.dry_run(servers[0], report)
        state = Storm(plan, report, 1 << 30, time.monotonic() + harness.timeout)
        if case is not None and case.startswith("race:"):
            from ._race import race_trial

            race_trial(harness, servers, plan, case, report)
        elif case is not None:
            driver, ended = run_case(harness, servers[0], case)
            state.count("SIGKILL at a crash point" if any(o.killed for o in driver.ops) else None)
            state.settle(harness, driver, ended)
        else:
            assert seed is not None
            driver, rng = harness.driver("replay", seed=seed), random.Random(seed)
            parent = harness.parent_faults(0)
            for _ in range(FAULTY_OPS):
                if driver.closed:
                    break
                step(harness, driver, rng=rng, runner=servers[0], storm=state, parent=parent)
            state.settle(harness, driver, drive(driver, servers[0], max_ops=CLOSING_OPS))
    state.conclude(harness)
    report.seconds = time.monotonic() - started
    return report
