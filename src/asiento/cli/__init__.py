"""The ``asiento`` command: look at a journal, decide for it, and run its servers.

Every command on a journal takes ``--store PATH_OR_URL`` (an SQLite file,
``sqlite:///path.db``, ``postgresql://...`` or a libpq keyword string such as
``host=/tmp dbname=x``: whatever ``open_store`` takes; default ``./runs.db``) and goes
through the public API: ``open_store``, the ``Checkpointer`` protocol,
``approve``, ``deny``, ``resolve``. None touches the database directly, and none
creates a journal: a missing SQLite file is an error. Any error (an asiento error,
or a usage error such as a missing ``--by``) is one line on stderr and exit status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import secrets
import shlex
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource
from rich.console import Console

from .. import shutdown, views
from .._terminal import json_text, printable, scrubbed
from ..decisions import abandon as abandon_run
from ..decisions import approve as approve_step
from ..decisions import deny as deny_step
from ..decisions import pending_approval, pending_resolution, raise_budget
from ..decisions import resolve as resolve_step
from ..decisions import unpark as unpark_run
from ..errors import AsientoError, UsageError
from ..events import RunInfo, RunStatus, StepEvent
from ..gateways.quota import Quota
from ..journal.base import Checkpointer
from ..journal.url import open_existing, shown
from . import _render

T = TypeVar("T")

DEFAULT_STORE = "runs.db"

TOKEN_ENV = "ASIENTO_WEB_TOKEN"
MIN_TOKEN = 16

store_option = click.option(
    "--store",
    default=DEFAULT_STORE,
    show_default=True,
    envvar="ASIENTO_STORE",
    show_envvar=True,
    metavar="PATH_OR_URL",
    help=(
        "The journal: an SQLite file (never created), sqlite:///path.db, postgresql://... "
        "or a libpq keyword string (host=... dbname=...)."
    ),
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
by_option = click.option("--by", required=True, help="Who decides (recorded in the journal).")


class CommandError(click.ClickException):
    """One line on stderr, exit status 1, no traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def with_store(url: str, job: Callable[[Checkpointer], Awaitable[T]]) -> T:
    """Open an existing journal, run ``job`` on it, close it; asiento errors become one line."""

    async def go() -> T:
        store = await open_existing(url)
        try:
            return await job(store)
        finally:
            await store.close()

    try:
        return asyncio.run(go())
    except AsientoError as exc:
        raise CommandError(str(exc)) from None


def console() -> Console:
    return Console(highlight=False, soft_wrap=False)


def print_json(data: Any) -> None:
    click.echo(json_text(data))


def say(text: str) -> None:
    """A line for the terminal: what a model or a user wrote in it, spelled out safely."""
    click.echo(printable(text))


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


