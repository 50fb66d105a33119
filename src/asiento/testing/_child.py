"""The crash harness's child: drive one operation on a run, in a process that may die.

    python -m asiento.testing._child serve CONFIG_JSON               # fork-server
    python -m asiento.testing._child once CONFIG_JSON COMMAND_JSON   # one operation

``serve`` imports the user's app once, then reads one JSON command per line
on stdin and forks a real process for each (``_fork``), replying with one JSON
line (pid, exit code, outcome). A command's ``kill_after`` (seconds) makes the server
SIGKILL the forked child after that delay; ``crash`` (``name@N``) makes the
child SIGKILL itself at that crash-point passage. ``once`` runs one command in
this very interpreter (the fsync audit runs it under strace).

Operations: ``run`` (one pass of the agent: until it closes, suspends, stops
uncertain or fails), ``approve``, ``resolve`` and ``abandon`` (what a person
does, through the API or, with ``"via": "cli"``, the ``asiento`` command),
``submit`` (queue the run for workers) and ``work`` (a worker, until no run
needs work). Every outcome carries the crash-point passages the child went
through, so a dry run tells the harness which passages exist.

``pause_after_load`` (a file) stops a pass with SIGSTOP right after it read the
run's journal, its pid in that file: the decision races hold a pass there, its
snapshot taken, while a person decides.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import decisions as people
from ..agent import Agent
from ..effects.base import key_margin_of
from ..errors import AsientoError, LeaseLost, RunAbandoned, RunLocked, UncertainEffect, UsageError
from ..events import ApprovalStep, FinalStep, Step
from ..journal.base import Checkpointer
from ..model import ModelRequest, ModelResponse
from ..session import Session
from ._files import ledger_paths
from ._fork import Command, Outcome, serve
from ._instrument import LedgerGateway, instrument, stop_here
from ._observe import Observer, install
from ._plants import plant
from ._stores import is_postgres, open_checkpointer, pg_dsn

PERSON = "crash-harness"


@dataclass(frozen=True, slots=True)
class ChildConfig:
    """What every child of one harness worker shares."""

    app: str
    task: str
    store: str
    workdir: str
    plants: tuple[str, ...] = ()
    lease_ttl: float = 30.0
    application_name: str = "asiento-harness"
    warm_up: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ChildConfig:
        return cls(**{**data, "plants": tuple(data.get("plants", ()))})

    def to_json(self) -> dict[str, Any]:
        return {
            "app": self.app,
            "task": self.task,
            "store": self.store,
            "workdir": self.workdir,
            "plants": list(self.plants),
            "lease_ttl": self.lease_ttl,
            "application_name": self.application_name,
            "warm_up": self.warm_up,
        }


def load_factory(spec: str) -> Callable[[], Any]:
    """``module:attribute`` (dots allowed in both) to the callable it names."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise UsageError(f"app must be 'module:factory', got {spec!r}")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(f"{spec} is not callable")
    return target  # type: ignore[no-any-return]


class Child:
    """The app, loaded once; ``execute`` runs one command in this process."""

    def __init__(self, config: ChildConfig) -> None:
        self.config = config
        self.postgres = is_postgres(config.store)
        self.factory = load_factory(config.app)
        for name in config.plants:
            plant(name, postgres=self.postgres)
        self.observer = Observer()
        self.hook_errors: list[str] = []

    def warm_up(self) -> None:
        """Import what a pass needs, so that forked children start at once."""
        import asiento.journal.sqlite

        if self.postgres:
            import psycopg  # noqa: F401
            import psycopg_pool  # noqa: F401

            import asiento.journal.postgres  # noqa: F401
        self.build("warm-up", {})
        asyncio.run(asyncio.sleep(0))
        if self.config.warm_up:
            load_factory(self.config.warm_up)()
        install(self.observer)

    def build(self, run_id: str, cmd: Command) -> tuple[Agent, LedgerGateway]:
        """The user's agent and gateway, instrumented for this run."""
        made = self.factory()
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], Agent)):
            raise UsageError(f"{self.config.app} must return (Agent, gateway), got {made!r}")
        effects, models = ledger_paths(self.config.workdir, run_id)
        gateway = LedgerGateway(
            made[1],
            models,
            run_id,
            pause_at=cmd.get("pause_model"),
            pause_file=cmd.get("pause_file"),
        )
        return instrument(made[0], effects), gateway

    def execute(self, cmd: Command) -> tuple[int, Outcome]:
        """Run ``cmd``; the exit code is 0 for any outcome but an unexpected error."""
        self.observer.reset(cmd.get("crash"))
        self.hook_errors = []
        if cmd.get("pause_point") and cmd.get("pause_file"):
            name, _, nth = str(cmd["pause_point"]).partition("@")
            marker = Path(cmd["pause_file"])
            self.observer.hooks[(name, int(nth or 1))] = lambda: stop_here(marker)
        if cmd.get("pg_cut") is not None:
            cut = cmd["pg_cut"]
            self.observer.hooks[("inside_commit", int(cut["at"]))] = self._cutter(cut.get("delay"))
        try:
            out: Outcome = asyncio.run(OPS[cmd["op"]](self, cmd))
        except Exception as exc:
            traceback.print_exc()
            out = {"outcome": "error", "type": type(exc).__name__, "message": str(exc)[:400]}
        out |= {"passages": dict(self.observer.passages), "pid": os.getpid()}
        if self.hook_errors:
            out["hook_errors"] = self.hook_errors
        return (1 if out["outcome"] == "error" else 0), out

    def _cutter(self, delay: float | None) -> Callable[[], None]:
        """Terminate this child's own database connections, now or ``delay`` s later."""

        def cut() -> None:
            try:
                terminate_backends(self.config.store, self.config.application_name)
            except Exception as exc:
                self.hook_errors.append(f"{type(exc).__name__}: {exc}")

        if delay is None:
            return cut

        def later() -> None:
            def wait_then_cut() -> None:
                time.sleep(delay)
                cut()

            threading.Thread(target=wait_then_cut, daemon=True).start()

        return later


