"""What a person sees of a journal, and the checks before a person writes to it.

Shared by the ``asiento`` command and the web page (``asiento.web``), so both
show the same timeline, the same steps waiting for a person and the same
errors. Everything here reads through the ``Checkpointer`` protocol; the
writes themselves are ``asiento.approve`` / ``deny`` / ``resolve``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from .effects.records import EffectRecord, effect_records_of
from .errors import ApprovalError, JournalReadOnly, UsageError
from .events import FINAL_STEP_ID, Decision, Phase, RunInfo, RunStatus, StepEvent
from .harness import refuse_closed
from .journal.base import Checkpointer
from .journal.sqlite import SqliteCheckpointer
from .journal.url import address_of, open_address, shown
from .replay import StepState, index, step_state

DEFAULT_STORE = "runs.db"
SUMMARY_WIDTH = 90

Journal = dict[str, dict[Phase, StepEvent]]


# -- opening a journal that exists ---------------------------------------------------


def shown_url(url: str) -> str:
    """A store name fit to print: its passwords replaced by ``***`` (``journal.url.shown``)."""
    return shown(url)


async def open_existing(url: str | os.PathLike[str]) -> Checkpointer:
    """Open a journal that already exists: a missing or empty SQLite file is an error, never
    made a journal. One this process cannot write (a read-only mount) is opened read-only:
    everything can be read, and a write says why it cannot be made."""
    address = address_of(url)
    path = address.path
    if path is not None:
        _check_journal_file(path)
    try:
        return await open_address(address)
    except JournalReadOnly:
        if path is None or not path.is_file():
            raise
        return SqliteCheckpointer(path, read_only=True, timeout=address.timeout)


def _check_journal_file(path: Path) -> None:
    if not path.is_file():
        what = "is a directory, not a journal" if path.is_dir() else "(nothing was created)"
        raise UsageError(f"no journal at {path} {what}; pass --store PATH_OR_URL")
    if path.stat().st_size == 0 and not _has_wal(path):
        raise UsageError(
            f"{path} is an empty file, not a journal (it was left as it is); "
            "pass --store PATH_OR_URL"
        )


def _has_wal(path: Path) -> bool:
    wal = Path(f"{path}-wal")
    return wal.is_file() and wal.stat().st_size > 0


# -- one run --------------------------------------------------------------------------


async def find_run(store: Checkpointer, run_id: str) -> RunInfo:
    """The run's line in the index; an unknown run is a ``UsageError`` naming it."""
    for info in await store.runs():
        if info.run_id == run_id:
            return info
    raise UsageError(f"unknown run {run_id!r} in this journal; `asiento runs` lists them")


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
    kind: str
    tool: str
    args: Any
    fingerprint: str
    prepared: Any = None
    idem_key: str | None = None
    attempts: int = 0
    since: float = 0.0

    @property
    def needs_person(self) -> bool:
        return self.kind in ("approval", "resolution")


def waiting_of(events: Sequence[StepEvent], status: RunStatus) -> list[Waiting]:
    """The tool steps of a run that have no outcome yet and why, in step order.

    A closed run waits for nobody: what it had in flight is listed as such.
    """
    journal = index(events)
    closed = Phase.RESULT in journal.get(FINAL_STEP_ID, {})
    found = []
    for step_id, phases in journal.items():
        if Phase.INTENT not in phases or "/" in step_id:
            continue
        state = step_state(journal, step_id)
        kind = _awaits(state.records, status, closed=closed)
        if kind is not None:
            latest = max(e.created_at for e in state.records.values())
            found.append(_waiting(state.records[Phase.INTENT], state, kind, latest))
    return found


def _awaits(records: Mapping[Phase, StepEvent], status: RunStatus, *, closed: bool) -> str | None:
    if Phase.SUBMITTED in records and not {Phase.RESULT, Phase.RESOLUTION} & records.keys():
        return "resolution" if status == RunStatus.UNCERTAIN and not closed else "in_flight"
    if closed:
        return None
    if records[Phase.INTENT].decision == Decision.REQUIRE_APPROVAL and (
        Phase.APPROVAL not in records
    ):
        return "approval"
    return None


def _waiting(intent: StepEvent, state: StepState, kind: str, since: float) -> Waiting:
    payload = intent.payload
    return Waiting(
        run_id=intent.run_id,
        step_id=state.step_id,
        record_id=state.current_id,
        kind=kind,
        tool=str(payload.get("tool", "")),
        args=payload.get("args", {}),
        fingerprint=str(payload.get("fp", "")),
        prepared=payload.get("prepared"),
        idem_key=payload.get("idem_key"),
        attempts=state.attempt if Phase.SUBMITTED in state.records else state.attempt - 1,
        since=since,
    )


