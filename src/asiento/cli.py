"""The ``asiento`` command: the durability demo, and a look at (and a hand in) a journal.

Every command goes through the public API (``SqliteCheckpointer``, ``approve``,
``deny``, ``resolve``); none touches the database directly. Commands on a
journal never create one: a missing file is an error. Any asiento error is one
line on stderr and exit status 1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from .errors import AsientoError, UsageError
from .events import RunInfo, RunStatus, StepEvent
from .harness import approve as approve_step
from .harness import deny as deny_step
from .harness import resolve as resolve_step
from .journal import SqliteCheckpointer

T = TypeVar("T")

DEFAULT_STORE = Path("runs.db")
PAYLOAD_WIDTH = 60

store_option = click.option(
    "--store",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_STORE,
    show_default=True,
    help="The journal file (SQLite).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
by_option = click.option("--by", required=True, help="Who decides (recorded in the journal).")


class CommandError(click.ClickException):
    """One line on stderr, exit status 1, no traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def with_store(path: Path, job: Callable[[SqliteCheckpointer], Awaitable[T]]) -> T:
    """Open an existing journal, run ``job`` on it, close it; asiento errors become one line."""
    if not path.is_file():
        raise CommandError(f"no journal at {path} (nothing was created); pass --store PATH")

    async def go() -> T:
        store = SqliteCheckpointer(path)
        try:
            return await job(store)
        finally:
            await store.close()

    try:
        return asyncio.run(go())
    except AsientoError as exc:
        raise CommandError(str(exc)) from None


async def known_run(store: SqliteCheckpointer, run_id: str) -> list[StepEvent]:
    """The run's timeline; an unknown run is a usage error naming the file."""
    events = await store.load(run_id)
    if not events:
        raise UsageError(f"unknown run {run_id!r} in {store.path}")
    return events


async def run_status(store: SqliteCheckpointer, run_id: str) -> str:
    for info in await store.runs():
        if info.run_id == run_id:
            return info.status.value
    return "unknown"


def when(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="seconds")


def short(payload: Mapping[str, Any]) -> str:
    """The payload on one line, fingerprints cut to 12 characters (--json has them whole)."""
    shown = {k: v[:12] + "…" if k == "fp" and isinstance(v, str) else v for k, v in payload.items()}
    text = json.dumps(shown, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= PAYLOAD_WIDTH else text[: PAYLOAD_WIDTH - 1] + "…"


def run_json(info: RunInfo) -> dict[str, Any]:
    return {**dataclasses.asdict(info), "status": info.status.value}


def event_json(event: StepEvent) -> dict[str, Any]:
    return {
        "step_id": event.step_id,
        "phase": event.phase.value,
        "decision": None if event.decision is None else event.decision.value,
        "payload": dict(event.payload),
        "created_at": event.created_at,
    }


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, ensure_ascii=False, indent=2))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="asiento")
def main() -> None:
    """Resume LLM agents after a crash without repeating model calls or effects."""


@main.command()
@click.option(
    "--store",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Journal file to create (default: a fresh temporary file, removed afterwards).",
)
@click.option("--keep", is_flag=True, help="Keep the temporary journal and print its path.")
def demo(store: Path | None, keep: bool) -> None:
    """Kill a run with SIGKILL and resume it twice, counting every call (the seed's table)."""
    from .demo import run_demo

    if store is not None and store.exists():
        raise CommandError(f"the demo needs a fresh journal, and {store} already exists")
    raise SystemExit(run_demo(store, keep, Console(highlight=False)))


