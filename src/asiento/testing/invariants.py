"""The crash harness's oracle: pure functions from what survived to broken promises.

Inputs are read from outside the killed processes: the journal as it stood
before each operation on a run (``Op.before``) and at the end, the effect
ledger (one fsynced line per real tool execution or publish, written by the
child *before* the user's code runs), the model ledger (one line per request,
as a model server counts billable generations), how each operation ended,
and, for lease races, what changed while only the stale holder could write.

The invariants (``INVARIANTS``):

- ``effect_once``: no non-idempotent effect applied twice; no tool run again
  once its outcome was recorded; nothing run past a step the journal says is
  uncertain; no tool outcome recorded as done without the tool running; an
  external destination holds each effect at most once.
- ``model_once``: no model answer that was recorded is requested again.
- ``uncertain_iff``: a pass stops with ``UncertainEffect`` if and only if the
  journal it started from holds a non-idempotent step submitted with no
  outcome that nothing can reconcile (no live idempotency key, no lookup),
  and it names that step.
- ``stale_writes_nothing``: once a lease is taken over, its old holder writes
  no record and runs no tool.
- ``integrity``: the journal is sound (``PRAGMA integrity_check`` for
  SQLite; for every backend: no ``submitted`` without its intent, and the run
  index counts the rows the journal holds).
- ``run_ends``: every pass that was not killed ends closed, suspended,
  uncertain or parked (or lost its lease, in a race) and the run index says
  so; every run is driven to such an end; a closed run is only answered.
- ``index_follows``: after every operation, killed or not, the run index does
  not contradict the journal: closed exactly when the final record is there,
  suspended only while a step awaits a person's approval, uncertain only while
  a step is submitted with no outcome. A person's decision that a pass
  overwrote with its older view breaks it: nobody would claim the run again.
- ``approved_first``: a tool step that needs approval runs only after a
  person approved exactly its frozen arguments.
- ``abandon_stops``: once abandoning a run returned, the pass that drove it
  writes nothing more, starts no effect and says it was abandoned; no worker
  claims the closed run.

Operations of kind ``race`` (a pass and a person at once) and ``work`` (a
worker draining the store) are checked by what holds whatever the order:
nothing recorded is asked or run again, the index follows the journal.

A violation is data (``Violation``), never an assert: campaigns count them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import step_ids

INVARIANTS = (
    "effect_once",
    "model_once",
    "uncertain_iff",
    "stale_writes_nothing",
    "integrity",
    "run_ends",
    "index_follows",
    "approved_first",
    "abandon_stops",
)

# decision, payload, created_at
Record = tuple[str | None, Mapping[str, Any], float]
# step id -> phase -> record
Journal = Mapping[str, Mapping[str, Record]]
Line = Mapping[str, Any]

STABLE = frozenset({"closed", "suspended", "uncertain", "parked"})
# How an operation ended -> the run's status in the index right after it.
STATUS_AFTER = {
    "closed": "closed",
    "suspended": "suspended",
    "uncertain": "uncertain",
    "approved": "running",
    "resolved": "running",
    "abandoned": "closed",
    "submitted": "running",
}
# Operations whose records or effects may interleave with another's (a race), or that
# drive whichever runs need work (a worker): only order-free checks apply to them.
CONCURRENT_OPS = frozenset({"race", "work"})
PASS_OPS = frozenset({"run", *CONCURRENT_OPS})
# Errors a pass may end with when the harness cut its database under it.
INFRA_ERRORS = frozenset({"JournalError", "JournalBusy"})


@dataclass(frozen=True, slots=True)
class ToolInfo:
    """What the oracle must know of a tool: may it repeat, and how is it reconciled."""

    idempotent: bool
    effect: bool = False
    honours_keys: bool = False
    key_ttl: float | None = None
    has_lookup: bool = False
    key_margin: float = 0.0  # the margin in force (docs/effects.md): trusted below ttl - margin

    def reconcilable(self, submitted_at: float, now: float) -> bool:
        """Whether a submitted step of this tool can be settled without a person."""
        if self.idempotent:
            return True
        if not self.effect:
            return False
        age = now - submitted_at
        key_alive = self.key_ttl is None or 0 <= age < self.key_ttl - self.key_margin
        return (self.honours_keys and key_alive) or self.has_lookup


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken promise, with what it takes to see it again."""

    invariant: str
    run_id: str | None
    message: str
    seed: int | None = None
    case: str | None = None
    replay: str | None = None

    def __str__(self) -> str:
        where = f"run {self.run_id}: " if self.run_id else ""
        again = f" [seed {self.seed}]" if self.seed is not None else ""
        again += f" [case {self.case}]" if self.case else ""
        return f"{self.invariant}: {where}{self.message}{again}"