async def awaiting_decision(store: Checkpointer, run_id: str, step_id: str) -> Waiting:
    """The step a person is about to approve or deny, or an ``ApprovalError`` saying why not."""
    info = await find_run(store, run_id)
    records = {e.phase: e for e in await store.load_step(run_id, step_id)}
    where = f"run {run_id!r} step {step_id!r}"
    if not records:
        raise UsageError(f"run {run_id!r} has no step {step_id!r}; `asiento show` lists its steps")
    await refuse_closed(store, run_id, "approved or denied")
    decided = records.get(Phase.APPROVAL)
    if decided is not None:
        raise ApprovalError(f"{where} was already {decided_by(decided)}; nothing was recorded")
    for waiting in waiting_of(await store.load(run_id), info.status):
        if waiting.step_id == step_id and waiting.kind == "approval":
            return waiting
    raise ApprovalError(f"{where} is not awaiting approval")


async def awaiting_resolution(store: Checkpointer, run_id: str, step_id: str) -> Waiting:
    """The uncertain step a person is about to resolve, or a ``UsageError`` saying why not."""
    info = await find_run(store, run_id)
    events = await store.load(run_id)
    base = step_id.split("/", 1)[0]
    if base not in index(events):
        raise UsageError(f"run {run_id!r} has no step {step_id!r}; `asiento show` lists its steps")
    await refuse_closed(store, run_id, "resolved")
    for waiting in waiting_of(events, info.status):
        if waiting.step_id == base and waiting.kind != "approval":
            return waiting  # whether a session drives it, resolve() asks under the lease
    raise UsageError(
        f"run {run_id!r} step {step_id!r} is not uncertain (submitted with no recorded outcome)"
    )


def decided_by(approval: StepEvent) -> str:
    """``approved by ana at 12:00:01 (reason)``, from an approval record."""
    verb = "approved" if approval.decision == Decision.APPROVED else "denied"
    who = approval.payload.get("by") or "someone"
    why = approval.payload.get("reason")
    return f"{verb} by {who} at {when(approval.created_at)}" + (f" ({why})" if why else "")


def call_lines(waiting: Waiting) -> str:
    """The exact call a person decides about: tool, frozen arguments, payload, key, fingerprint."""
    lines = [f"  tool         {waiting.tool}"]
    lines.append(f"  arguments    {json.dumps(waiting.args, ensure_ascii=False, sort_keys=True)}")
    if waiting.prepared is not None:
        lines.append(f"  prepared     {json.dumps(waiting.prepared, ensure_ascii=False)}")
    if waiting.idem_key:
        lines.append(f"  idem_key     {waiting.idem_key}")
    lines.append(f"  fingerprint  {waiting.fingerprint}")
    return "\n".join(lines)


def load_target(target: str) -> object:
    """``module:attr``, imported with the current directory first on the path."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError("takes MODULE:ATTR (e.g. myagents:app)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import {module_name!r}: {exc}") from None
    try:
        found: object = getattr(module, attr)
    except AttributeError:
        raise UsageError(f"module {module_name!r} has no {attr!r}") from None
    return found


# -- one line per record ----------------------------------------------------------------


def summary(event: StepEvent) -> str:
    """What a record says, on one line, for a person (the JSON has everything)."""
    payload = event.payload
    if event.step_id == FINAL_STEP_ID:
        return f"closed after {payload.get('step')}: {_text(payload.get('text'))}"
    if event.phase == Phase.RESULT and "response" in payload:
        return _model_summary(payload["response"])
    if event.phase == Phase.INTENT:
        return _call(payload.get("tool"), payload.get("args")) + _key(payload)
    if event.phase == Phase.APPROVAL:
        return decided_by(event)
    if event.phase == Phase.SUBMITTED:
        return "submitted: made durable just before the tool ran"
    if event.phase == Phase.RESOLUTION:
        return _resolution_summary(payload)
    return _result_summary(payload)


def _model_summary(response: Mapping[str, Any]) -> str:
    calls = [_call(c.get("name"), c.get("arguments")) for c in response.get("tool_calls", ())]
    said = f"says {_text(response.get('text'))}" if response.get("text") else ""
    asks = f"asks {', '.join(calls)}" if calls else ""
    usage = response.get("usage")
    read, written = response.get("cache", (0, 0))
    cached = f", {read} from cache" if read else ""
    cached += f", {written} written to cache" if written else ""
    tokens = f" [{usage[0]}+{usage[1]} tokens{cached}]" if usage else ""
    return "; ".join(part for part in (said, asks) if part) + tokens


def _result_summary(payload: Mapping[str, Any]) -> str:
    status = payload.get("status")
    remote = f" remote_id={payload['remote_id']}" if payload.get("remote_id") else ""
    if status == "ok":
        return f"ok: {_json(payload.get('value'))}{remote}"
    if status == "denied":
        return f"denied by {payload.get('by')}: {payload.get('reason')}"
    return f"{status}: {payload.get('error')}"


def _resolution_summary(payload: Mapping[str, Any]) -> str:
    who = payload.get("by") or "someone"
    why = f" ({payload['reason']})" if payload.get("reason") else ""
    if payload.get("happened"):
        remote = f", remote_id={payload['remote_id']}" if payload.get("remote_id") else ""
        return f"a person found it happened{remote}: {who}{why}"
    return f"a person found it did not happen (it runs once more): {who}{why}"


def _call(name: Any, args: Any) -> str:
    return f"{name}({_json(args)})"


def _key(payload: Mapping[str, Any]) -> str:
    return f" key={payload['idem_key']}" if payload.get("idem_key") else ""


def _text(value: Any) -> str:
    return json.dumps(value if isinstance(value, str) else "", ensure_ascii=False)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def clip(text: str, width: int = SUMMARY_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


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


def tokens(inp: int, out: int) -> str:
    return f"{inp:,} in / {out:,} out"


def money(amount: float) -> str:
    """A cost in the currency of the run's price table (empty when no price was known)."""
    return f"{amount:.4f}" if amount else ""