class _OneLineUsage(click.Group):
    """The ``asiento`` group: a usage error (a missing ``--by``, an unknown option or
    command) is one line and exit status 1, like every other error, not click's usage
    block and status 2. ``asiento`` alone still prints its help."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            raise _one_line(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            raise _one_line(exc) from None


def _one_line(exc: click.UsageError) -> click.ClickException:
    if isinstance(exc, click.exceptions.NoArgsIsHelpError):
        return exc  # the help it prints is what a bare `asiento` asks for
    ctx = exc.ctx
    hint = f" Try '{ctx.command_path} {ctx.help_option_names[0]}' for help." if ctx else ""
    return CommandError(exc.format_message() + hint)


@click.group(cls=_OneLineUsage, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="asiento")
def main() -> None:
    """Resume LLM agents after a crash without repeating model calls or effects.

    Look at a journal (runs, show), decide what waits for a person (approve,
    deny, resolve), and run the servers (serve, worker, gateway).
    """


# -- the demo -------------------------------------------------------------------------------


@main.command()
@click.option(
    "--store",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Journal file to create (default: a fresh temporary file, removed afterwards).",
)
@click.option("--keep", is_flag=True, help="Keep the temporary journal and print its path.")
def demo(store: Path | None, keep: bool) -> None:
    """Kill a run with SIGKILL and resume it twice, counting every call.

    Prints the seed's table, measured in real processes.
    """
    from .demo import run_demo

    if store is not None and store.exists():
        raise CommandError(f"the demo needs a fresh journal, and {store} already exists")
    raise SystemExit(run_demo(store, keep, console()))


@main.command("demo-pass", hidden=True)
@click.argument("store", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("counts", type=click.Path(file_okay=False, path_type=Path))
@click.argument("number", type=int)
def demo_pass(store: Path, counts: Path, number: int) -> None:
    """One pass of the demo, in its own process (the demo runs this)."""
    from .demo import child_main

    child_main(store, counts, number)


# -- looking -------------------------------------------------------------------------------


@main.command()
@store_option
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice([s.value for s in RunStatus]),
    help=(
        "Only runs in this stored status (running: running, ready to resume and waiting "
        "for a worker); repeat for several."
    ),
)
@json_option
def runs(store: str, statuses: tuple[str, ...], as_json: bool) -> None:
    """List the runs, oldest first, with their state, steps, lease and what they cost.

    Per run: its state (its stored status read with its lease: "running" only while
    a session holds the lease; a run that may go on and that no process drives is
    "ready to resume" or, submitted, "waiting for a worker"; else suspended,
    uncertain, parked or closed), steps (model steps plus the tool calls the model
    asked for; a retry is not a new step), last activity, the lease holder (while a
    session drives it), model calls, tokens and cost paid, "spent/budget" for a
    budgeted run (what it spent against each limit of its budget, as its journal last
    recorded it), and "replayed" / "saved": the model calls (and their tokens and
    cost) that resumed passes took from the journal instead of paying for them
    again. --json gives "status" (stored),
    "state", "next" (what to do next) and the journal records ("events").
    """

    async def job(journal: Checkpointer) -> list[RunInfo]:
        return [i for i in await journal.runs() if not statuses or i.status.value in statuses]

    infos = with_store(store, job)
    if as_json:
        print_json([views.run_json(info) for info in infos])
        return
    out = console()
    out.print(_render.runs_table(scrubbed(infos), title=shown(store), width=out.width))


@main.command()
@click.argument("run_id", metavar="RUN")
@store_option
@json_option
def show(run_id: str, store: str, as_json: bool) -> None:
    """Show a run's state, its timeline, its effects and what it awaits.

    The timeline is step by step and phase by phase, with decisions; effect
    records show idem_key, status, remote_id and attempts; the steps waiting
    for a person come last, with the command that decides each, or, when none
    waits, what the run's state means and what to do next.
    """

    async def job(journal: Checkpointer) -> tuple[RunInfo, list[StepEvent]]:
        info = await views.find_run(journal, run_id)
        return info, await journal.load(run_id)

    info, events = with_store(store, job)
    if as_json:
        print_json(views.show_json(info, events))
        return
    out = console()
    for part in _render.run_view(scrubbed(info), scrubbed(events), hint=_hint_store(store)):
        out.print(part)


def _hint_store(store: str) -> str:
    """The --store part of a suggested command, its password hidden.

    Empty when the next command finds the same store by itself: the default, or
    $ASIENTO_STORE (which may be how a password stays off the command line).
    """
    source = click.get_current_context().get_parameter_source("store")
    if store == DEFAULT_STORE or source == ParameterSource.ENVIRONMENT:
        return ""
    return f" --store {shlex.quote(shown(store))}"


# -- deciding ------------------------------------------------------------------------------


def _what_next(info: RunInfo, store: str) -> str:
    """What the run is now and what to do next, after a person's decision."""
    state = views.run_state(info, store_hint=_hint_store(store))
    return f"The run is {state.name}: {state.next}."


@main.command()
@click.argument("run_id", metavar="RUN")
@click.argument("step_id", metavar="STEP")
@by_option
@click.option("--reason", default="", help="Why (recorded in the journal).")
@click.option(
    "--fingerprint",
    help="Approve only if the frozen arguments have this fingerprint (default: the ones shown).",
)
@store_option
def approve(
    run_id: str, step_id: str, by: str, reason: str, fingerprint: str | None, store: str
) -> None:
    """Approve a step awaiting approval; the next pass runs it once.

    Approves exactly the frozen arguments it prints (their fingerprint is
    recorded). Refused when the step is not awaiting a decision or was decided
    already.
    """

    async def job(journal: Checkpointer) -> tuple[views.Waiting, RunInfo]:
        waiting = await pending_approval(journal, run_id, step_id)
        fp = fingerprint if fingerprint is not None else waiting.fingerprint
        await approve_step(journal, run_id, step_id, by=by, reason=reason, fingerprint=fp)
        return waiting, await views.find_run(journal, run_id)

    waiting, info = with_store(store, job)
    say(f"approved run {run_id!r} step {step_id!r} (by {by}); these exact arguments:")
    say(views.call_lines(waiting))
    say(_what_next(info, store))