@dataclass(frozen=True, slots=True)
class Op:
    """One operation on a run (a pass, an approval, a resolution) and how it ended."""

    op: str
    fault: str | None
    rc: int | None
    out: Mapping[str, Any] | None
    before: Journal
    status_before: str | None
    effects_at: int
    models_at: int
    started: float
    infra_fault: bool = False

    @property
    def killed(self) -> bool:
        return self.out is None

    @property
    def outcome(self) -> str | None:
        return None if self.out is None else str(self.out.get("outcome"))


@dataclass(frozen=True, slots=True)
class RunHistory:
    """A run driven to its end: its operations, its ledgers and its final journal."""

    run_id: str
    ops: Sequence[Op]
    final: Journal
    final_status: str | None
    effects: Sequence[Line]
    models: Sequence[Line]
    ended: bool = True
    seed: int | None = None
    case: str | None = None


@dataclass(frozen=True, slots=True)
class RaceRecord:
    """A lease race: a holder stopped past its lease, a successor holding the run.

    ``during`` is the journal from the moment the successor (itself stopped
    before its first write) held the lease to the moment the stale holder,
    continued, had exited; while the successor is stopped, only the stale
    holder could have written anything.
    """

    run_id: str
    stale_token: int | None
    successor_token: int | None
    journal_before: Journal
    journal_after: Journal
    stale_effects: Sequence[Line]
    stale_models: Sequence[Line]
    stale_outcome: Mapping[str, Any] | None
    case: str | None = None


# -- reading a journal -----------------------------------------------------------------


def is_tool_step(step_id: str) -> bool:
    """A tool step's own id (its first attempt), not a retry's."""
    return step_ids.is_tool(step_id) and not step_ids.is_retry(step_id)


def attempts(journal: Journal, step: str) -> list[str]:
    """The record ids of a tool step's attempts, first to latest: step, step/2, ..."""
    ids = [step]
    while step_ids.attempt(step, len(ids) + 1) in journal:
        ids.append(step_ids.attempt(step, len(ids) + 1))
    return ids


def outcome_known(journal: Journal, step: str) -> bool:
    """Some attempt of ``step`` has a result, or a person's 'it happened'."""
    for record_id in attempts(journal, step):
        phases = journal.get(record_id, {})
        if "result" in phases:
            return True
        resolution = phases.get("resolution")
        if resolution is not None and resolution[1].get("happened"):
            return True
    return False


def tool_of(journal: Journal, step: str) -> str | None:
    intent = journal.get(step, {}).get("intent")
    return None if intent is None else str(intent[1].get("tool"))


def uncertain_steps(journal: Journal, tools: Mapping[str, ToolInfo], now: float) -> set[str]:
    """Attempts submitted with no outcome that nothing but a person can settle."""
    found = set()
    for step in [s for s in journal if is_tool_step(s)]:
        info = tools.get(tool_of(journal, step) or "")
        latest = attempts(journal, step)[-1]
        phases = journal.get(latest, {})
        if info is None or "submitted" not in phases:
            continue
        if "result" in phases or "resolution" in phases:
            continue
        if not info.reconcilable(journal[step].get("submitted", phases["submitted"])[2], now):
            found.add(latest)
    return found


def model_key(run_id: str, step: str, fp: str) -> str:
    """The documented provider key: (run_id, step_id, request fingerprint)."""
    return f"{run_id}:{step}:{fp[:32]}"


def recorded_keys(run_id: str, journal: Journal) -> set[str]:
    """The keys of the model steps whose answers the journal holds."""
    return {
        model_key(run_id, step, str(phases["result"][1].get("fp", "")))
        for step, phases in journal.items()
        if step_ids.is_model(step) and "result" in phases
    }


# -- the checks --------------------------------------------------------------------------


