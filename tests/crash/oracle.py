"""The crash tests' oracle: drive children, snapshot the journal, check the invariants.

Everything checked here is read from outside the killed process: the effects
ledger, the model ledger and the journal file. A ``RunLog`` remembers, for each
operation on a run (a pass, an approval, a resolution), the journal as it was
when the operation started and where each ledger stood, so the lines an
operation added can be held against what was already recorded.

Of the two ways out of copying asiento.testing (issue 13, item 7), these tests take
the first: they drive the library's crash harness and keep a deliberately small,
independent oracle. The core's crash tests must not trust only the checker the
library ships (asiento.testing.invariants): one bug in it would hide the very bugs
both look for. So the plumbing is the harness's, used as it is: the fork-server
(``_server``, ``_fork``), the fsynced ledger files (``_files``) and what a
supervisor does next (``_drive.next_command``). What decides is this file's, written
from the contract and not copied from the library: the child's own script, whose
ledger lines name their step by the script's ``ref`` (not by asiento's idea of the
current step); crash points armed by the core's own ``ASIENTO_CRASH_AT`` (not the
harness's observer); the journal read with its own SQL; and the checks below, for
this one script, reading the step-id grammar themselves (not through
``asiento.step_ids``). The one rule taken from the library is ``with_older_records``:
which records of a killed writer may surface late (tests/crash/test_wal_recovery.py
pins down why).
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from asiento.testing import ENV_VAR, _server
from asiento.testing._drive import next_command
from asiento.testing._files import read_lines as read_ledger  # a torn line is an error
from asiento.testing.invariants import with_older_records

from .child import IDEMPOTENT, MODEL_STEPS, TOOL_STEPS, UNCERTAIN_EXIT

CHILD = Path(__file__).with_name("child.py")
KILLED = -signal.SIGKILL
CALL_TIMEOUT = 60.0
# Crash points only a tool published through an Effect passes; the child has none.
NOT_APPLICABLE = frozenset({"after_prepare", "after_publish"})

# step id -> phase -> (decision, payload, created_at)
Journal = dict[str, dict[str, tuple[str | None, dict[str, Any], float]]]
Runner = Callable[[dict[str, Any]], tuple[int, dict[str, Any] | None]]


# -- reading what survived ---------------------------------------------------------


def _connect(db: Path) -> sqlite3.Connection:
    """A reader that may recover the WAL index a killed writer left (mode=ro may not)."""
    con = sqlite3.connect(db, timeout=30)
    con.execute("PRAGMA query_only = 1")
    return con


def _rows(db: Path, sql: str, *args: str) -> list[tuple[Any, ...]]:
    """Rows from the journal file; none while no child has got as far as creating it."""
    if not db.exists():
        return []
    con = _connect(db)
    try:
        if con.execute("SELECT count(*) FROM sqlite_master WHERE name = 'runs'").fetchone()[0]:
            return con.execute(sql, args).fetchall()
        return []  # a child was killed before the schema's first commit
    finally:
        con.close()


def read_journal(db: Path, run_id: str) -> Journal:
    """The run's records, straight from the SQLite file."""
    sql = (
        "SELECT step_id, phase, decision, payload, created_at FROM journal"
        " WHERE run_id = ? ORDER BY rowid"
    )
    journal: Journal = {}
    for step, phase, decision, payload, created_at in _rows(db, sql, run_id):
        journal.setdefault(step, {})[phase] = (decision, json.loads(payload), float(created_at))
    return journal


def read_status(db: Path, run_id: str) -> str | None:
    rows = _rows(db, "SELECT status FROM runs WHERE run_id = ?", run_id)
    return str(rows[0][0]) if rows else None


def integrity(db: Path) -> str:
    """``PRAGMA integrity_check`` of the journal file: 'ok' when it is sound."""
    con = _connect(db)
    try:
        return "; ".join(str(r[0]) for r in con.execute("PRAGMA integrity_check").fetchall())
    finally:
        con.close()


def model_key(run_id: str, step: str, fp: str) -> str:
    """The documented provider key: (run_id, step_id, body fingerprint)."""
    return f"{run_id}:{step}:{fp[:32]}"


def recorded_keys(run_id: str, journal: Journal) -> set[str]:
    """The keys of the model steps whose answers the journal holds."""
    return {
        model_key(run_id, step, phases["result"][1]["fp"])
        for step, phases in journal.items()
        if step in MODEL_STEPS and "result" in phases
    }