@main.command()
@click.argument("run_id", metavar="RUN")
@click.argument("step_id", metavar="STEP")
@by_option
@click.option("--reason", required=True, help="Why (the model is told).")
@store_option
def deny(run_id: str, step_id: str, by: str, reason: str, store: str) -> None:
    """Deny a step awaiting approval; the model is told it was denied, and why.

    Refused when the step is not awaiting a decision or was decided already.
    """

    async def job(journal: Checkpointer) -> tuple[views.Waiting, RunInfo]:
        waiting = await pending_approval(journal, run_id, step_id)
        fp = waiting.fingerprint
        await deny_step(journal, run_id, step_id, by=by, reason=reason, fingerprint=fp)
        return waiting, await views.find_run(journal, run_id)

    waiting, info = with_store(store, job)
    say(f"denied run {run_id!r} step {step_id!r} (by {by}: {reason}); it asked for:")
    say(views.call_lines(waiting))
    say("The model is told about the denial when the run goes on.")
    say(_what_next(info, store))


@main.command()
@click.argument("run_id", metavar="RUN")
@click.argument("step_id", metavar="STEP")
@click.option(
    "--happened/--not-happened",
    default=None,
    help="What you found at the destination: the effect happened, or it did not.",
)
@click.option("--remote-id", help="The destination's id for the effect (with --happened).")
@by_option
@click.option("--reason", default="", help="How you know (recorded in the journal).")
@store_option
def resolve(
    run_id: str,
    step_id: str,
    happened: bool | None,
    remote_id: str | None,
    by: str,
    reason: str,
    store: str,
) -> None:
    """Record what you found about an uncertain effect, so the run can go on.

    --happened feeds the finding to the model as the step's outcome;
    --not-happened lets the next pass run the effect once more.
    """
    if happened is None:
        raise CommandError("say what you found: --happened or --not-happened")
    if remote_id is not None and not happened:
        raise CommandError("--remote-id names an effect that happened; drop it or say --happened")

    async def job(journal: Checkpointer) -> tuple[views.Waiting, RunInfo]:
        waiting = await pending_resolution(journal, run_id, step_id)
        await resolve_step(
            journal, run_id, step_id, happened=happened, by=by, remote_id=remote_id, reason=reason
        )
        return waiting, await views.find_run(journal, run_id)

    waiting, info = with_store(store, job)
    found = "happened" if happened else "did not happen (the next pass runs it once more)"
    say(f"recorded: run {run_id!r} step {step_id!r} {found} (by {by}); the effect:")
    say(views.call_lines(waiting))
    say(_what_next(info, store))


@main.command()
@click.argument("run_id", metavar="RUN")
@by_option
@click.option("--reason", required=True, help="Why the run will not go on.")
@store_option
def abandon(run_id: str, by: str, reason: str, store: str) -> None:
    """Close a run that will not go on; resuming it then does nothing.

    It takes the run's lease even from a session driving it: once this returns, no
    new effect of the run starts anywhere, and that session stops at its next
    write. A step it had in flight (submitted, no outcome recorded) is listed: it
    may or may not have happened.
    """

    async def job(journal: Checkpointer) -> list[views.Waiting]:
        await abandon_run(journal, run_id, by=by, reason=reason)
        waiting = views.waiting_of(await journal.load(run_id), RunStatus.CLOSED)
        return [w for w in waiting if w.kind != "approval"]

    in_flight = with_store(store, job)
    say(f"run {run_id!r} is closed: abandoned by {by}: {reason}")
    for waiting in in_flight:
        click.echo(
            f"step {waiting.record_id!r} ({waiting.tool}) was in flight: submitted with no "
            "recorded outcome, so it may or may not have happened; check its destination"
        )


@main.command()
@click.argument("run_id", metavar="RUN")
@by_option
@click.option("--reason", default="", help="What you changed (recorded in the run index).")
@store_option
def unpark(run_id: str, by: str, reason: str, store: str) -> None:
    """Give a parked run back to the workers, with a fresh count of claims."""

    async def job(journal: Checkpointer) -> RunInfo:
        await unpark_run(journal, run_id, by=by, reason=reason)
        return await views.find_run(journal, run_id)

    info = with_store(store, job)
    say(f"run {run_id!r} is unparked. {_what_next(info, store)}")