def check_run(history: RunHistory, tools: Mapping[str, ToolInfo]) -> list[Violation]:
    """Every broken promise the ledgers and the journal show for one run."""
    found = _effects_once(history, tools) + _structure(history.run_id, history.final)
    found += _approved_first(history)
    for index, op in enumerate(history.ops):
        effects, models = _added(history, index)
        later = index + 1 < len(history.ops)
        after = history.ops[index + 1].status_before if later else history.final_status
        where = f"op #{index} {op.op} fault={op.fault}"
        contradiction = index_contradiction(
            history.ops[index + 1].before if later else history.final, after
        )
        if contradiction is not None:
            found.append(_violation(history, "index_follows", f"after {where}: {contradiction}"))
        checks = _op_checks(
            history.run_id,
            op,
            effects=effects,
            models=models,
            tools=tools,
            status_after=after,
            late=surfaced_late(history, index),
        )
        for invariant, message in checks:
            found.append(_violation(history, invariant, f"{where}: {message}"))
    found += _run_end(history, tools)
    return found


def surfaced_late(history: RunHistory, index: int) -> Journal | None:
    """What operation ``index`` may have seen beyond the oracle's snapshot, or None.

    SQLite: a writer SIGKILLed after writing its commit to the WAL, before publishing
    it in the WAL index, leaves a commit that the connections sharing that index do
    not see (the oracle's snapshot misses it), and that the next process to open the
    file alone recovers (the operation may see it). Such a commit was never
    acknowledged: nothing acted on it, and any later write overwrites it. Records
    the journal holds after the operation that were created before it started, and
    that its snapshot lacked, can only be such commits of an earlier killed operation.
    """
    if not any(op.killed for op in history.ops[:index]):
        return None
    op = history.ops[index]
    after = history.ops[index + 1].before if index + 1 < len(history.ops) else history.final
    return with_older_records(op.before, after, op.started)


def with_older_records(before: Journal, after: Journal, started: float) -> Journal | None:
    """``before`` plus the records of ``after`` created before ``started``; None if none."""
    merged = {step: dict(phases) for step, phases in before.items()}
    found = False
    for step, phases in after.items():
        for phase, record in phases.items():
            if record[2] < started and phase not in merged.get(step, {}):
                merged.setdefault(step, {})[phase] = record
                found = True
    return merged if found else None


def _violation(history: RunHistory, invariant: str, message: str) -> Violation:
    return Violation(invariant, history.run_id, message, seed=history.seed, case=history.case)


def _added(history: RunHistory, index: int) -> tuple[Sequence[Line], Sequence[Line]]:
    """The ledger lines written while operation ``index`` ran."""
    ops, op = history.ops, history.ops[index]
    last = index + 1 == len(ops)
    effects_end = len(history.effects) if last else ops[index + 1].effects_at
    models_end = len(history.models) if last else ops[index + 1].models_at
    return history.effects[op.effects_at : effects_end], history.models[op.models_at : models_end]


def _effects_once(history: RunHistory, tools: Mapping[str, ToolInfo]) -> list[Violation]:
    """Plain non-idempotent tools, and effects nothing can reconcile, ran once per step."""
    counts = Counter(
        (line["tool"], line["step"]) for line in history.effects if _counted_once(line, tools)
    )
    return [
        _violation(history, "effect_once", f"non-idempotent {tool} applied {n} times for {step}")
        for (tool, step), n in sorted(counts.items())
        if n > 1
    ]


def _counted_once(line: Line, tools: Mapping[str, ToolInfo]) -> bool:
    info = tools.get(str(line.get("tool")))
    if info is None or info.idempotent:
        return False
    if line.get("kind") == "call":
        return True
    # An effect whose destination dedups by key, or that can look itself up, may
    # publish again; the destination's own count (check_destination) judges it.
    return not info.honours_keys and not info.has_lookup