def tried(journal: Journal, step: str) -> list[str]:
    """The ids the journal holds for attempts of tool step ``step``, first to latest:
    ``step``, then ``step/2``, ``step/3``... (the documented grammar, read here)."""
    number = {r: int(r.partition("/")[2] or 1) for r in journal if r.partition("/")[0] == step}
    return sorted(number, key=number.__getitem__)


def outcome_known(journal: Journal, step: str) -> bool:
    """A result, or a person's 'it happened', is recorded for some attempt of ``step``."""
    return any(
        "result" in phases or phases.get("resolution", (None, {}))[1].get("happened", False)
        for phases in (journal[r] for r in tried(journal, step))
    )


def uncertain_steps(journal: Journal) -> set[str]:
    """Non-idempotent attempts submitted with no result and no resolution."""
    found = set()
    for step, (tool, _) in TOOL_STEPS.items():
        latest = (tried(journal, step) or [step])[-1]
        phases = journal.get(latest, {})
        if IDEMPOTENT[tool] or "submitted" not in phases:
            continue
        if "result" not in phases and "resolution" not in phases:
            found.add(latest)
    return found


# -- running children --------------------------------------------------------------


def child_env(crash: str | None = None) -> dict[str, str]:
    """This process's environment, armed at ``crash`` only if one is given."""
    return _server.child_env({ENV_VAR: crash} if crash else {}, ())


def _argv(cmd: dict[str, Any]) -> list[str]:
    argv = [sys.executable, str(CHILD), cmd["op"], str(cmd["db"]), cmd["run"]]
    if cmd["op"] == "run":
        argv += ["--effects", str(cmd["effects"]), "--models", str(cmd["models"])]
        argv += ["--approval"] if cmd.get("approval") else []
    elif cmd["op"] == "approve":
        argv += [cmd["step"]] + (
            ["--fingerprint", cmd["fingerprint"]] if cmd.get("fingerprint") else []
        )
    else:
        argv += [cmd["step"], "--happened", "yes" if cmd["happened"] else "no"]
    return argv


