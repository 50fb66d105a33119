"""People racing passes: approvals and resolutions against a replaying pass, abandon
against a pass that drives the run.

A decision trial submits a run, drives it until it waits for a person
(suspended for an approval, uncertain for a resolution: the pass is killed
inside a non-idempotent tool first), then races the person's decision against
a pass that resumes the run, in one of these orders (the trial's generator
chooses, and whether the person decides through the API or the ``asiento``
command, and whether the deciding process is killed):

- ``snapshot``: the pass has read the journal and is stopped (SIGSTOP) before it
  writes anything; the person decides; the pass goes on with its older view;
- ``expired`` (resolutions): the same, the pass's lease running out while it is
  stopped, so the person's write takes the lease over;
- ``dead`` (resolutions): the stopped pass is killed holding a live lease: the
  person must not be refused for a holder that is provably dead;
- ``free``: both at once, the person a random delay later.

Then a worker drains the store and the supervisor drives the run to its end.
The race is one operation of kind ``race`` in the run's history, so the oracle
holds it to what must hold whatever the order (``index_follows``: a decision is
never overwritten, the run stays claimable or driven; ``approved_first``;
``effect_once``).

An abandon trial stops a pass at a model request or inside a tool, abandons
the run (API or command, sometimes killed), then lets the pass go on: once
abandoning returned, the pass writes nothing and starts no effect
(``abandon_stops``), the run is closed and no worker claims it.
"""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._drive import KILLED, Fault, RunDriver, drive
from ._files import read_lines
from ._race import WAIT, _poll, _release, _state
from ._server import ForkServer, HarnessError
from .invariants import Op, Violation, index_contradiction
from .report import Report

if TYPE_CHECKING:
    from .harness import CrashHarness, Plan

STALE_TTL = 0.3  # seconds: the lease of a pass whose lease must run out while it is stopped
ORDERS = {
    "approve": ("snapshot", "free"),
    "resolve": ("snapshot", "expired", "dead", "free"),
}
# The person's crash points: inside the commit of the decision, and (approvals) just before.
PERSON_POINTS = {"approve": ("during_approval", "inside_commit@1"), "resolve": ("inside_commit@1",)}


@dataclass(frozen=True, slots=True)
class Trial:
    """What one decision trial does: who decides, how, in which order, with which fault."""

    kind: str
    order: str
    via: str
    fault: Fault
    delay: float = 0.0

    def label(self) -> str:
        fault = self.fault.label() or "no fault"
        return f"{self.kind} via {self.via}, {self.order}, person: {fault}"


def choose_trial(
    rng: random.Random,
    kind: str,
    seconds: float,
    orders: tuple[str, ...] | None = None,
    person_faults: bool = True,
) -> Trial:
    order = rng.choice(orders or ORDERS[kind])
    via = rng.choice(("api", "cli"))
    dice = rng.random() if person_faults else 1.0
    if dice < 0.2:
        fault = Fault(crash=rng.choice(PERSON_POINTS[kind]))
    elif dice < 0.4:
        fault = Fault(kill_after=rng.uniform(0.0, seconds))
    else:
        fault = Fault()
    return Trial(kind, order, via, fault, rng.uniform(0.0, seconds) if order == "free" else 0.0)


def decision_race(
    harness: CrashHarness,
    trials: int,
    seed: int,
    kinds: tuple[str, ...] = ("approve", "resolve"),
    *,
    orders: tuple[str, ...] | None = None,
    person_faults: bool = True,
) -> Report:
    """``trials`` races of each kind of decision against a resuming pass (``orders``:
    only those; ``person_faults``: the deciding process may be killed)."""
    rng = random.Random(seed)
    with harness.race("decision races", seed) as (servers, plan, report):
        seconds = max(plan.seconds.values(), default=0.05)
        for kind in kinds:
            for _ in range(trials):
                allowed = tuple(o for o in ORDERS[kind] if orders is None or o in orders)
                trial = choose_trial(rng, kind, seconds, allowed, person_faults)
                decision_trial(harness, servers, plan, trial, report)
    return report


def decision_trial(
    harness: CrashHarness, servers: list[ForkServer], plan: Plan, trial: Trial, report: Report
) -> None:
    driver = harness.driver(trial.kind, case=trial.label())
    driver.advance(servers[0], extra={"op": "submit"})
    _until_waiting(driver, servers[0], trial.kind)
    waiting = driver.next_command()
    if waiting["op"] != trial.kind:
        report.notes.append(f"{driver.run_id}: never waited for a person ({driver.last})")
    else:
        person = waiting | trial.fault.command() | {"via": trial.via, "may_refuse": True}
        _race(harness, driver, servers, trial, person)
        report.faults[f"{trial.kind} races ({trial.order})"] += 1
        refused = (driver.ops[-1].out or {}).get("person") == "refused"
        if refused and trial.order == "dead":
            message = f"{trial.kind} refused for a holder that is provably dead"
            report.violations.append(
                harness.with_replay(Violation("run_ends", driver.run_id, message, case=driver.case))
            )
        elif refused:
            report.faults[f"{trial.kind}s refused while a live pass held the run"] += 1
    driver.advance(servers[1], extra={"op": "work", "max_seconds": 30.0})
    ended = drive(driver, servers[0], max_ops=harness.max_ops)
    harness.check_histories(report, [driver.history(ended=ended)], plan)
    report.trials += 1