def terminate_backends(store: str, application_name: str) -> int:
    """``pg_terminate_backend`` every connection named ``application_name``; how many."""
    import psycopg

    dsn = pg_dsn(store, application_name + "-cutter")
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = %s AND pid <> pg_backend_pid()",
            (application_name,),
        ).fetchall()
    return len(rows)


# -- the operations ------------------------------------------------------------------


async def run_pass(child: Child, cmd: Command) -> Outcome:
    """One pass of the agent over the run."""
    run_id = cmd["run"]
    agent, gateway = child.build(run_id, cmd)
    store = await open_checkpointer(child.config.store, child.config.application_name)
    if cmd.get("pause_after_load"):
        _pause_after_first_load(store, Path(cmd["pause_after_load"]))
    ttl = float(cmd.get("lease_ttl") or child.config.lease_ttl)
    session = Session(run_id, gateway, store, lease_ttl=ttl, wait=float(cmd.get("wait", 0.0)))
    task = child.config.task.replace("{run_id}", run_id)
    last: Step | None = None
    try:
        async for step in agent.run(task, session=session):
            last = step
    except UncertainEffect as exc:
        return {"outcome": "uncertain", "step": exc.step_id, "tool": exc.tool}
    except RunAbandoned as exc:
        return {"outcome": "abandoned", "in_flight": list(exc.in_flight), "message": str(exc)}
    except LeaseLost as exc:
        return {"outcome": "lease_lost", "message": str(exc)[:400]}
    except RunLocked as exc:
        return {"outcome": "locked", "message": str(exc)[:400]}
    finally:
        await store.close()
    if isinstance(last, FinalStep):
        return {"outcome": "closed", "replayed": last.replayed}
    if isinstance(last, ApprovalStep):
        return {"outcome": "suspended", "step": last.step_id, "fingerprint": last.fingerprint}
    raise RuntimeError(f"the pass ended on {last!r}")


def _pause_after_first_load(store: Checkpointer, marker: Path) -> None:
    """Stop this process once, right after its first ``load``: the pass holds its snapshot."""
    original = store.load
    paused: list[bool] = []

    async def load(run_id: str) -> Any:
        events = await original(run_id)
        if not paused:
            paused.append(True)
            stop_here(marker)
        return events

    store.load = load  # type: ignore[method-assign]


async def approve(child: Child, cmd: Command) -> Outcome:
    """What a person does with a suspended run: approve exactly what was shown."""
    if cmd.get("via") == "cli":
        args = ["approve", cmd["run"], cmd["step"], "--by", PERSON]
        args += ["--fingerprint", cmd["fingerprint"]] if cmd.get("fingerprint") else []
        return _cli(child, args, {"outcome": "approved", "step": cmd["step"]})
    store = await open_checkpointer(child.config.store, child.config.application_name)
    try:
        await people.approve(
            store, cmd["run"], cmd["step"], by=PERSON, fingerprint=cmd.get("fingerprint")
        )
    except AsientoError as exc:
        if not cmd.get("may_refuse"):
            raise
        return _refused(exc)
    finally:
        await store.close()
    return {"outcome": "approved", "step": cmd["step"]}


async def resolve(child: Child, cmd: Command) -> Outcome:
    """What a person does after looking at the destination of an uncertain effect."""
    done = {"outcome": "resolved", "step": cmd["step"], "happened": cmd["happened"]}
    if cmd.get("via") == "cli":
        found = "--happened" if cmd["happened"] else "--not-happened"
        return _cli(child, ["resolve", cmd["run"], cmd["step"], found, "--by", PERSON], done)
    store = await open_checkpointer(child.config.store, child.config.application_name)
    try:
        await people.resolve(store, cmd["run"], cmd["step"], happened=cmd["happened"], by=PERSON)
    except AsientoError as exc:
        if not cmd.get("may_refuse"):
            raise
        return _refused(exc)
    finally:
        await store.close()
    return done