@main.command("demo-pass", hidden=True)
@click.argument("store", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("counts", type=click.Path(file_okay=False, path_type=Path))
@click.argument("number", type=int)
def demo_pass(store: Path, counts: Path, number: int) -> None:
    """One pass of the demo, in its own process (the demo runs this)."""
    from .demo import child_main

    child_main(store, counts, number)


@main.command()
@store_option
@click.option(
    "--status", type=click.Choice([s.value for s in RunStatus]), help="Only runs in this status."
)
@json_option
def runs(store: Path, status: str | None, as_json: bool) -> None:
    """List the runs in a journal, oldest first."""

    async def job(journal: SqliteCheckpointer) -> list[RunInfo]:
        return await journal.runs(status=None if status is None else RunStatus(status))

    infos = with_store(store, job)
    if as_json:
        print_json([run_json(info) for info in infos])
        return
    table = Table(title=str(store))
    longest = max((len(info.run_id) for info in infos), default=3)
    table.add_column("run", min_width=min(longest, 32), overflow="fold")
    for heading in ("status", "records", "model calls", "replayed", "updated"):
        table.add_column(heading, no_wrap=True)
    for info in infos:
        table.add_row(
            info.run_id,
            info.status.value,
            str(info.events),
            str(info.model_calls),
            str(info.replayed_calls),
            when(info.updated_at),
        )
    Console(highlight=False).print(table)


@main.command()
@click.argument("run_id", metavar="RUN")
@store_option
@json_option
def show(run_id: str, store: Path, as_json: bool) -> None:
    """Show a run's timeline: step, phase, decision and a short payload per record."""

    async def job(journal: SqliteCheckpointer) -> tuple[str, list[StepEvent]]:
        events = await known_run(journal, run_id)
        return await run_status(journal, run_id), events

    status, events = with_store(store, job)
    if as_json:
        print_json({"run_id": run_id, "status": status, "events": [event_json(e) for e in events]})
        return
    table = Table("step", "phase", "decision", "payload", title=f"run {run_id!r} · {status}")
    table.columns[3].overflow = "ellipsis"
    for event in events:
        decision = "" if event.decision is None else event.decision.value
        table.add_row(event.step_id, event.phase.value, decision, short(event.payload))
    Console(highlight=False).print(table)


@main.command()
@click.argument("run_id", metavar="RUN")
@click.argument("step_id", metavar="STEP")
@by_option
@click.option("--reason", default="", help="Why (recorded in the journal).")
@click.option("--fingerprint", help="Approve only if the frozen arguments have this fingerprint.")
@store_option
def approve(
    run_id: str, step_id: str, by: str, reason: str, fingerprint: str | None, store: Path
) -> None:
    """Approve a step awaiting approval; the next pass runs it exactly once."""

    async def job(journal: SqliteCheckpointer) -> None:
        await known_run(journal, run_id)
        await approve_step(journal, run_id, step_id, by=by, reason=reason, fingerprint=fingerprint)

    with_store(store, job)
    click.echo(f"approved run {run_id!r} step {step_id!r} (by {by}); resume the run to go on")


@main.command()
@click.argument("run_id", metavar="RUN")
@click.argument("step_id", metavar="STEP")
@by_option
@click.option("--reason", required=True, help="Why (the model is told).")
@store_option
def deny(run_id: str, step_id: str, by: str, reason: str, store: Path) -> None:
    """Deny a step awaiting approval; the model is told it was denied, and why."""

    async def job(journal: SqliteCheckpointer) -> None:
        await known_run(journal, run_id)
        await deny_step(journal, run_id, step_id, by=by, reason=reason)

    with_store(store, job)
    click.echo(f"denied run {run_id!r} step {step_id!r} (by {by}); resume the run to go on")


@main.command()
@click.argument("run_id", metavar="RUN")
@click.argument("step_id", metavar="STEP")
@click.option(
    "--happened/--not-happened",
    default=None,
    help="What you found at the destination: the effect happened, or it did not.",
)
@click.option("--remote-id", help="The destination's id for the effect, if it happened.")
@by_option
@store_option
def resolve(
    run_id: str, step_id: str, happened: bool | None, remote_id: str | None, by: str, store: Path
) -> None:
    """Record what you found about an uncertain effect, so the run can go on."""
    if happened is None:
        raise CommandError("say what you found: --happened or --not-happened")

    async def job(journal: SqliteCheckpointer) -> None:
        await known_run(journal, run_id)
        await resolve_step(journal, run_id, step_id, happened=happened, by=by, remote_id=remote_id)

    with_store(store, job)
    found = "happened" if happened else "did not happen (the next pass runs it once more)"
    click.echo(f"recorded: run {run_id!r} step {step_id!r} {found} (by {by})")