def fresh_child(cmd: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
    """Run ``cmd`` in a new interpreter, armed through ASIENTO_CRASH_AT."""
    proc = subprocess.run(
        _argv(cmd),
        env=child_env(cmd.get("crash")),
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT,
        check=False,
    )
    if proc.returncode not in (0, UNCERTAIN_EXIT, KILLED):
        raise AssertionError(f"child {cmd} failed with {proc.returncode}:\n{proc.stderr}")
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, json.loads(lines[-1]) if lines else None


class ForkServer:
    """``child.py serve`` on asiento.testing's fork-server: a real process per command."""

    def __init__(self, stderr_path: Path) -> None:
        argv = [sys.executable, str(CHILD), "serve"]
        self.server = _server.ForkServer(argv, child_env(), stderr_path, CALL_TIMEOUT)
        self.stderr_tail, self.close = self.server.stderr_tail, self.server.close

    def __call__(self, cmd: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
        reply = self.server(cmd)
        if reply["rc"] not in (0, UNCERTAIN_EXIT, KILLED):
            raise AssertionError(f"child {cmd} failed with {reply['rc']}:\n{self.stderr_tail()}")
        return reply["rc"], reply["out"]


# -- one run, operation by operation -------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One operation on a run and how it ended."""

    op: str
    crash: str | None
    kill_after: float | None
    rc: int
    out: dict[str, Any] | None
    before: Journal  # the run's journal when the operation started
    status_before: str | None
    effects_at: int  # ledger lengths when it started
    models_at: int
    started: float  # time.time() when it started


@dataclass
class RunLog:
    """A run driven through a journal file, with its two ledgers and its history."""

    db: Path
    run_id: str
    effects: Path
    models: Path
    approval: bool = False
    ops: list[Op] = field(default_factory=list)

    @classmethod
    def new(cls, db: Path, run_id: str, ledgers: Path, *, approval: bool = False) -> RunLog:
        """A run whose ledgers live in ``ledgers/{run_id}.effects`` and ``.models``."""
        effects, models = ledgers / f"{run_id}.effects", ledgers / f"{run_id}.models"
        return cls(db, run_id, effects, models, approval)

    @property
    def closed(self) -> bool:
        last = self.last
        return last is not None and last.get("outcome") == "closed"

    @property
    def last(self) -> dict[str, Any] | None:
        """How the latest operation that was not killed ended (None: none, or killed)."""
        if not self.ops or self.ops[-1].rc == KILLED:
            return None
        return self.ops[-1].out

    def next_command(self) -> dict[str, Any]:
        """What a supervisor does next: run, approve what waits, or resolve what is unknown."""
        cmd = {"db": str(self.db), "run": self.run_id} | next_command(self.last or {}, self._sent)
        if cmd["op"] != "run":
            return cmd
        paths = {"effects": str(self.effects), "models": str(self.models)}
        return cmd | paths | {"approval": self.approval}

    def _sent(self, attempt: str) -> bool:
        """The effects ledger has a line for the tool step of ``attempt``: it happened."""
        return any(e["step"] == attempt.partition("/")[0] for e in self.effect_lines())

    def advance(
        self, runner: Runner, *, crash: str | None = None, kill_after: float | None = None
    ) -> Op:
        """Do the next operation in a child, armed or to be killed as asked."""
        cmd = self.next_command() | {"crash": crash, "kill_after": kill_after}
        before, status = read_journal(self.db, self.run_id), read_status(self.db, self.run_id)
        at = (len(read_ledger(self.effects)), len(read_ledger(self.models)))
        started = time.time()
        rc, out = runner(cmd)
        op = Op(cmd["op"], crash, kill_after, rc, out, before, status, *at, started)
        self.ops.append(op)
        return op

    def summary(self) -> str:
        """The run's operations, one line each, for assertion messages."""
        return "\n".join(
            f"  #{i} {op.op} crash={op.crash} kill_after={op.kill_after} -> {op.rc} {op.out}"
            for i, op in enumerate(self.ops)
        )

    def effect_lines(self) -> list[dict[str, Any]]:
        return read_ledger(self.effects)

    def model_lines(self) -> list[dict[str, Any]]:
        return read_ledger(self.models)

    def added(self, lines: list[dict[str, Any]], index: int, ledger: str) -> list[dict[str, Any]]:
        """The lines of ``ledger`` written during operation ``index``."""
        start = getattr(self.ops[index], f"{ledger}_at")
        end = (
            len(lines)
            if index + 1 == len(self.ops)
            else getattr(self.ops[index + 1], f"{ledger}_at")
        )
        return lines[start:end]


def drive(
    log: RunLog,
    runner: Runner,
    *,
    crash: str | None = None,
    target: tuple[str, int] = ("run", 1),
    max_ops: int = 16,
) -> None:
    """Supervise the run to its end, arming ``crash`` only in the ``target`` operation.

    ``target`` is (operation, n): the n-th "run" pass or the n-th "approve". After
    the run closes, one more pass checks that a closed run is only answered.
    """
    seen = 0
    for _ in range(max_ops):
        if log.closed:
            log.advance(runner)
            return
        op = log.next_command()["op"]
        seen += op == target[0]
        log.advance(runner, crash=crash if (op, seen) == target else None)
    raise AssertionError(
        f"run {log.run_id} not closed after {max_ops} operations:\n{log.summary()}"
    )


# -- the invariants ----------------------------------------------------------------

# How an operation ended -> the run's status in the index right after it.
STATUS = {
    "closed": "closed",
    "suspended": "suspended",
    "uncertain": "uncertain",
    "approved": "running",
    "resolved": "running",
}


def violations(log: RunLog) -> list[str]:
    """Every broken promise the ledgers and the journal show for this run."""
    effects, models = log.effect_lines(), log.model_lines()
    found = _no_double_effect(log, effects) + _same_request_same_key(log, models)
    for index, op in enumerate(log.ops):
        new_effects = log.added(effects, index, "effects")
        new_models = log.added(models, index, "models")
        where = f"run {log.run_id} op #{index} {op.op} crash={op.crash} kill_after={op.kill_after}"
        late = surfaced_late(log, index)
        found += [f"{where}: {v}" for v in _op_violations(log, op, new_effects, new_models, late)]
        status = log.ops[index + 1].status_before if index + 1 < len(log.ops) else None
        if op.rc != KILLED and op.out and status and status != STATUS[op.out["outcome"]]:
            found.append(f"{where}: ended {op.out['outcome']} but the run index says {status}")
    if log.closed:
        found += _closed_run(log, effects, models)
    return found


def surfaced_late(log: RunLog, index: int) -> Journal | None:
    """What operation ``index`` may have seen beyond the snapshot taken before it, or None.

    A writer SIGKILLed after writing its commit to the WAL, before publishing it in the
    WAL index, leaves a commit that connections sharing the index (the other worker's
    children) do not see, and that the next process to open the file alone recovers.
    It was never acknowledged, so nothing acted on it; the snapshot may miss it while the
    operation sees it. Records found after the operation that were created before it
    started, and that the snapshot lacked, are such commits of an earlier killed operation.
    (asiento.testing.invariants.surfaced_late is the same rule for the shipped harness.)
    """
    if not any(op.rc == KILLED for op in log.ops[:index]):
        return None
    op = log.ops[index]
    last = index + 1 == len(log.ops)
    after = read_journal(log.db, log.run_id) if last else log.ops[index + 1].before
    return cast(Journal | None, with_older_records(op.before, after, op.started))


def _no_double_effect(log: RunLog, effects: list[dict[str, Any]]) -> list[str]:
    counts = Counter((e["tool"], e["step"]) for e in effects if e["run"] == log.run_id)
    return [
        f"run {log.run_id}: non-idempotent {tool} applied {n} times for step {step}"
        for (tool, step), n in counts.items()
        if not IDEMPOTENT[tool] and n > 1
    ]


def _same_request_same_key(log: RunLog, models: list[dict[str, Any]]) -> list[str]:
    keys: dict[str, set[str]] = {}
    for line in models:
        keys.setdefault(line["key"].rsplit(":", 2)[1], set()).add(line["key"])
    return [
        f"run {log.run_id}: model step {step} was requested under {len(k)} keys {sorted(k)}"
        for step, k in keys.items()
        if len(k) > 1
    ]


def _op_violations(
    log: RunLog,
    op: Op,
    effects: list[dict[str, Any]],
    models: list[dict[str, Any]],
    late: Journal | None = None,
) -> list[str]:
    found = []
    if op.op != "run" and (effects or models):
        found.append(f"{op.op} wrote ledger lines {effects + models}")
    for e in effects:
        if outcome_known(op.before, e["step"]):
            found.append(f"{e['tool']} ran again for step {e['step']} whose outcome was recorded")
    recorded = recorded_keys(log.run_id, op.before)
    for m in models:
        if m["key"] in recorded:
            found.append(f"model key {m['key']} requested again after its answer was recorded")
    uncertain = uncertain_steps(op.before)
    # With a commit that surfaced late, a step is uncertain only if it is in both views,
    # and an UncertainEffect is justified by either.
    seen = uncertain if late is None else uncertain_steps(late)
    surely = uncertain & seen
    if surely and (effects or models):
        found.append(f"went on past uncertain {sorted(surely)}: {effects + models}")
    if op.op == "run" and op.rc != KILLED:
        found += _uncertain_iff(op, surely, uncertain | seen)
        if "final" in op.before and op.out != {"outcome": "closed", "replayed": True}:
            found.append(f"a closed run was not only answered: {op.out}")
    return found


def _uncertain_iff(op: Op, uncertain: set[str], justified: set[str]) -> list[str]:
    """UncertainEffect exactly when a non-idempotent step was submitted with no outcome."""
    stopped = op.rc == UNCERTAIN_EXIT
    if stopped and not justified:
        return [f"UncertainEffect {op.out} with no uncertain step in the journal"]
    if uncertain and not stopped:
        return [f"journal had uncertain {sorted(uncertain)} but the pass ended {op.out}"]
    if stopped and op.out is not None and op.out.get("step") not in justified:
        return [f"UncertainEffect names {op.out.get('step')}, journal says {sorted(justified)}"]
    return []


def _closed_run(
    log: RunLog, effects: list[dict[str, Any]], models: list[dict[str, Any]]
) -> list[str]:
    journal, found = read_journal(log.db, log.run_id), _tool_outcomes(log, effects)
    if "result" not in journal.get("final", {}):
        found.append(f"run {log.run_id}: closed but no final record")
    if (status := read_status(log.db, log.run_id)) != "closed":
        found.append(f"run {log.run_id}: closed but its status is {status}")
    recorded = recorded_keys(log.run_id, journal)
    missing = recorded - {m["key"] for m in models}
    if missing or len(recorded) != len(MODEL_STEPS):
        found.append(f"run {log.run_id}: model answers {sorted(recorded)}, never asked {missing}")
    return found


def _tool_outcomes(log: RunLog, effects: list[dict[str, Any]]) -> list[str]:
    """Each tool step of a closed run has an outcome and happened once (or more if idempotent)."""
    journal, found = read_journal(log.db, log.run_id), []
    counts = Counter(e["step"] for e in effects)
    for step, (tool, _) in TOOL_STEPS.items():
        if not outcome_known(journal, step):
            found.append(f"run {log.run_id}: closed with no outcome for {step}")
        if not (counts[step] >= 1 if IDEMPOTENT[tool] else counts[step] == 1):
            found.append(f"run {log.run_id}: {tool} {step} has {counts[step]} ledger lines")
        approval = journal.get(step, {}).get("approval", (None, {}))[0]
        if log.approval and tool == "send" and approval != "approved":
            found.append(f"run {log.run_id}: {step} ran without a recorded approval")
    return found
