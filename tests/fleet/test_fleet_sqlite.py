"""Worker fleets on one SQLite file: the same scenarios as on PostgreSQL where they are
cheap, plus what a worker does with a run it cannot drive, and SIGTERM mid-step.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from asiento import (
    Agent,
    App,
    Checkpointer,
    Holder,
    Lease,
    ModelRequest,
    ModelResponse,
    RunStatus,
    Savings,
    Session,
    SqliteCheckpointer,
    Step,
    Worker,
    submit,
)
from asiento.testing import ScriptedGateway

from .conftest import (
    Fleet,
    decided_runs_resume,
    drain_while_killing,
    poison_run_is_parked,
    race_rounds,
    seed,
    settle,
    wait_for,
)


async def test_racing_resumers_one_drives_each_round(
    sqlite_store: Checkpointer, sqlite_path: Path, tmp_path: Path
) -> None:
    """Four processes resume the same run at once, 20 times: one drives, three get RunLocked."""
    await race_rounds(sqlite_store, str(sqlite_path), tmp_path, rounds=20)


async def test_suspended_runs_are_resumed_once_decided(
    sqlite_store: Checkpointer, sqlite_path: Path, fleet_factory: Callable[[str], Fleet]
) -> None:
    """Suspended runs wait for a decision; then a worker picks them up and closes them."""
    await decided_runs_resume(sqlite_store, fleet_factory(str(sqlite_path)))


async def test_run_that_kills_its_workers_is_parked(
    sqlite_store: Checkpointer, sqlite_path: Path, fleet_factory: Callable[[str], Fleet]
) -> None:
    """A run whose tool SIGKILLs each worker is parked after 3 claims, with the reason."""
    await poison_run_is_parked(sqlite_store, fleet_factory(str(sqlite_path)))


async def test_two_workers_drain_40_runs_while_workers_are_killed(
    sqlite_store: Checkpointer, sqlite_path: Path, fleet_factory: Callable[[str], Fleet]
) -> None:
    """2 workers drain 40 runs while 3 are SIGKILLed and replaced: none twice, all settled."""
    fleet = fleet_factory(str(sqlite_path))
    statuses = await drain_while_killing(
        sqlite_store, fleet, workers=2, runs=40, kills=3, seed=seed()
    )
    print(f"{fleet.kills} kills, statuses {dict(statuses)}")


async def test_sigterm_lets_the_tool_in_flight_finish_then_exits_75(
    sqlite_store: Checkpointer, sqlite_path: Path, fleet_factory: Callable[[str], Fleet]
) -> None:
    """SIGTERM mid-tool: the result is recorded, the worker exits 75, the next closes the run."""
    fleet = fleet_factory(str(sqlite_path))
    await submit(sqlite_store, "gated", "gated", agent="gated")
    [worker] = fleet.start(1)
    await asyncio.to_thread(wait_for, (fleet.folder / "started.gated").exists, 30, "tool")
    worker.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.2)
    (fleet.folder / "go").touch()
    assert await asyncio.to_thread(worker.wait, 30) == 75
    phases = [(e.step_id, str(e.phase)) for e in await sqlite_store.load("gated")]
    assert phases[-1] == ("m1.t1", "result")
    [run] = await sqlite_store.runs()
    assert (run.status, run.lease_owner) == (RunStatus.RUNNING, None)
    assert fleet.reap() == [75]
    fleet.start(1)
    [run] = await settle(sqlite_store, 30)
    assert (run.status, run.fence) == (RunStatus.CLOSED, 2)
    assert fleet.ledger() == Counter({"gated": 1})
    assert fleet.stop() == [75]


async def test_runs_stopped_by_sigterm_are_not_parked(
    sqlite_store: Checkpointer, sqlite_path: Path, fleet_factory: Callable[[str], Fleet]
) -> None:
    """Two workers stopped by SIGTERM mid-run (max_attempts 2) do not park it: a third closes it."""
    fleet = fleet_factory(str(sqlite_path))
    await submit(sqlite_store, "gates", "gates", agent="gates")
    options = ("--max-attempts", "2")
    for n in (1, 2):
        [worker] = fleet.start(1, *options)
        started = fleet.folder / f"started.gates.{n}"
        await asyncio.to_thread(wait_for, started.exists, 30, f"gate {n}")
        worker.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        (fleet.folder / f"go.gates.{n}").touch()
        assert await asyncio.to_thread(worker.wait, 30) == 75
        assert fleet.reap() == [75]
    (fleet.folder / "go.gates.3").touch()
    fleet.start(1, *options)
    [run] = await settle(sqlite_store, 30)
    assert fleet.stop() == [75]
    assert run.status is RunStatus.CLOSED, run.reason


def broken(request: ModelRequest) -> ModelResponse:
    raise RuntimeError("the provider is down")


async def test_run_that_fails_every_pass_is_parked_with_its_last_failure(
    sqlite_path: Path,
) -> None:
    """A run whose model call raises in every pass is parked after max_attempts, naming why."""
    store = SqliteCheckpointer(sqlite_path)
    app = App(agents={"default": Agent()}, gateway=ScriptedGateway(broken), max_attempts=2)
    await submit(store, "r1", "task")
    worker = Worker(store, app, poll=0.01)
    await worker.run(until_idle=True, max_seconds=20)
    [run] = await store.runs()
    assert (run.status, run.fence, run.lease_owner) == (RunStatus.PARKED, 2, None)
    assert run.reason is not None
    assert run.reason.startswith("parked after 2 claims without reaching a stable state")
    assert run.reason.endswith("last failure: RuntimeError: the provider is down")
    assert (worker.stats.claimed, worker.stats.failed) == (2, 2)
    assert await worker.run_once() is False
    await store.close()


class _NeighbourClaimsOnRelease(SqliteCheckpointer):
    """A store where another worker's claim lands the moment a lease is given back."""

    parked_by_neighbour = 0

    async def release(
        self, lease: Lease, *, savings: Savings | None = None, clean: bool = False
    ) -> None:
        await super().release(lease, savings=savings, clean=clean)
        if await self.claim(Holder.here(), ttl=30.0, max_attempts=1) is None:
            self.parked_by_neighbour += 1


