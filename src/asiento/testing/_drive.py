"""Driving one run to its end, operation by operation, as a supervisor would.

The supervisor runs the agent; when a pass suspends it approves what was
shown; when a pass stops uncertain it plays the person who checks the
destination: the effect happened if the effect ledger has a line for that
attempt. Before each operation it snapshots the journal and the ledgers,
so the oracle can hold what the operation added against what was recorded.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._files import ledger_paths, read_lines
from ._reader import Reader
from .invariants import Op, RunHistory

KILLED = -signal.SIGKILL
Runner = Callable[[Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Fault:
    """What is done to one operation: a crash point armed, a timed SIGKILL, a database cut.

    ``pg_cut`` makes the child terminate its own connections at its N-th
    ``inside_commit`` passage (after a delay, if given: around the COMMIT);
    ``pg_kill_after`` and ``restart_after`` are done by the parent while the
    child runs: terminate its connections, restart the server.
    """

    crash: str | None = None
    kill_after: float | None = None
    pg_cut: tuple[int, float | None] | None = None
    pg_kill_after: float | None = None
    restart_after: float | None = None

    @property
    def infra(self) -> bool:
        cut = self.pg_cut is not None or self.pg_kill_after is not None
        return cut or self.restart_after is not None

    def label(self) -> str | None:
        if self.crash:
            return f"crash {self.crash}"
        if self.kill_after is not None:
            return f"SIGKILL after {self.kill_after * 1000:.1f} ms"
        if self.pg_cut is not None:
            at, delay = self.pg_cut
            return f"connections cut at inside_commit@{at}" + (
                "" if delay is None else f" +{delay * 1000:.2f} ms"
            )
        if self.pg_kill_after is not None:
            return f"connections terminated after {self.pg_kill_after * 1000:.1f} ms"
        if self.restart_after is not None:
            return f"server restarted after {self.restart_after * 1000:.1f} ms"
        return None

    def command(self) -> dict[str, Any]:
        cmd: dict[str, Any] = {"crash": self.crash, "kill_after": self.kill_after}
        if self.pg_cut is not None:
            cmd["pg_cut"] = {"at": self.pg_cut[0], "delay": self.pg_cut[1]}
        return cmd


NO_FAULT = Fault()


@dataclass
class ParentFaults:
    """What the parent can do to the database while a child runs."""

    terminate: Callable[[], object] | None = None
    restart: Callable[[], object] | None = None
    errors: list[str] = field(default_factory=list)

    def during(self, fault: Fault) -> threading.Thread | None:
        """Start the parent's side of ``fault`` in a thread (join it after the operation)."""
        action: Callable[[], object] | None = None
        delay = 0.0
        if fault.pg_kill_after is not None and self.terminate is not None:
            action, delay = self.terminate, fault.pg_kill_after
        elif fault.restart_after is not None and self.restart is not None:
            action, delay = self.restart, fault.restart_after
        if action is None:
            return None
        act = action

        def later() -> None:
            time.sleep(delay)
            try:
                act()
            except Exception as exc:  # the campaign goes on; the report says it
                self.errors.append(f"{fault.label()}: {type(exc).__name__}: {exc}")

        thread = threading.Thread(target=later, daemon=True)
        thread.start()
        return thread


def next_command(last: Mapping[str, Any], happened: Callable[[str], bool]) -> dict[str, Any]:
    """What a supervisor does after an operation that ended ``last`` (empty: killed or none).

    It approves exactly what a suspended pass showed; for a step a pass stopped on as
    uncertain it records what ``happened(step)`` says the destination holds; otherwise
    it runs the agent.
    """
    if last.get("outcome") == "suspended":
        return {"op": "approve", "step": last["step"], "fingerprint": last["fingerprint"]}
    if last.get("outcome") == "uncertain":
        step = str(last["step"])
        return {"op": "resolve", "step": step, "happened": happened(step)}
    return {"op": "run"}


@dataclass
class RunDriver:
    """One run: its operations so far, and what the supervisor does next."""

    run_id: str
    reader: Reader
    workdir: Path
    seed: int | None = None
    case: str | None = None
    ops: list[Op] = field(default_factory=list)
    replies: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ledgers(self) -> tuple[Path, Path]:
        return ledger_paths(self.workdir, self.run_id)

    @property
    def last(self) -> Mapping[str, Any]:
        """How the latest operation ended; empty if it was killed (or none ran)."""
        return self.ops[-1].out or {} if self.ops else {}

    @property
    def closed(self) -> bool:
        return self.last.get("outcome") == "closed"

    def kills_in_a_row(self) -> int:
        count = 0
        for op in reversed(self.ops):
            if not op.killed:
                break
            count += 1
        return count

    def next_command(self) -> dict[str, Any]:
        """Run the agent; approve what waits; resolve what is unknown from the ledger."""
        return {"run": self.run_id} | next_command(self.last, self._happened)

    def _happened(self, attempt: str) -> bool:
        """The effect ledger has a line for ``attempt``: the destination got it."""
        return any(line.get("attempt") == attempt for line in read_lines(self.ledgers[0]))

    def advance(
        self,
        runner: Runner,
        fault: Fault = NO_FAULT,
        parent: ParentFaults | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Op:
        """Do the next operation in a child, with ``fault`` done to it."""
        cmd = self.next_command() | fault.command() | dict(extra or {})
        before = self.reader.journal(self.run_id)
        status = self.reader.run_row(self.run_id)[0]
        effects_at, models_at = (len(read_lines(p)) for p in self.ledgers)
        started = time.time()
        thread = parent.during(fault) if parent is not None else None
        try:
            reply = runner(cmd)
        finally:
            if thread is not None:
                thread.join(timeout=120)
        out = reply.get("out")
        if out is None and reply.get("rc") != KILLED:
            tail = str(reply.get("stderr", ""))[-300:]
            out = {"outcome": "error", "type": "ChildDied", "message": tail}
        op = Op(
            cmd["op"], fault.label(), reply.get("rc"), out, before, status,
            effects_at, models_at, started, infra_fault=fault.infra,
        )  # fmt: skip
        self.ops.append(op)
        self.replies.append(reply)
        return op

    def history(self, *, ended: bool) -> RunHistory:
        """The run as the oracle sees it, read now."""
        return RunHistory(
            run_id=self.run_id,
            ops=list(self.ops),
            final=self.reader.journal(self.run_id),
            final_status=self.reader.run_row(self.run_id)[0],
            effects=read_lines(self.ledgers[0]),
            models=read_lines(self.ledgers[1]),
            ended=ended,
            seed=self.seed,
            case=self.case,
        )


Chooser = Callable[[RunDriver, str], Fault]


def no_faults(driver: RunDriver, op: str) -> Fault:
    return NO_FAULT


def drive(
    driver: RunDriver,
    runner: Runner,
    choose: Chooser = no_faults,
    *,
    max_ops: int = 40,
    parent: ParentFaults | None = None,
) -> bool:
    """Supervise the run to its end (then ask a closed run once more); False if out of ops."""
    for _ in range(max_ops):
        if driver.closed:
            driver.advance(runner)
            return True
        op = str(driver.next_command()["op"])
        driver.advance(runner, choose(driver, op), parent)
    return False