@main.command()
@click.argument("run_id", metavar="RUN")
@by_option
@click.option("--max-cost", type=float, default=None, help="The new cost limit.")
@click.option("--max-tokens", type=int, default=None, help="The new limit on tokens.")
@click.option("--max-model-calls", type=int, default=None, help="The new limit on model calls.")
@click.option("--reason", default="", help="Why (recorded in the journal).")
@store_option
def budget(
    run_id: str,
    by: str,
    max_cost: float | None,
    max_tokens: int | None,
    max_model_calls: int | None,
    reason: str,
    store: str,
) -> None:
    """Raise the budget of a run stopped on it; the next pass makes the new calls."""

    async def job(journal: Checkpointer) -> RunInfo:
        await raise_budget(
            journal,
            run_id,
            by=by,
            max_cost=max_cost,
            max_tokens=max_tokens,
            max_model_calls=max_model_calls,
            reason=reason,
        )
        return await views.find_run(journal, run_id)

    info = with_store(store, job)
    say(f"run {run_id!r}: budget raised. {_what_next(info, store)}")


# -- servers -------------------------------------------------------------------------------


@main.command()
@store_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", default=8765, show_default=True, type=int, help="Port (0: any free one, printed)."
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help="Another Host name the page answers to (behind a proxy); repeat for several.",
)
@click.option(
    "--open-reading",
    is_flag=True,
    help=(
        "Let anyone on this machine read the page without the token: only on a "
        "loopback --host, not with --allowed-host. Writing still needs the token."
    ),
)
def serve(
    store: str, host: str, port: int, allowed_hosts: tuple[str, ...], open_reading: bool
) -> None:
    """Serve the web page for operators: runs, timelines, decisions.

    Approve, deny and resolve buttons write the same records as the commands;
    /api/runs and /api/runs/RUN answer what runs --json and show --json print.

    Needs the web extra (pip install 'asiento[web]'). Every page and every JSON
    answer needs the token (run data holds personal data), taken from
    $ASIENTO_WEB_TOKEN or generated and printed at start: a person logs in with
    it, a script sends Authorization: Bearer TOKEN. --open-reading opens reading
    (never writing) to this machine only.
    """
    try:
        from ..web import check_open_reading
        from ..web import serve as serve_web
    except ImportError as exc:
        raise CommandError(
            f"asiento serve needs the web extra: pip install 'asiento[web]' ({exc})"
        ) from None
    if open_reading:
        try:
            check_open_reading(host, allowed_hosts)
        except UsageError as exc:
            raise CommandError(str(exc)) from None
    with_store(store, lambda journal: journal.runs())  # a clear error now, not in the server
    token = os.environ.get(TOKEN_ENV, "")
    if token and len(token) < MIN_TOKEN:
        raise CommandError(f"${TOKEN_ENV} has {len(token)} characters; use at least {MIN_TOKEN}")
    shown = f"from ${TOKEN_ENV}" if token else None
    token = token or secrets.token_urlsafe(24)
    serve_web(
        store,
        token=token,
        host=host,
        port=port,
        allowed_hosts=allowed_hosts,
        token_shown=shown or token,
        open_reading=open_reading,
    )