async def test_failed_pass_never_unparks_a_run_a_neighbour_parked(sqlite_path: Path) -> None:
    """A failure is noted under the pass's lease: a neighbour's claim that parks the run
    right after the release is not undone by the failing worker (it was: the run went on
    being claimed past max_attempts)."""
    store = _NeighbourClaimsOnRelease(sqlite_path)
    app = App(agents={"default": Agent()}, gateway=ScriptedGateway(broken), max_attempts=1)
    await submit(store, "r1", "task")
    worker = Worker(store, app, poll=0.01)
    assert await worker.run_once() is True
    assert store.parked_by_neighbour == 1
    [run] = await store.runs()
    assert run.status == RunStatus.PARKED
    assert run.reason is not None
    assert run.reason.endswith("last failure: RuntimeError: the provider is down")
    assert (worker.stats.claimed, worker.stats.failed) == (1, 1)
    assert await worker.run_once() is False
    await store.close()


class _FailsBeforeDriving:
    """A framework wrapper whose pass raises before it takes the run's lease."""

    async def run(self, task: str, *, session: Session) -> AsyncIterator[Step]:
        raise RuntimeError("the framework could not start")
        yield  # an async generator, as the protocol asks


async def test_pass_that_fails_before_driving_gives_its_claim_back(sqlite_path: Path) -> None:
    """A claim the pass never drove is noted and released at once (it lapsed after the
    lease: 30 s before each retry), and the run parked after max_attempts, naming why."""
    store = SqliteCheckpointer(sqlite_path)
    app = App(
        agents={"default": _FailsBeforeDriving()}, gateway=ScriptedGateway([]), max_attempts=2
    )
    await _parked_after_two_given_back_claims(store, app, "the framework could not start")


async def test_run_for_an_agent_the_app_lacks_is_parked_at_once(sqlite_path: Path) -> None:
    """A run naming an agent the worker's app does not have is parked at its first claim."""
    store = SqliteCheckpointer(sqlite_path)
    app = App(agents={"default": Agent()}, gateway=ScriptedGateway([]))
    await submit(store, "r1", "task", agent="billing")
    worker = Worker(store, app)
    assert await worker.run_once() is True
    assert await worker.run_once() is False
    [run] = await store.runs()
    assert (run.status, run.fence, run.lease_owner) == (RunStatus.PARKED, 1, None)
    assert run.reason == "no agent named 'billing' in this worker's app"
    await store.close()


def _gateway_factory_that_fails() -> ScriptedGateway:
    raise RuntimeError("no credentials for the provider")


async def test_claim_whose_session_cannot_be_built_is_given_back(sqlite_path: Path) -> None:
    """A gateway factory that raises (or a gateway Session refuses) fails the claim's pass:
    the failure is noted and the claim released at once, not left to lapse (it was, and
    the run was never parked: each lapse restarted nothing and counted nothing)."""
    store = SqliteCheckpointer(sqlite_path)
    app = App(agents={"default": Agent()}, gateway=_gateway_factory_that_fails, max_attempts=2)
    await _parked_after_two_given_back_claims(store, app, "no credentials for the provider")


async def _parked_after_two_given_back_claims(
    store: SqliteCheckpointer, app: App, failure: str
) -> None:
    """Each claim is given back at once (no lapse to wait for): parked after two, naming why."""
    await submit(store, "r1", "task")
    worker = Worker(store, app, poll=0.01)
    assert [await worker.run_once() for _ in range(3)] == [True, True, False]
    [run] = await store.runs()
    assert (run.status, run.fence, run.lease_owner) == (RunStatus.PARKED, 2, None)
    assert run.reason is not None
    assert run.reason.endswith(f"last failure: RuntimeError: {failure}")
    assert (worker.stats.claimed, worker.stats.failed) == (2, 2)
    await store.close()
