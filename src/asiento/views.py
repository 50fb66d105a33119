"""What a person sees of a journal: what waits, the timeline, one-line summaries, JSON.

The ``asiento`` command and the web page (``asiento.web``) both show runs
through these views, so they show the same timeline, the same steps waiting
for a person and the same errors; the command renders them with rich
(``asiento.cli._render``), the page with its templates. Everything here reads
through the ``Checkpointer`` protocol; the writes themselves are
``asiento.approve`` / ``deny`` / ``resolve``.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from . import step_ids
from .effects.records import EffectRecord, effect_records_of
from .errors import UsageError
from .events import Decision, Phase, RunInfo, RunStatus, StepEvent
from .journal._rules import in_flight
from .journal.base import Checkpointer
from .model import ModelResponse
from .payloads import (
    INTERRUPT,
    Approval,
    BudgetRaise,
    BudgetStop,
    Final,
    Intent,
    ModelResult,
    Outcome,
    PassMark,
    Resolution,
    StreamAttempt,
    TraceContext,
    is_model_result,
)
from .replay import StepState, Waits, index, step_state, waits_for

SUMMARY_WIDTH = 90


# -- one run --------------------------------------------------------------------------


async def find_run(store: Checkpointer, run_id: str) -> RunInfo:
    """The run's line in the index, looked up by id; an unknown run is a ``UsageError``."""
    info = await store.run(run_id)
    if info is None:
        raise UsageError(f"unknown run {run_id!r} in this journal; `asiento runs` lists them")
    return info


def timeline(events: Sequence[StepEvent]) -> list[tuple[str, list[StepEvent]]]:
    """Step by step (in the order steps first appear), phase by phase (in write order)."""
    return [(step_id, list(phases.values())) for step_id, phases in index(events).items()]


@dataclass(frozen=True, slots=True, kw_only=True)
class Waiting:
    """A tool step that waits: for a decision, for a person's finding, or for its outcome.

    ``kind`` is ``approval`` (a person approves or denies), ``resolution`` (an
    uncertain effect: a person says whether it happened) or ``in_flight``
    (submitted, no outcome yet, and the run is not marked uncertain).
    """

    run_id: str
    step_id: str
    record_id: str
    kind: Waits
    tool: str
    args: Any
    fingerprint: str
    prepared: Any = None
    idem_key: str | None = None
    attempts: int = 0
    since: float = 0.0

    @property
    def needs_person(self) -> bool:
        return self.kind in (Waits.APPROVAL, Waits.RESOLUTION)

    @property
    def is_interrupt(self) -> bool:
        """A graph's ``interrupt(value)`` waiting for a person, not a tool call: a person
        is shown the value it asks about (``args["value"]``)."""
        return is_interrupt(self.tool, self.args)

    @property
    def call(self) -> str:
        """The call a person decides about, on one line."""
        return call_text(self.tool, self.args)


def is_interrupt(tool: Any, args: Any) -> bool:
    """Whether a tool step is a LangGraph ``interrupt(value)`` (``args["value"]``)."""
    return tool == INTERRUPT and isinstance(args, dict) and set(args) == {"value"}


def waiting_of(events: Sequence[StepEvent], status: RunStatus) -> list[Waiting]:
    """The tool steps of a run that have no outcome yet and why, in step order.

    What each waits for is the replay table's judgement (``replay.waits_for``).
    """
    journal = index(events)
    closed = Phase.RESULT in journal.get(step_ids.FINAL, {})
    uncertain = status == RunStatus.UNCERTAIN
    found = []
    for step_id, phases in journal.items():
        if Phase.INTENT not in phases or step_ids.is_retry(step_id):
            continue
        if step_ids.is_budget(step_id):  # a stop on the budget, not a tool step
            continue
        state = step_state(journal, step_id)
        kind = waits_for(state.records, uncertain=uncertain, closed=closed)
        if kind is not None:
            found.append(waiting(state, kind))
    return found


def budget_stop_of(events: Sequence[StepEvent]) -> tuple[str, BudgetStop] | None:
    """The run's stop on its budget that no raise answered yet (its step id and record)."""
    journal = index(events)
    if Phase.RESULT in journal.get(step_ids.FINAL, {}):
        return None
    for step_id, phases in journal.items():
        if step_ids.is_budget(step_id) and Phase.INTENT in phases and Phase.APPROVAL not in phases:
            return step_id, BudgetStop.from_json(phases[Phase.INTENT].payload)
    return None


def tool_in_flight(events: Sequence[StepEvent]) -> str | None:
    """``tool 'pay' (step m1.t1)``: the run's tool step whose effect left and whose outcome
    never came back (``_rules.in_flight``, what a lapsed claim is blamed on); None if none."""
    record_id = in_flight((e.step_id, e.phase.value) for e in events)
    if record_id is None:
        return None
    intent = index(events).get(step_ids.base(record_id), {}).get(Phase.INTENT)
    name = "?" if intent is None else Intent.from_json(intent.payload).tool
    return f"tool {name!r} (step {record_id})"