@main.command()
@store_option
@click.option(
    "--app",
    "target",
    required=True,
    metavar="MODULE:ATTR",
    help="Where the asiento.App is, e.g. myagents:app (MODULE is imported from the cwd).",
)
@click.option("--poll", default=0.5, show_default=True, type=float, help="Seconds between looks.")
@click.option("--until-idle", is_flag=True, help="Stop when no run needs work.")
@click.option(
    "--concurrency",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Runs driven at once, each under its own lease (sync tools get as many threads).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(min=1, max=65535),
    metavar="PORT",
    help="Serve the worker's metrics for Prometheus at http://HOST:PORT/metrics"
    " (needs asiento[metrics]).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    metavar="HOST",
    help="The address --metrics-port listens on.",
)
def worker(
    store: str,
    target: str,
    poll: float,
    until_idle: bool,
    concurrency: int,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Claim submitted runs that need work and drive them with the app's agents.

    SIGTERM or SIGINT lets every step in flight finish (for at most the app's
    shutdown_grace, 25 s by default), then the worker releases its leases and stops
    with exit status 75; the runs stay resumable by any worker. With --metrics-port,
    its runs in flight, claims, commits, lease renewal lag, parks and quota waits are
    served for a Prometheus scrape (docs/fleet.md, "Metrics").
    """
    from ..worker import App, Worker

    try:
        app = load_target(target)
    except UsageError as exc:
        raise CommandError(f"--app {target}: {exc}") from None
    if not isinstance(app, App):
        raise CommandError(f"--app {target} is a {type(app).__name__}, not an asiento.App")
    if poll <= 0:
        raise CommandError("--poll must be a positive number of seconds")
    if metrics_port is not None:
        _serve_metrics(metrics_port, metrics_host)
    logging.basicConfig(level=logging.WARNING, format="asiento worker: %(message)s")
    shutdown.install()

    async def job(journal: Checkpointer) -> Worker:
        agents = ", ".join(sorted(app.agents))
        where = shown(store)
        click.echo(f"asiento worker: pid {os.getpid()} on {where}; agents: {agents}", err=True)
        running = Worker(journal, app, poll=poll, concurrency=concurrency)
        with contextlib.suppress(shutdown.ShutdownRequested):  # the run stays resumable
            await running.run(until_idle=until_idle)
        return running

    stats = with_store(store, job).stats
    click.echo(
        f"asiento worker: claimed {stats.claimed}: closed {stats.closed}, suspended "
        f"{stats.suspended}, uncertain {stats.uncertain}, failed {stats.failed}",
        err=True,
    )
    if shutdown.requested():
        click.echo("asiento worker: stopped by a signal; the runs are resumable", err=True)
        raise SystemExit(shutdown.EXIT_CODE)


def _serve_metrics(port: int, host: str) -> None:
    """Start the metrics endpoint before any run is claimed; any trouble is one line."""
    from ..telemetry.prometheus import serve_metrics

    try:
        serve_metrics(port, host)
    except UsageError as exc:
        raise CommandError(f"--metrics-port {port}: {exc}") from None
    click.echo(f"asiento worker: metrics at http://{host}:{port}/metrics", err=True)


@main.command()
@click.option(
    "--upstream",
    default="https://api.openai.com/v1",
    show_default=True,
    help="The base URL an SDK would be given; /v1/X is sent to URL/X.",
)
@click.option(
    "--db",
    default="gateway.db",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The proxy's SQLite file (created if missing).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", default=8787, show_default=True, type=int, help="Port (0: any free one, printed)."
)
@click.option(
    "--ttl", default=86400.0, show_default=True, type=float, help="Seconds an answer is kept."
)
@click.option(
    "--wait",
    default=600.0,
    show_default=True,
    type=float,
    help="Seconds a request waits for the same key's answer in flight.",
)
@click.option(
    "--upstream-timeout",
    default=600.0,
    show_default=True,
    type=float,
    help="Seconds one upstream answer may take, from sending the request to its last byte.",
)
@click.option(
    "--read-timeout",
    default=None,
    type=float,
    help="Seconds upstream may stay silent while it answers (default: the upstream timeout).",
)
@click.option(
    "--lease",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds a key in flight stays claimed past its proxy's last renewal (renewed "
    "every third of it while the upstream call is alive).",
)
@click.option(
    "--max-concurrent",
    default=None,
    type=click.IntRange(min=1),
    help="Most requests in flight upstream at once, all clients together (default: no cap).",
)
@click.option(
    "--requests-per-minute",
    default=None,
    type=click.IntRange(min=1),
    help="Most requests sent upstream per minute, all clients together (default: no cap).",
)
@click.option(
    "--tokens-per-minute",
    default=None,
    type=click.IntRange(min=1),
    help="Most tokens sent upstream per minute, estimated before each request and corrected "
    "by its usage (default: no cap).",
)
def gateway(
    upstream: str,
    db: str,
    host: str,
    port: int,
    ttl: float,
    wait: float,
    upstream_timeout: float,
    read_timeout: float | None,
    lease: float,
    max_concurrent: int | None,
    requests_per_minute: int | None,
    tokens_per_minute: int | None,
) -> None:
    """Run an OpenAI-compatible proxy that honours Idempotency-Key durably.

    A resumed run that asks again for an answer already paid gets it from the
    proxy's file instead of a second generation. Needs the gateway extra
    (pip install 'asiento[gateway]').
    """
    try:
        from ..proxy import serve as serve_proxy
    except ImportError as exc:
        raise CommandError(
            f"asiento gateway needs the gateway extra: pip install 'asiento[gateway]' ({exc})"
        ) from None
    try:
        serve_proxy(
            upstream,
            db=db,
            host=host,
            port=port,
            ttl=ttl,
            wait=wait,
            upstream_timeout=upstream_timeout,
            read_timeout=read_timeout,
            lease=lease,
            quota=_quota(max_concurrent, requests_per_minute, tokens_per_minute),
        )
    except (AsientoError, OSError) as exc:
        raise CommandError(str(exc)) from None


def _quota(concurrent: int | None, rpm: int | None, tpm: int | None) -> Quota | None:
    """The proxy's limits on what it sends upstream; None when none is given."""
    if (concurrent, rpm, tpm) == (None, None, None):
        return None
    return Quota(concurrent, requests_per_minute=rpm, tokens_per_minute=tpm)