def _op_checks(
    run_id: str,
    op: Op,
    *,
    effects: Sequence[Line],
    models: Sequence[Line],
    tools: Mapping[str, ToolInfo],
    status_after: str | None,
    late: Journal | None = None,
) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    if op.op not in PASS_OPS and (effects or models):
        found.append(("effect_once", f"{op.op} ran tools or the model: {[*effects, *models]}"))
    for line in effects:
        if outcome_known(op.before, str(line["step"])):
            message = f"{line['tool']} ran again for {line['step']}, whose outcome was recorded"
            found.append(("effect_once", message))
    recorded = recorded_keys(run_id, op.before)
    for line in models:
        if line["key"] in recorded:
            found.append(("model_once", f"model key {line['key']} requested again"))
    closed = "result" in op.before.get(step_ids.FINAL, {})  # abandoned with a step in flight
    uncertain = set() if closed else uncertain_steps(op.before, tools, op.started)
    # With a commit that surfaced late, a step counts as uncertain only if it is in
    # both views, and an UncertainEffect is justified by either.
    seen = uncertain if late is None else uncertain_steps(late, tools, op.started)
    surely = uncertain & seen
    if surely and (effects or models) and op.op != "race":  # a person may settle it meanwhile
        message = f"went on past uncertain {sorted(surely)}: {[*effects, *models]}"
        found.append(("effect_once", message))
    if op.op == "run" and not op.killed:
        found += [("uncertain_iff", m) for m in _uncertain_iff(op, surely, uncertain | seen)]
        answered = op.outcome == "closed" and (op.out or {}).get("replayed")
        if step_ids.FINAL in op.before and not answered and not _excused(op):
            found.append(("run_ends", f"a closed run was not only answered: {op.out}"))
    if op.op not in CONCURRENT_OPS:
        found += [("run_ends", m) for m in _ended_well(op, status_after)]
    return found


def _uncertain_iff(op: Op, uncertain: set[str], justified: set[str]) -> list[str]:
    """UncertainEffect exactly when the journal holds an unknown step nothing can settle.

    ``justified`` may be larger than ``uncertain`` when a commit surfaced late.
    """
    stopped = op.outcome == "uncertain"
    named = (op.out or {}).get("step")
    if stopped and not justified:
        return [f"UncertainEffect for {named} with no uncertain step in the journal"]
    if stopped and named not in justified:
        return [f"UncertainEffect names {named}, the journal says {sorted(justified)}"]
    if uncertain and not stopped and not _excused(op):
        return [f"the journal had uncertain {sorted(uncertain)} but the pass ended {op.out}"]
    return []


def _excused(op: Op) -> bool:
    """A pass whose database the harness cut may fail instead of reaching its end."""
    out = op.out or {}
    return op.infra_fault and out.get("outcome") == "error" and out.get("type") in INFRA_ERRORS


def _ended_well(op: Op, status_after: str | None) -> list[str]:
    if op.killed or _excused(op) or op.outcome == "refused":
        return []
    outcome = op.outcome
    if outcome not in STATUS_AFTER:
        return [f"the operation ended {op.out}"]
    expected = STATUS_AFTER[outcome]
    if status_after is not None and status_after != expected:
        return [f"ended {outcome} but the run index says {status_after}"]
    return []


def _run_end(history: RunHistory, tools: Mapping[str, ToolInfo]) -> list[Violation]:
    found = []
    if not history.ended:
        found.append(_violation(history, "run_ends", "not driven to a stable end"))
    if history.final_status not in STABLE:
        found.append(_violation(history, "run_ends", f"ends {history.final_status}"))
    if history.final_status == "closed":
        found += _closed(history, tools)
    return found


def _closed(history: RunHistory, tools: Mapping[str, ToolInfo]) -> list[Violation]:
    """A closed run has its final record, every answer it used was asked, every tool ran."""
    final, found = history.final, []
    if "result" not in final.get(step_ids.FINAL, {}):
        found.append(_violation(history, "run_ends", "closed without a final record"))
    asked = {line["key"] for line in history.models}
    missing = recorded_keys(history.run_id, final) - asked
    if missing:
        message = f"answers recorded that the model ledger never saw asked: {sorted(missing)}"
        found.append(_violation(history, "model_once", message))
    ran = {line["step"] for line in history.effects}
    for step in [s for s in final if is_tool_step(s) and s not in ran]:
        if _done_by_itself(final, step) and tool_of(final, step) in tools:
            found.append(_violation(history, "effect_once", f"{step} recorded done, never ran"))
    return found


def _done_by_itself(journal: Journal, step: str) -> bool:
    """Some attempt of ``step`` has an 'ok' result not found by a lookup."""
    for record_id in attempts(journal, step):
        result = journal.get(record_id, {}).get("result")
        if result is not None and result[1].get("status") == "ok":
            return result[1].get("via") != "lookup"
    return False