def waiting(state: StepState, kind: Waits) -> Waiting:
    """A step as a person sees it while it waits for ``kind``."""
    intent = Intent.from_json(state.records[Phase.INTENT].payload)
    return Waiting(
        run_id=state.records[Phase.INTENT].run_id,
        step_id=state.step_id,
        record_id=state.current_id,
        kind=kind,
        tool=intent.tool,
        args=intent.args,
        fingerprint=intent.fp,
        prepared=intent.prepared,
        idem_key=intent.idem_key,
        attempts=state.attempt if Phase.SUBMITTED in state.records else state.attempt - 1,
        since=max(e.created_at for e in state.records.values()),
    )


def decided_by(approval: StepEvent) -> str:
    """``approved by ana at 12:00:01 (reason)``, from an approval record."""
    verb = "approved" if approval.decision == Decision.APPROVED else "denied"
    decided = Approval.from_json(approval.payload)
    why = f" ({decided.reason})" if decided.reason else ""
    return f"{verb} by {decided.by or 'someone'} at {when(approval.created_at)}{why}"


def call_lines(waiting: Waiting) -> str:
    """The exact call a person decides about: tool, frozen arguments, payload, key, fingerprint."""
    if waiting.is_interrupt:
        asked = json.dumps(waiting.args["value"], ensure_ascii=False, sort_keys=True)
        lines = ["  asked by     the graph's interrupt()", f"  value        {asked}"]
    else:
        lines = [f"  tool         {waiting.tool}"]
        args = json.dumps(waiting.args, ensure_ascii=False, sort_keys=True)
        lines.append(f"  arguments    {args}")
    if waiting.prepared is not None:
        lines.append(f"  prepared     {json.dumps(waiting.prepared, ensure_ascii=False)}")
    if waiting.idem_key:
        lines.append(f"  idem_key     {waiting.idem_key}")
    lines.append(f"  fingerprint  {waiting.fingerprint}")
    return "\n".join(lines)


# -- one line per record ----------------------------------------------------------------


def summary(event: StepEvent) -> str:
    """What a record says, on one line, for a person (the JSON has everything)."""
    payload = event.payload
    if event.step_id == step_ids.FINAL:
        closed = Final.from_json(payload)
        return f"closed after {closed.step}: {_text(closed.text)}"
    if step_ids.is_budget(event.step_id):
        return _budget_summary(event)
    if step_ids.is_trace(event.step_id):
        return _trace_summary(event)
    if event.phase == Phase.RESULT and is_model_result(payload):
        result = ModelResult.from_json(payload)
        repaid = f"; {result.repaid} cut stream(s) paid before it" if result.repaid else ""
        return _model_summary(result.response) + repaid
    if event.phase == Phase.INTENT:
        intent = Intent.from_json(payload)
        key = f" key={intent.idem_key}" if intent.idem_key else ""
        return call_text(intent.tool, intent.args) + key
    if event.phase == Phase.APPROVAL:
        return decided_by(event)
    if event.phase == Phase.SUBMITTED and step_ids.is_streamed(event.step_id):
        attempt = StreamAttempt.from_json(payload).attempt
        return f"streaming began (attempt {attempt}): a generation billed even if it was cut"
    if event.phase == Phase.SUBMITTED:
        return "submitted: made durable just before the tool ran"
    if event.phase == Phase.RESOLUTION:
        return _resolution_summary(Resolution.from_json(payload))
    return _outcome_summary(Outcome.from_json(payload))


def _trace_summary(event: StepEvent) -> str:
    if event.step_id == step_ids.TRACE:
        return f"trace {TraceContext.from_json(event.payload).traceparent}"
    mark = PassMark.from_json(event.payload)
    if event.phase == Phase.SUBMITTED:
        return f"traced pass began ({mark.cause or 'resumed'}) in {mark.by or 'a worker'}"
    if mark.died:
        return "traced pass died with its process (noted by the next pass)"
    return f"traced pass ended: {mark.status or 'stopped'}"


def _budget_summary(event: StepEvent) -> str:
    if event.phase == Phase.APPROVAL:
        raised = BudgetRaise.from_json(event.payload)
        limits = ", ".join(f"{k}={v:g}" for k, v in raised.limits.items())
        why = f" ({raised.reason})" if raised.reason else ""
        return f"budget raised to {limits} by {raised.by or 'someone'}{why}"
    stop = BudgetStop.from_json(event.payload)
    return (
        f"stopped on its budget before {stop.before}: {stop.limit} spent "
        f"{stop.spent.get(stop.limit, 0):g} of {stop.budget.get(stop.limit)}"
    )