# -- JSON for scripts -------------------------------------------------------------------


def run_json(info: RunInfo) -> dict[str, Any]:
    return {**dataclasses.asdict(info), "status": info.status.value, "steps": info.steps}


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
        "run": run_json(info),
        "events": [event_json(e) for e in events],
        "effects": [effect_json(r) for r in effect_records_of(events)],
        "awaiting": [waiting_json(w) for w in waiting_of(events, info.status)],
    }


# -- tables for the terminal --------------------------------------------------------------

STATUS_STYLE = {
    "running": "cyan",
    "suspended": "yellow",
    "uncertain": "bold red",
    "closed": "green",
    "parked": "magenta",
}


def status_text(status: RunStatus | str) -> Text:
    value = RunStatus(status).value
    return Text(value, style=STATUS_STYLE.get(value, ""))


RUN_COLUMNS: tuple[tuple[str, Callable[[RunInfo], RenderableType], bool], ...] = (
    # heading, cell, shown only when some run was priced
    ("status", lambda i: status_text(i.status), False),
    ("steps", lambda i: str(i.steps), False),
    ("last activity", lambda i: recent(i.updated_at), False),
    ("lease", lease_text, False),
    ("calls", lambda i: str(i.model_calls), False),
    ("tokens in/out", lambda i: f"{i.input_tokens}/{i.output_tokens}", False),
    ("cost", lambda i: money(i.cost), True),
    ("replayed", lambda i: str(i.replayed_calls), False),
    ("saved in/out", lambda i: f"{i.saved_input_tokens}/{i.saved_output_tokens}", False),
    ("saved cost", lambda i: money(i.saved_cost), True),
)


def runs_table(infos: Sequence[RunInfo], *, title: str, width: int | None = None) -> Table:
    """``asiento runs``: one row per run (the cost columns once some run was priced).

    In a terminal narrower than the table, the columns a person needs least (saved,
    replayed, cost, tokens) are left out, from the last, rather than every cell
    being cut short; ``--json`` always has them all.
    """
    priced = any(info.cost or info.saved_cost for info in infos)
    columns = [(h, cell) for h, cell, needs_price in RUN_COLUMNS if priced or not needs_price]
    table = _runs_table(infos, title, columns)
    while width is not None and _width(table) > width and columns[-1][0] not in _KEPT:
        columns.pop()
        table = _runs_table(infos, title, columns)
    return table


# The columns ``runs_table`` keeps however narrow the terminal.
_KEPT = frozenset({"status", "steps", "last activity", "lease", "calls"})


def _runs_table(
    infos: Sequence[RunInfo], title: str, columns: Sequence[tuple[str, Callable[[RunInfo], Any]]]
) -> Table:
    table = Table(title=title)
    longest = max((len(info.run_id) for info in infos), default=3)
    table.add_column("run", overflow="fold", min_width=min(longest, 16))
    for heading, _ in columns:  # a long lease holder folds; statuses, times, figures stay whole
        whole = heading != "lease"
        table.add_column(heading.replace(" ", "\n", 1), no_wrap=whole, min_width=_MIN.get(heading))
    for info in infos:
        table.add_row(info.run_id, *(cell(info) for _, cell in columns))
    return table