def _until_waiting(driver: RunDriver, server: ForkServer, kind: str) -> None:
    """Drive the run until it waits for the person's ``kind`` of decision."""
    if kind == "resolve":  # killed inside the non-idempotent send: the next pass is uncertain
        driver.advance(server, Fault(crash="inside_tool@2"))
    for _ in range(6):
        if driver.next_command()["op"] == kind or driver.closed:
            return
        driver.advance(server)


def _race(
    harness: CrashHarness,
    driver: RunDriver,
    servers: list[ForkServer],
    trial: Trial,
    person: dict[str, Any],
) -> None:
    """The pass and the person, in the trial's order; one operation of kind ``race``."""
    run_id, reader = driver.run_id, harness.reader
    before, status = reader.journal(run_id), reader.run_row(run_id)[0]
    effects_at, models_at = (len(read_lines(p)) for p in driver.ledgers)
    mark = harness.workdir / f"{run_id}.pass.stopped"
    pass_cmd: dict[str, Any] = {"op": "run", "run": run_id, "pause_after_load": str(mark)}
    if trial.order == "expired":
        pass_cmd["lease_ttl"] = STALE_TTL
    if trial.order == "free":
        pass_cmd.pop("pause_after_load")
    started = time.time()
    pids: list[int] = []
    with ThreadPoolExecutor(2) as pool:
        try:
            the_pass = pool.submit(servers[0], pass_cmd)
            if trial.order == "free":
                time.sleep(trial.delay)
                decided = servers[1](person)
            else:
                pids.append(_stopped_at(mark, the_pass))
                if trial.order == "expired":
                    _wait_expired(harness, run_id)
                if trial.order == "dead":
                    os.kill(pids[0], signal.SIGKILL)
                decided = servers[1](person)
                _release(pids)
            reply = the_pass.result(timeout=WAIT)
        finally:
            _release(pids)
    person_out = decided.get("out") or {}
    out = {"outcome": "race", "pass": (reply.get("out") or {}).get("outcome"), "person": None}
    out["person"] = "killed" if decided.get("rc") == KILLED else person_out.get("outcome")
    op = Op("race", trial.label(), reply.get("rc"), out, before, status, effects_at, models_at,
            started)  # fmt: skip
    driver.ops.append(op)
    driver.replies.append(reply)


def _stopped_at(mark: Path, future: Future[dict[str, Any]]) -> int:
    """The pid of the pass that wrote ``mark`` and is now stopped."""
    pid = _poll(lambda: int(mark.read_text()) if mark.exists() else None, future)
    _poll(lambda: pid if _state(pid) == "T" else None, future)
    return pid


def _wait_expired(harness: CrashHarness, run_id: str) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        expires = harness.reader.run_row(run_id)[2]
        if expires is not None and expires < time.time() - 0.05:
            return
        time.sleep(0.02)
    raise HarnessError(f"run {run_id}: the stopped pass's lease never expired")


# -- abandon while driven ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AbandonRecord:
    """What a stopped pass did after a person abandoned its run, and what the person saw."""

    run_id: str
    abandoned: bool
    abandoned_at: float | None
    journal_at_abandon: Any
    journal_after_pass: Any
    status: str | None
    effects_after: list[dict[str, Any]]
    pass_outcome: dict[str, Any] | None
    case: str


def abandon_race(
    harness: CrashHarness, trials: int, seed: int, person_faults: bool = True
) -> Report:
    """``trials`` runs abandoned while a stopped pass holds them, then let go on."""
    rng = random.Random(seed)
    with harness.race("abandon while driven", seed) as (servers, plan, report):
        seconds = max(plan.seconds.values(), default=0.05)
        for _ in range(trials):
            abandon_trial(
                harness, servers, plan, rng=rng, seconds=seconds, report=report,
                person_faults=person_faults,
            )  # fmt: skip
    return report