def _model_summary(response: ModelResponse) -> str:
    calls = [f"{c.name}({inline_json(c.arguments)})" for c in response.tool_calls]
    said = f"says {_text(response.text)}" if response.text else ""
    asks = f"asks {', '.join(calls)}" if calls else ""
    usage = response.usage
    read, written = usage.cached_input_tokens, usage.cache_write_tokens
    cached = f", {read} from cache" if read else ""
    cached += f", {written} written to cache" if written else ""
    cached += f", {response.rate_limited} retried after 429" if response.rate_limited else ""
    tokens = f" [{usage.input_tokens}+{usage.output_tokens} tokens{cached}]"
    return "; ".join(part for part in (said, asks) if part) + tokens


def _outcome_summary(outcome: Outcome) -> str:
    remote = f" remote_id={outcome.remote_id}" if outcome.remote_id else ""
    if outcome.status == "ok":
        return f"ok: {inline_json(outcome.value)}{remote}"
    if outcome.status == "denied":
        return f"denied by {outcome.by}: {outcome.reason}"
    return f"error: {outcome.error}"


def _resolution_summary(found: Resolution) -> str:
    who = found.by or "someone"
    why = f" ({found.reason})" if found.reason else ""
    if found.happened:
        remote = f", remote_id={found.remote_id}" if found.remote_id else ""
        return f"a person found it happened{remote}: {who}{why}"
    if who == "asiento":  # the loop made it ready and knows it never started
        return f"it did not start (it runs once more){why}"
    return f"a person found it did not happen (it runs once more): {who}{why}"


def call_text(name: Any, args: Any) -> str:
    """``tool({...})``; a graph's interrupt says what it asks, not the journal's wrapping."""
    if is_interrupt(name, args):
        return f"the graph's interrupt() asks {inline_json(args['value'])}"
    return f"{name}({inline_json(args)})"


def _text(value: Any) -> str:
    return json.dumps(value if isinstance(value, str) else "", ensure_ascii=False)


def inline_json(value: Any) -> str:
    """JSON on one line, compact but for a space after each comma: a narrow terminal or
    cell wraps it between members, not inside one."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ":"))


def clip(text: str, width: int = SUMMARY_WIDTH) -> str:
    """``text`` in at most ``width`` characters, shortened with "…" at the end of a word
    (or a JSON member), not inside one, unless its last word is longer than half of it."""
    if len(text) <= width:
        return text
    head = text[: width - 1]
    if not text[width - 1].isspace():  # the cut falls inside a word: back to its start
        start = head.rfind(" ")
        if start >= width // 2:
            head = head[:start]
    return head.rstrip() + "…"


def when(timestamp: float | None) -> str:
    """Local time, to the second."""
    if timestamp is None:
        return ""
    return datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="seconds")


def recent(timestamp: float) -> str:
    """Local time; today's without the date."""
    moment = datetime.fromtimestamp(timestamp)
    if moment.date() == datetime.now().date():
        return moment.strftime("%H:%M:%S")
    return moment.strftime("%Y-%m-%d %H:%M")


def lease_live(info: RunInfo) -> bool:
    """Whether a session holds the run's lease right now."""
    return info.lease_owner is not None and (info.lease_expires or 0.0) >= time.time()


def lease_text(info: RunInfo) -> str:
    """Who holds the run, and for how long; empty when nobody does."""
    if info.lease_owner is None or info.lease_expires is None:
        return ""
    left = info.lease_expires - time.time()
    state = f"{left:.0f}s left" if left >= 0 else "expired"
    return f"{info.lease_owner[:8]} ({state})"


def lease_holder(info: RunInfo) -> str:
    """Where the lease's holder runs: "pid 4242 on worker-3"; empty when unknown."""
    if info.lease_owner is None or info.lease_pid is None or not info.lease_host:
        return ""
    return f"pid {info.lease_pid} on {info.lease_host.split('/')[0]}"


# -- what a run's state means for a person ------------------------------------------------

# The states a person sees. The stored ``RunStatus`` says ``running`` for every run
# that may go on; whether a process drives it now is the lease's to say.
RUNNING = "running"
WAITING_FOR_A_WORKER = "waiting for a worker"
READY_TO_RESUME = "ready to resume"