async def abandon(child: Child, cmd: Command) -> Outcome:
    """A person closes the run (while a pass may drive it)."""
    if cmd.get("via") == "cli":
        args = ["abandon", cmd["run"], "--by", PERSON, "--reason", "the harness gave up"]
        out = _cli(child, args, {"outcome": "abandoned"})
    else:
        store = await open_checkpointer(child.config.store, child.config.application_name)
        try:
            await people.abandon(store, cmd["run"], by=PERSON, reason="the harness gave up")
            out = {"outcome": "abandoned"}
        except AsientoError as exc:
            out = _refused(exc)
        finally:
            await store.close()
    return out | {"at": time.time()}  # when it returned: no effect of the run may start after


def _cli(child: Child, args: list[str], done: Outcome) -> Outcome:
    """Run an ``asiento`` command in this process, as a person would type it."""
    import click

    from ..cli import main

    try:
        main.main([*args, "--store", child.config.store], standalone_mode=False)
    except click.ClickException as exc:
        return {"outcome": "refused", "message": exc.format_message()[:400]}
    return done


def _refused(exc: AsientoError) -> Outcome:
    return {"outcome": "refused", "type": type(exc).__name__, "message": str(exc)[:400]}


async def submit(child: Child, cmd: Command) -> Outcome:
    """Queue the run for workers, driven by the agent named after the run."""
    store = await open_checkpointer(child.config.store, child.config.application_name)
    try:
        task = child.config.task.replace("{run_id}", cmd["run"])
        await store.submit(cmd["run"], task, agent=cmd["run"])
    finally:
        await store.close()
    return {"outcome": "submitted"}


async def work(child: Child, cmd: Command) -> Outcome:
    """A worker, until no run needs work: it drains what a person's decision left running."""
    from ..worker import App, Worker

    store = await open_checkpointer(child.config.store, child.config.application_name)
    app = App(
        agents=_AgentsByRun(child), gateway=_GatewayByRun(child), lease_ttl=child.config.lease_ttl
    )
    worker = Worker(store, app, poll=0.01)
    try:
        await worker.run(until_idle=True, max_seconds=float(cmd.get("max_seconds", 60.0)))
    finally:
        await store.close()
    stats = worker.stats
    counts = {k: getattr(stats, k) for k in ("claimed", "closed", "suspended", "uncertain")}
    return {"outcome": "worked", "runs": list(stats.runs), **counts, "failed": stats.failed}


class _AgentsByRun(Mapping[str, Agent]):
    """The harness submits each run under an agent named after it: its instrumented agent."""

    def __init__(self, child: Child) -> None:
        self.child = child

    def __getitem__(self, run_id: str) -> Agent:
        return self.child.build(run_id, {})[0]

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


class _GatewayByRun:
    """One gateway for a worker: each request goes to the ledger of its run (from its key)."""

    def __init__(self, child: Child) -> None:
        self.child = child
        self.gateways: dict[str, LedgerGateway] = {}

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        run_id = idempotency_key.rsplit(":", 2)[0]
        if run_id not in self.gateways:
            self.gateways[run_id] = self.child.build(run_id, {})[1]
        return await self.gateways[run_id].complete(request, idempotency_key=idempotency_key)


async def describe(child: Child, cmd: Command) -> Outcome:
    """What the oracle must know of the app's tools: idempotent, effect, how reconciled."""
    agent, _ = child.build("describe", cmd)
    tools = {
        t.name: {
            "idempotent": t.idempotent,
            "effect": t.effect is not None,
            "honours_keys": bool(t.effect and t.effect.honours_keys),
            "key_ttl": t.effect.key_ttl if t.effect else None,
            "has_lookup": bool(t.effect and t.effect.has_lookup),
            "key_margin": key_margin_of(t.effect.key_ttl, t.effect.key_margin) if t.effect else 0.0,
        }
        for t in agent.tools.values()
    }
    return {"outcome": "described", "tools": tools}


OPS: dict[str, Callable[[Child, Command], Coroutine[Any, Any, Outcome]]] = {
    "run": run_pass,
    "approve": approve,
    "resolve": resolve,
    "abandon": abandon,
    "submit": submit,
    "work": work,
    "describe": describe,
}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("serve", "once"):
        print(__doc__, file=sys.stderr)
        return 2
    child = Child(ChildConfig.from_json(json.loads(argv[1])))
    if argv[0] == "serve":
        return serve(child)
    install(child.observer)
    code, out = child.execute(json.loads(argv[2]))
    print(json.dumps(out), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