def abandon_trial(
    harness: CrashHarness,
    servers: list[ForkServer],
    plan: Plan,
    *,
    rng: random.Random,
    seconds: float,
    report: Report,
    person_faults: bool = True,
) -> None:
    where = rng.choice(("model", "tool"))
    via = rng.choice(("api", "cli"))
    dice = rng.random() if person_faults else 1.0
    fault = Fault(crash="inside_commit@1") if dice < 0.15 else Fault()
    if 0.15 <= dice < 0.3:
        fault = Fault(kill_after=rng.uniform(0.0, seconds))
    stop_at = rng.randint(1, max(1, plan.model_calls)) if where == "model" else rng.randint(1, 2)
    case = f"abandon via {via} while stopped at {where} {stop_at}: {fault.label() or 'no fault'}"
    driver = harness.driver("abandon", case=case)
    driver.advance(servers[0], extra={"op": "submit"})
    record = _abandon_while_stopped(
        harness, driver, servers, where=where, stop_at=stop_at, via=via, fault=fault
    )
    report.violations += [harness.with_replay(v) for v in check_abandon(record)]
    report.faults[f"abandoned while stopped at a {where}"] += 1
    driver.advance(servers[1], extra={"op": "work", "max_seconds": 30.0})
    worked = driver.ops[-1].out or {}
    if record.abandoned and driver.run_id in worked.get("runs", []):
        message = "a worker claimed the run after it was abandoned"
        report.violations.append(Violation("abandon_stops", driver.run_id, message, case=case))
    ended = drive(driver, servers[0], max_ops=harness.max_ops)
    harness.check_histories(report, [driver.history(ended=ended)], plan)
    report.trials += 1


def _abandon_while_stopped(
    harness: CrashHarness,
    driver: RunDriver,
    servers: list[ForkServer],
    *,
    where: str,
    stop_at: int,
    via: str,
    fault: Fault,
) -> AbandonRecord:
    run_id, reader = driver.run_id, harness.reader
    before, status = reader.journal(run_id), reader.run_row(run_id)[0]
    effects_at, models_at = (len(read_lines(p)) for p in driver.ledgers)
    mark = harness.workdir / f"{run_id}.driver.stopped"
    cmd: dict[str, Any] = {"op": "run", "run": run_id}
    if where == "model":
        cmd |= {"pause_model": stop_at, "pause_file": str(mark)}
    else:  # inside a tool, its effect started: lookup (1) or send (2)
        cmd |= {"pause_point": f"inside_tool@{stop_at}", "pause_file": str(mark)}
    person = {"op": "abandon", "run": run_id, "via": via} | fault.command()
    started = time.time()
    pids: list[int] = []
    with ThreadPoolExecutor(1) as pool:
        try:
            the_pass = pool.submit(servers[0], cmd)
            pids.append(_stopped_at(mark, the_pass))
            decided = servers[1](person)
            at_abandon = reader.journal(run_id)
            _release(pids)
            reply = the_pass.result(timeout=WAIT)
        finally:
            _release(pids)
    after = reader.journal(run_id)
    out = decided.get("out") or {}
    abandoned = out.get("outcome") == "abandoned"
    lines = read_lines(driver.ledgers[0])[effects_at:]
    stamp = out.get("at") if abandoned else None
    late = [line for line in lines if stamp is not None and float(line.get("at", 0.0)) > stamp]
    op_out = {"outcome": "race", "pass": (reply.get("out") or {}).get("outcome")}
    op_out["person"] = "killed" if decided.get("rc") == KILLED else out.get("outcome")
    op = Op("race", driver.case, reply.get("rc"), op_out, before, status, effects_at, models_at,
            started)  # fmt: skip
    driver.ops.append(op)
    driver.replies.append(reply)
    return AbandonRecord(
        run_id=run_id,
        abandoned=abandoned,
        abandoned_at=stamp,
        journal_at_abandon=at_abandon,
        journal_after_pass=after,
        status=reader.run_row(run_id)[0],
        effects_after=late,
        pass_outcome=reply.get("out"),
        case=str(driver.case),
    )


def check_abandon(record: AbandonRecord) -> list[Violation]:
    """Once abandoning returned, the pass wrote nothing, started nothing, and said why."""
    if not record.abandoned:
        return []
    found = []
    added = [
        f"{step}/{phase}"
        for step, phases in record.journal_after_pass.items()
        for phase in phases
        if phase not in record.journal_at_abandon.get(step, {})
    ]
    if added:
        found.append(f"the pass wrote {added} after the run was abandoned")
    for line in record.effects_after:
        found.append(f"the pass started {line['tool']} for {line['step']} after the abandon")
    outcome = (record.pass_outcome or {}).get("outcome")
    if outcome not in ("abandoned", None):  # None: killed; else it must say it was abandoned
        found.append(f"the pass ended {record.pass_outcome}, not naming the abandonment")
    contradiction = index_contradiction(record.journal_after_pass, record.status)
    if contradiction is not None:
        found.append(contradiction)
    return [Violation("abandon_stops", record.run_id, m, case=record.case) for m in found]