def _approved_first(history: RunHistory) -> list[Violation]:
    """Every run of a step that needed approval came after its approval, of its arguments."""
    found = []
    for line in history.effects:
        step = str(line["step"])
        phases = history.final.get(step, {})
        intent = phases.get("intent")
        if intent is None or intent[0] != "require_approval":
            continue
        approval = phases.get("approval")
        if approval is None or approval[0] != "approved":
            message = f"{line['tool']} ran for {step}, which no person approved"
        elif approval[1].get("fp") != intent[1].get("fp"):
            message = f"{line['tool']} ran for {step}, approved for other arguments"
        elif "at" in line and float(line["at"]) < approval[2]:
            message = f"{line['tool']} ran for {step} before it was approved"
        else:
            continue
        found.append(_violation(history, "approved_first", message))
    return found


def index_contradiction(journal: Journal, status: str | None) -> str | None:
    """Why the run index's ``status`` contradicts ``journal``, or None if it does not."""
    if status is None:  # no record of the run yet
        return None
    closed = "result" in journal.get(step_ids.FINAL, {})
    if closed != (status == "closed"):
        held = "holds" if closed else "has no"
        return f"the index says {status}, and the journal {held} the final record"
    if status == "suspended" and not awaiting_approval(journal):
        return "the index says suspended, but no step awaits approval: nobody claims the run"
    if status == "uncertain" and not unsettled(journal):
        return "the index says uncertain, but every submitted step has its outcome"
    return None


def awaiting_approval(journal: Journal) -> list[str]:
    """The tool steps whose intent needs approval and that no person decided yet."""
    return [
        step
        for step, phases in journal.items()
        if is_tool_step(step)
        and "approval" not in phases
        and phases.get("intent", (None,))[0] == "require_approval"
    ]


def unsettled(journal: Journal) -> list[str]:
    """The latest attempts that were submitted and have neither a result nor a resolution."""
    found = []
    for step in [s for s in journal if is_tool_step(s)]:
        latest = attempts(journal, step)[-1]
        phases = journal.get(latest, {})
        if "submitted" in phases and not {"result", "resolution"} & phases.keys():
            found.append(latest)
    return found


def _structure(run_id: str, journal: Journal) -> list[Violation]:
    found = []
    for step, phases in journal.items():
        base = step_ids.base(step)
        if "submitted" in phases and "intent" not in journal.get(base, {}):
            found.append(Violation("integrity", run_id, f"{step} submitted without an intent"))
    return found


def check_index(
    rows_per_run: Mapping[str, int], events_per_run: Mapping[str, int]
) -> list[Violation]:
    """The run index counts exactly the rows each run has in the journal."""
    return [
        Violation(
            "integrity", run, f"the index counts {events_per_run.get(run)} events, journal {n}"
        )
        for run, n in sorted(rows_per_run.items())
        if events_per_run.get(run) != n
    ]


def check_integrity(problems: Iterable[str]) -> list[Violation]:
    """What the database's own check reported (``ok`` is no problem)."""
    return [Violation("integrity", None, p) for p in problems if p != "ok"]


def check_destination(keys: Iterable[str]) -> list[Violation]:
    """Each effect (by its business id) is at most once at its destination."""
    counts = Counter(keys)
    return [
        Violation("effect_once", None, f"the destination holds {key!r} {n} times")
        for key, n in sorted(counts.items())
        if n > 1
    ]


def check_race(race: RaceRecord) -> list[Violation]:
    """Nothing the stale holder did after the takeover reached the journal or the world."""
    found: list[str] = []
    if race.stale_token is None or race.successor_token is None:
        found.append("the race did not happen: a driver never held the lease")
    elif race.successor_token <= race.stale_token:
        found.append(f"the successor holds token {race.successor_token}, not above the stale one")
    added = _new_records(race.journal_before, race.journal_after)
    if added:
        found.append(f"the stale holder wrote {added} after the takeover")
    for line in race.stale_effects:
        found.append(f"the stale holder ran {line['tool']} for {line['step']} after the takeover")
    for line in race.stale_models:
        found.append(f"the stale holder requested {line['key']} after the takeover")
    return [Violation("stale_writes_nothing", race.run_id, m, case=race.case) for m in found]


def _new_records(before: Journal, after: Journal) -> list[str]:
    return [
        f"{step}/{phase}"
        for step, phases in after.items()
        for phase in phases
        if phase not in before.get(step, {})
    ]
