"""``CrashHarness``: kill a user's own agent at every crash point and at random, then check.

    from asiento.testing import CrashHarness

    harness = CrashHarness(
        app="myapp.agents:make",        # returns (Agent, gateway); the gateway deterministic
        task="Serve customer ana",      # "{run_id}" in it is replaced by the run's id
        store="runs.db",                # or a postgresql:// URL / libpq DSN
        workdir="crash-runs",
    )
    harness.matrix().raise_if_violations()              # every crash point, every passage
    harness.storm(kills=500, seed=7).raise_if_violations()

Every operation on a run runs in a real child process (forked from a server
that imported the app once) and every kill is a real SIGKILL. The child writes
two fsynced ledgers the oracle reads from outside (see ``_instrument``), and the
oracle reads the journal with plain SQL (``_reader``); ``invariants`` holds the
checks. Violations are data: ``Report.raise_if_violations()`` turns them into a
failure, each with the command line that replays it.

Linux only: the children are forked, timed SIGKILLs wait on a pidfd, and the
lease race reads process states in /proc.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._crash import CRASH_POINTS
from ..errors import UsageError
from ._child import ChildConfig
from ._drive import ParentFaults, RunDriver, drive
from ._plants import PLANTS
from ._reader import Reader, reader_for
from ._server import ForkServer, HarnessError, child_env, serve_argv
from ._stores import backend, pg_application_name
from .invariants import (
    RunHistory,
    ToolInfo,
    Violation,
    check_destination,
    check_index,
    check_integrity,
    check_run,
)
from .report import Report, RunSummary

WORKDIR_ENV = "ASIENTO_HARNESS_WORKDIR"


@dataclass
class Plan:
    """What a clean run goes through: its operations and their crash-point passages."""

    ops: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    tools: dict[str, ToolInfo] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    model_calls: int = 0

    def points(self, op: str) -> dict[str, int]:
        """For operations of kind ``op``: each crash point and its most passages in one."""
        found: dict[str, int] = {}
        for kind, passages in self.ops:
            if kind == op:
                for name, n in passages.items():
                    found[name] = max(found.get(name, 0), n)
        return found

    def coverage(self) -> dict[str, int]:
        total = dict.fromkeys(CRASH_POINTS, 0)
        for _, passages in self.ops:
            for name, n in passages.items():
                total[name] = total.get(name, 0) + n
        return total


class CrashHarness:
    """Campaigns of real crashes against one app, on one store.

    ``plant`` names deliberate bugs to plant in the children (negative
    controls, see ``_plants``). ``destination`` returns the business ids of the
    effects an external destination holds (one per application); duplicates
    are violations. ``pg_restart`` restarts the PostgreSQL server (storms use it).
    ``env`` and ``pythonpath`` are given to the children; ``$ASIENTO_HARNESS_WORKDIR``
    names ``workdir`` for the app. ``warm_up`` (``module:function``) is called once
    in each fork-server before it forks, to load what the app loads lazily (an
    HTTP stack...), so that every child does not pay for it. ``op_seconds`` (how
    long each kind of operation takes) sets the scale of random SIGKILL delays;
    by default the first dry run measures it.
    """

    def __init__(
        self,
        app: str,
        *,
        task: str,
        store: str | os.PathLike[str],
        workdir: str | os.PathLike[str],
        plant: str | Sequence[str] = (),
        lease_ttl: float = 30.0,
        pythonpath: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        destination: Callable[[], Iterable[str]] | None = None,
        pg_restart: Callable[[], object] | None = None,
        workers: int = 2,
        timeout: float = 120.0,
        max_ops: int = 40,
        storm_kills: int = 200,
        seed: int | None = None,
        warm_up: str | None = None,
        op_seconds: Mapping[str, float] | None = None,
    ) -> None:
        self.app, self.task, self.store = app, task, os.fspath(store)
        self.plants = (plant,) if isinstance(plant, str) else tuple(plant)
        unknown = set(self.plants) - set(PLANTS)
        if unknown:
            raise UsageError(f"unknown plants {sorted(unknown)}; known: {', '.join(PLANTS)}")
        self.workdir = Path(workdir).resolve()
        (self.workdir / "ledgers").mkdir(parents=True, exist_ok=True)
        self.backend = backend(self.store)
        self.lease_ttl, self.workers = lease_ttl, workers
        self.timeout, self.max_ops = timeout, max_ops
        self.pythonpath = tuple(os.fspath(p) for p in pythonpath)
        self.env = child_env({WORKDIR_ENV: str(self.workdir), **(env or {})}, self.pythonpath)
        self.destination, self.pg_restart = destination, pg_restart
        self.storm_kills, self.seed, self.warm_up = storm_kills, seed, warm_up
        self.op_seconds = dict(op_seconds) if op_seconds else None
        self.prefix = uuid.uuid4().hex[:6]
        self.name = self._application_name()
        self.reader: Reader = reader_for(self.store, f"{self.name}-oracle")
        self._serial = 0
        self._lock = threading.Lock()

    def _application_name(self) -> str:
        given = pg_application_name(self.store) if self.backend == "postgresql" else None
        return given or f"asiento_harness_{self.prefix}"

    def close(self) -> None:
        self.reader.close()

    # -- plumbing ------------------------------------------------------------------------

    def config(self, worker: int) -> dict[str, Any]:
        return ChildConfig(
            app=self.app,
            task=self.task,
            store=self.store,
            workdir=str(self.workdir),
            plants=self.plants,
            lease_ttl=self.lease_ttl,
            application_name=f"{self.name}_w{worker}",
            warm_up=self.warm_up,
        ).to_json()

    @contextlib.contextmanager
    def race(self, name: str, seed: int) -> Iterator[tuple[list[ForkServer], Plan, Report]]:
        """A race campaign: two fork-servers, a dry run, and the report, checked and
        timed at the end (the store-wide checks included)."""
        started = time.monotonic()
        report = Report(name, self.backend, seed=seed)
        with self.servers(2) as servers:
            yield servers, self.dry_run(servers[0], report), report
        self.check_store(report)
        report.seconds = time.monotonic() - started

    @contextlib.contextmanager
    def servers(self, count: int) -> Iterator[list[ForkServer]]:
        """``count`` fork-servers, one per worker, closed at the end."""
        started: list[ForkServer] = []
        try:
            for i in range(count):
                err = self.workdir / f"server{i}.{self.prefix}.stderr"
                argv = serve_argv(self.config(i))
                started.append(ForkServer(argv, self.env, err, self.timeout))
            yield started
        finally:
            for server in started:
                server.close()

    def run_id(self, kind: str) -> str:
        with self._lock:
            self._serial += 1
            return f"{self.prefix}-{kind}{self._serial}"

    def driver(self, kind: str, *, seed: int | None = None, case: str | None = None) -> RunDriver:
        return RunDriver(self.run_id(kind), self.reader, self.workdir, seed=seed, case=case)

    def parent_faults(self, worker: int) -> ParentFaults:
        if self.backend != "postgresql":
            return ParentFaults()
        from ._child import terminate_backends

        name = f"{self.name}_w{worker}"
        return ParentFaults(
            terminate=lambda: terminate_backends(self.store, name), restart=self.pg_restart
        )

    def replay_command(self, *, seed: int | None = None, case: str | None = None) -> str:
        """The command line that replays one storm trial (``seed``) or matrix case."""
        argv = ["python", "-m", "asiento.testing", "replay", "--app", self.app]
        argv += ["--task", self.task, "--store", self.store]
        argv += [f"--plant={p}" for p in self.plants]
        argv += [f"--pythonpath={p}" for p in self.pythonpath]
        argv += [f"--warm-up={self.warm_up}"] if self.warm_up else []
        if seed is not None and self.op_seconds:
            scale = ",".join(f"{op}={t}" for op, t in sorted(self.op_seconds.items()))
            argv += [f"--op-seconds={scale}"]
        argv += ["--seed", str(seed)] if seed is not None else ["--case", str(case)]
        return " ".join(shlex.quote(a) for a in argv)

    # -- the dry run ---------------------------------------------------------------------

    def dry_run(self, server: ForkServer, report: Report) -> Plan:
        """Drive one clean run: which operations it takes, which passages each goes through."""
        described = server({"op": "describe", "run": "describe"})["out"]
        if not described or described.get("outcome") != "described":
            raise HarnessError(f"the app could not be described: {described}")
        plan = Plan(tools={k: ToolInfo(**v) for k, v in described["tools"].items()})
        driver = self.driver("dry")
        ended = drive(driver, server, max_ops=self.max_ops)
        for op, reply in zip(driver.ops, driver.replies, strict=True):
            passages = dict((op.out or {}).get("passages", {}))
            plan.ops.append((op.op, passages))
            seconds = round(float(reply.get("seconds", 0.0)), 4)
            plan.seconds[op.op] = max(plan.seconds.get(op.op, 0.0), seconds)
        # The first measure sets the time scale of random SIGKILLs for good, so that a
        # seed replays the same delays (on the command line too: see replay_command).
        self.op_seconds = self.op_seconds or dict(plan.seconds)
        plan.seconds = dict(self.op_seconds)
        if len(driver.ops) > 1:  # requests of the first pass, as the model ledger counts them
            plan.model_calls = driver.ops[1].models_at - driver.ops[0].models_at
        self.check_histories(report, [driver.history(ended=ended)], plan)
        if not ended:
            raise HarnessError(f"the clean dry run did not close: {driver.ops[-1:]}")
        return plan

    def check_histories(self, report: Report, histories: Sequence[RunHistory], plan: Plan) -> None:
        """Check each run against the invariants; add its violations and summary to ``report``."""
        for history in histories:
            found = check_run(history, plan.tools)
            report.violations += [self.with_replay(v) for v in found]
            report.operations += len(history.ops)
            ops = tuple((op.op, op.fault, op.outcome or "killed") for op in history.ops)
            report.runs.append(RunSummary(history.run_id, history.seed, history.case, ops))

    def with_replay(self, v: Violation) -> Violation:
        """``v`` with the command line that replays its trial or case."""
        if v.seed is None and v.case is None:
            return v
        command = self.replay_command(seed=v.seed, case=v.case)
        return Violation(v.invariant, v.run_id, v.message, v.seed, v.case, command)

    def check_store(self, report: Report) -> None:
        """What holds for the whole store: integrity, the index, the destination."""
        report.violations += check_integrity(self.reader.integrity())
        report.violations += check_index(*self.reader.counts())
        if self.destination is not None:
            report.violations += check_destination(self.destination())

    # -- campaigns -----------------------------------------------------------------------

    def matrix(self) -> Report:
        """Every crash point at every passage a clean run goes through, in every operation."""
        from ._campaigns import matrix

        return matrix(self)

    def storm(
        self,
        kills: int | None = None,
        *,
        seed: int | None = None,
        max_seconds: float = 120.0,
        restarts: int = 0,
    ) -> Report:
        """Random crash points and SIGKILLs at random instants, until ``kills`` landed.

        On PostgreSQL, connections are also cut (in a commit, at random instants)
        and, with ``pg_restart``, the server is restarted ``restarts`` times.
        """
        from ._campaigns import storm

        chosen = seed if seed is not None else self.seed
        return storm(
            self,
            self.storm_kills if kills is None else kills,
            chosen if chosen is not None else time.time_ns() % 2**32,
            max_seconds,
            restarts,
        )

    def lease_race(self, trials: int = 5, *, seed: int | None = None) -> Report:
        """A driver stopped past its lease, a successor takes over: the stale one writes nothing."""
        from ._race import lease_race

        chosen = seed if seed is not None else self.seed
        return lease_race(self, trials, chosen if chosen is not None else time.time_ns() % 2**32)

    def decision_race(
        self,
        trials: int = 20,
        *,
        seed: int | None = None,
        kinds: Sequence[str] = ("approve", "resolve"),
        orders: Sequence[str] | None = None,
        person_faults: bool = True,
    ) -> Report:
        """People deciding while a pass resumes the run: no decision is ever overwritten.

        ``trials`` races of each kind (approvals, resolutions), through the API and the
        ``asiento`` command, the deciding process sometimes killed (unless not
        ``person_faults``), in every order (or only ``orders``: ``snapshot``,
        ``expired``, ``dead``, ``free``); then a worker drains the store.
        """
        from ._decisions import decision_race

        chosen = seed if seed is not None else self.seed
        return decision_race(
            self,
            trials,
            chosen if chosen is not None else time.time_ns() % 2**32,
            tuple(kinds),
            orders=None if orders is None else tuple(orders),
            person_faults=person_faults,
        )

    def abandon_race(
        self, trials: int = 20, *, seed: int | None = None, person_faults: bool = True
    ) -> Report:
        """Runs abandoned while a pass drives them: once abandon returns, nothing more starts."""
        from ._decisions import abandon_race

        chosen = seed if seed is not None else self.seed
        chosen = chosen if chosen is not None else time.time_ns() % 2**32
        return abandon_race(self, trials, chosen, person_faults)

    def fsync_audit(self) -> Report:
        """Under strace: every rename of ``write_atomic`` is followed by a directory fsync."""
        from ._audit import fsync_audit

        return fsync_audit(self)

    def replay(self, seed: int | None = None, *, case: str | None = None) -> Report:
        """Drive one storm trial (by its seed) or one matrix case (``op2:inside_tool@1``) again."""
        from ._campaigns import replay

        if (seed is None) == (case is None):
            raise UsageError("replay() takes a seed or a case")
        return replay(self, seed, case)