# state: (what it means, what to do next); {run} is the shell-quoted run id, {py} its
# Python literal, {store} the --store part of a command (empty for the default store).
_STATES: dict[str, tuple[str, str]] = {
    RUNNING: (
        "a session holds its lease: a process drives it, or was killed less than a lease "
        "ago (resuming it on the same machine takes the lease over at once)",
        "the session driving it goes on by itself",
    ),
    WAITING_FOR_A_WORKER: (
        "submitted to the workers, and no process drives it now",
        "a worker picks it up by itself (if none runs, start one with "
        "asiento worker --app MODULE:ATTR{store})",
    ),
    READY_TO_RESUME: (
        "no process drives it now (it was decided, stopped or killed since its last pass)",
        "run its agent again with the same run_id, Session({py}, gateway, store), to go on",
    ),
    RunStatus.SUSPENDED: (
        "a step waits for a person to approve or deny it",
        "approve or deny the step it awaits (asiento show {run}{store} gives the commands)",
    ),
    RunStatus.UNCERTAIN: (
        "an effect was submitted and nobody knows whether it happened",
        "check the effect's destination, then record what you found with asiento resolve "
        "{run} STEP --happened | --not-happened --by NAME{store}",
    ),
    RunStatus.PARKED: (
        "it kept failing its workers, so no worker claims it",
        "fix what made it fail (its note says what), then give it back with "
        "asiento unpark {run} --by NAME{store}",
    ),
    RunStatus.CLOSED: (
        "it answered, or a person abandoned it",
        "nothing more happens (resuming it returns what happened)",
    ),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RunState:
    """What a run's status means for a person right now, and what to do next.

    ``name`` is ``running`` only while a session holds the run's lease; a run that
    may go on and that no process drives is ``waiting for a worker`` (submitted) or
    ``ready to resume`` (a run of the user's own program). The other names are the
    stored statuses (``suspended``, ``uncertain``, ``parked``, ``closed``).
    """

    name: str
    meaning: str
    next: str

    @property
    def css(self) -> str:
        """The name as one word, for the web page's classes (``ready-to-resume``)."""
        return self.name.replace(" ", "-")


def run_state(info: RunInfo, *, store_hint: str = "") -> RunState:
    """What ``info`` means for a person: the stored status read with the lease.

    ``store_hint`` is what the suggested commands add to find the journal (such as
    `` --store runs/prod.db``). The stored ``RunStatus`` is not changed: this is a view.
    """
    name = _state_name(info)
    meaning, then = _STATES[name]
    quoted, literal = shlex.quote(info.run_id), repr(info.run_id)
    return RunState(
        name=name, meaning=meaning, next=then.format(run=quoted, py=literal, store=store_hint)
    )


def _state_name(info: RunInfo) -> str:
    if info.status != RunStatus.RUNNING:
        return info.status.value
    if lease_live(info):
        return RUNNING
    return WAITING_FOR_A_WORKER if info.task is not None else READY_TO_RESUME


def tokens(inp: int, out: int) -> str:
    return f"{inp:,} in / {out:,} out"


def money(amount: float) -> str:
    """A cost in the currency of the run's price table (empty when no price was known)."""
    return f"{amount:.4f}" if amount else ""


def budget_text(info: RunInfo) -> str:
    """What a budgeted run spent against each limit of its budget, as the index has them:
    ``3/5 calls, 1,240/10,000 tokens, 0.0120/0.5000`` (empty for a run with no budget)."""
    parts = []
    if info.budget_model_calls is not None:
        parts.append(f"{info.model_calls:,}/{info.budget_model_calls:,} calls")
    if info.budget_tokens is not None:
        spent = info.input_tokens + info.output_tokens
        parts.append(f"{spent:,}/{info.budget_tokens:,} tokens")
    if info.budget_cost is not None:
        parts.append(f"{info.cost:.4f}/{info.budget_cost:.4f}")
    return ", ".join(parts)


# -- JSON for scripts -------------------------------------------------------------------


def run_json(info: RunInfo) -> dict[str, Any]:
    """A run's line in the index, with its ``steps`` and what its state means (``state``,
    ``next``: ``run_state``); ``status`` stays the stored one."""
    state = run_state(info)
    return {
        **dataclasses.asdict(info),
        "status": info.status.value,
        "state": state.name,
        "next": state.next,
        "steps": info.steps,
    }


def event_json(event: StepEvent) -> dict[str, Any]:
    return {
        "step_id": event.step_id,
        "phase": event.phase.value,
        "decision": None if event.decision is None else event.decision.value,
        "payload": dict(event.payload),
        "created_at": event.created_at,
    }


def effect_json(record: EffectRecord) -> dict[str, Any]:
    return dataclasses.asdict(record)


def waiting_json(waiting: Waiting) -> dict[str, Any]:
    return dataclasses.asdict(waiting)


def show_json(info: RunInfo, events: Sequence[StepEvent]) -> dict[str, Any]:
    """Everything ``asiento show`` prints, as data."""
    return {
        "run_id": info.run_id,
        "status": info.status.value,
        "state": run_state(info).name,
        "run": run_json(info),
        "events": [event_json(e) for e in events],
        "effects": [effect_json(r) for r in effect_records_of(events)],
        "awaiting": [waiting_json(w) for w in waiting_of(events, info.status)],
    }


# -- tables for the terminal --------------------------------------------------------------