# Widths below which a column's cells would be cut: the longest status, a time.
_MIN = {"status": len("suspended"), "last activity": len("00:00:00"), "lease": 8}


def _width(table: Table) -> int:
    """The width ``table`` takes when nothing in it is cut."""
    measuring = Console(width=10_000)
    return measuring.measure(table).maximum


def run_view(info: RunInfo, events: Sequence[StepEvent], *, hint: str) -> list[RenderableType]:
    """``asiento show``: the header, the timeline, the effects and what the run awaits."""
    parts: list[RenderableType] = [_header(info)]
    parts.append(_timeline(info, events))
    effects = effect_records_of(events)
    if effects:
        parts.append(_effects(effects))
    parts.extend(_awaited(waiting_of(events, info.status), hint))
    return parts


def _header(info: RunInfo) -> Text:
    text = Text(f"run {info.run_id!r} · ")
    text.append_text(status_text(info.status))
    text.append(f" · {info.steps} steps · {info.events} records")
    text.append(f" · last activity {when(info.updated_at)}\n")
    text.append(f"lease: {lease_text(info) or 'free'} (fence {info.fence})\n")
    cost = f", cost {money(info.cost)}" if info.cost else ""
    cached = f", {info.cached_input_tokens:,} in from cache" if info.cached_input_tokens else ""
    cached += f", {info.cache_write_tokens:,} written to cache" if info.cache_write_tokens else ""
    saved = f", {money(info.saved_cost)}" if info.saved_cost else ""
    paid = tokens(info.input_tokens, info.output_tokens)
    text.append(
        f"model calls {info.model_calls} ({paid}{cached}{cost});"
        f" replayed {info.replayed_calls} "
        f"(saved {tokens(info.saved_input_tokens, info.saved_output_tokens)}{saved})"
    )
    if info.task is not None:
        text.append(f"\ntask {info.task!r} for agent {info.agent!r}, claimed {info.attempts}×")
    if info.reason:
        text.append(f"\nnote: {info.reason}")
    return text


def _timeline(info: RunInfo, events: Sequence[StepEvent]) -> Table:
    table = Table(title=f"timeline of {info.run_id!r}", title_justify="left")
    for heading in ("step", "phase", "decision", "at"):
        table.add_column(heading, no_wrap=True)
    table.add_column("what", overflow="fold")
    for step_id, records in timeline(events):
        for n, event in enumerate(records):
            table.add_row(
                step_id if n == 0 else "",
                event.phase.value,
                "" if event.decision is None else event.decision.value,
                when(event.created_at)[11:],
                clip(summary(event)),
            )
    if not events:
        table.add_row("", "", "", "", "no records yet: the run is queued for a worker")
    return table


def _effects(records: Sequence[EffectRecord]) -> Table:
    table = Table(title="effects", title_justify="left")
    for heading in ("step", "idem_key", "status", "remote_id", "attempts", "updated"):
        table.add_column(heading, overflow="fold")
    for r in records:
        remote = r.remote_id or ""
        table.add_row(r.step_id, r.idem_key, r.status, remote, str(r.attempts), when(r.updated_at))
    return table


def _awaited(waiting: Sequence[Waiting], hint: str) -> list[RenderableType]:
    if not waiting:
        return [Text("awaiting: nothing from a person")]
    lines: list[RenderableType] = []
    for w in waiting:
        run = shlex.quote(w.run_id)
        call = f"{w.tool}({_json(w.args)})"
        if w.kind == "approval":
            lines.append(
                Text(f"awaiting approval: {w.step_id} {call}, fingerprint {w.fingerprint}")
            )
            lines.append(Text(f"  asiento approve {run} {w.step_id} --by NAME{hint}"))
            lines.append(Text(f"  asiento deny {run} {w.step_id} --by NAME --reason WHY{hint}"))
        elif w.kind == "resolution":
            key = f", idem_key {w.idem_key}" if w.idem_key else ""
            lines.append(Text(f"awaiting a person: {w.step_id} {call} is uncertain{key}"))
            lines.append(
                Text(
                    f"  asiento resolve {run} {w.step_id} --happened [--remote-id ID] "
                    f"| --not-happened --by NAME{hint}"
                )
            )
        else:
            lines.append(Text(f"in flight: {w.step_id} {call} was submitted at {when(w.since)}"))
    return lines
