"""How the ``asiento`` command draws the views with rich: tables, statuses, a run's page."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from ..effects.records import EffectRecord, effect_records_of
from ..events import RunInfo, StepEvent
from ..views import (
    RunState,
    Waiting,
    budget_text,
    clip,
    lease_holder,
    lease_text,
    money,
    recent,
    run_state,
    summary,
    timeline,
    tokens,
    tool_in_flight,
    waiting_of,
    when,
)

STATE_STYLE = {
    "running": "cyan",
    "waiting for a worker": "blue",
    "ready to resume": "yellow",
    "suspended": "yellow",
    "uncertain": "bold red",
    "closed": "green",
    "parked": "magenta",
}


def state_text(state: RunState) -> Text:
    return Text(state.name, style=STATE_STYLE.get(state.name, ""))


def _priced(info: RunInfo) -> bool:
    return bool(info.cost or info.saved_cost)


def _always(info: RunInfo) -> bool:
    return True


RUN_COLUMNS: tuple[
    tuple[str, Callable[[RunInfo], RenderableType], Callable[[RunInfo], bool]], ...
] = (
    # heading, cell, shown only when some run is so (priced, budgeted)
    ("state", lambda i: state_text(run_state(i)), _always),
    ("steps", lambda i: str(i.steps), _always),
    ("last activity", lambda i: recent(i.updated_at), _always),
    ("lease", lease_text, _always),
    ("calls", lambda i: str(i.model_calls), _always),
    ("tokens in/out", lambda i: f"{i.input_tokens}/{i.output_tokens}", _always),
    ("cost", lambda i: money(i.cost), _priced),
    ("spent/budget", budget_text, lambda i: i.budgeted),
    ("replayed", lambda i: str(i.replayed_calls), _always),
    ("saved in/out", lambda i: f"{i.saved_input_tokens}/{i.saved_output_tokens}", _always),
    ("saved cost", lambda i: money(i.saved_cost), _priced),
)


def runs_table(infos: Sequence[RunInfo], *, title: str, width: int | None = None) -> Table:
    """``asiento runs``: one row per run (the cost columns once some run was priced).

    In a terminal narrower than the table, the columns a person needs least (saved,
    replayed, cost, tokens) are left out, from the last, rather than every cell
    being cut short; ``--json`` always has them all.
    """
    columns = [
        (h, cell) for h, cell, shown in RUN_COLUMNS if shown is _always or any(map(shown, infos))
    ]
    table = _runs_table(infos, title, columns)
    while width is not None and _width(table) > width and columns[-1][0] not in _KEPT:
        columns.pop()
        table = _runs_table(infos, title, columns)
    return table


# The columns ``runs_table`` keeps however narrow the terminal.
_KEPT = frozenset({"state", "steps", "last activity", "lease", "calls"})


def _runs_table(
    infos: Sequence[RunInfo], title: str, columns: Sequence[tuple[str, Callable[[RunInfo], Any]]]
) -> Table:
    table = Table(title=title)
    longest = max((len(info.run_id) for info in infos), default=3)
    table.add_column("run", overflow="fold", min_width=min(longest, 16))
    for heading, _ in columns:  # a lease holder or a state wraps; times and figures stay whole
        whole = heading not in ("lease", "state")
        table.add_column(heading.replace(" ", "\n", 1), no_wrap=whole, min_width=_MIN.get(heading))
    for info in infos:
        table.add_row(info.run_id, *(cell(info) for _, cell in columns))
    return table


# Widths below which a column's cells would be cut: the longest word of a state, a time.
_MIN = {"state": len("suspended"), "last activity": len("00:00:00"), "lease": 8}


def _width(table: Table) -> int:
    """The width ``table`` takes when nothing in it is cut."""
    measuring = Console(width=10_000)
    return measuring.measure(table).maximum


def run_view(info: RunInfo, events: Sequence[StepEvent], *, hint: str) -> list[RenderableType]:
    """``asiento show``: the header, the timeline, the effects and what the run awaits."""
    state = run_state(info, store_hint=hint)
    parts: list[RenderableType] = [_header(info, state)]
    if info.reason and (flying := tool_in_flight(events)) is not None:
        parts.append(Text(f"in flight: {flying}: its effect left and no outcome came back"))
    parts.append(_timeline(info, events))
    effects = effect_records_of(events)
    if effects:
        parts.append(_effects(effects))
    waiting = waiting_of(events, info.status)
    parts.extend(_awaited(waiting, hint))
    if not any(w.needs_person for w in waiting):
        parts.append(Text(f"{state.name}: {state.meaning}\nnext: {state.next}"))
    return parts


def _header(info: RunInfo, state: RunState) -> Text:
    text = Text(f"run {info.run_id!r} · ")
    text.append_text(state_text(state))
    if state.name != info.status.value:
        text.append(f" (status {info.status.value})")
    text.append(f" · {info.steps} steps · {info.events} records")
    text.append(f" · last activity {when(info.updated_at)}\n")
    holder = lease_holder(info)
    held = f", {holder}" if holder else ""
    text.append(f"lease: {lease_text(info) or 'free'}{held} (fence {info.fence})\n")
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
        call = w.call
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
