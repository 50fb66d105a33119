"""A hung run takes one slot, never the worker: tool timeouts and SIGTERM's grace.

Real worker processes drive runs whose sync tool never returns (it waits for a file
the test only makes at the end) beside healthy runs. With a tool timeout the hung
steps end with their documented outcome: an idempotent one fails and the model is
told, another is uncertain, never run again. Without one, SIGTERM still stops the
worker once its grace is over, and the hung run resumes elsewhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

from asiento import Checkpointer, Phase, RunInfo, RunStatus, submit
from asiento.journal.postgres import PostgresCheckpointer

from .conftest import Fleet, settle, submit_runs, wait_for
from .test_blame import shown
from .worker_child import WAIT_LIMIT

# 4 runs at once, a 0.2 s model; the healthy runs need about half a second each.
OPTIONS = ("--ttl", "2", "--concurrency", "4", "--model-delay", "0.2")
TIMEOUT = 5


async def test_hung_tools_time_out_beside_six_healthy_runs(
    sqlite_store: Checkpointer,
    sqlite_path: Path,
    fleet_factory: Callable[[str], Fleet],
    tmp_path: Path,
) -> None:
    """Two sync tools that never return, at concurrency 4: the six healthy runs close while
    the hung tools still hold their threads; past the timeout the idempotent one's step
    fails (the model is told, the run closes) and the other is uncertain, run once."""
    await submit(sqlite_store, "hung", "hung", agent="gated")
    await submit(sqlite_store, "stuck", "stuck", agent="stuck")
    healthy = await submit_runs(sqlite_store, 6, "send")
    fleet = fleet_factory(str(sqlite_path))
    fleet.start(1, *OPTIONS, "--tool-timeout", str(TIMEOUT))

    def closed(runs: list[RunInfo]) -> bool:
        by_id = {r.run_id: r for r in runs}
        return all(by_id[r].status is RunStatus.CLOSED for r in healthy)

    runs = {r.run_id: r for r in await settle(sqlite_store, 60, until=closed)}
    assert (tmp_path / "started.hung").exists()
    assert (tmp_path / "started.stuck").exists()
    assert runs["hung"].status is RunStatus.RUNNING, "the hung run ended before its neighbours"
    assert runs["stuck"].status is RunStatus.RUNNING

    runs = {r.run_id: r for r in await settle(sqlite_store, 60)}
    assert fleet.ledger() == Counter(dict.fromkeys(healthy, 1)), "hung never sent"
    hung, stuck = runs["hung"], runs["stuck"]
    assert hung.status is RunStatus.UNCERTAIN, hung
    assert hung.reason == (
        f"tool 'gated_send' (step m1.t1): it timed out after {TIMEOUT} s, and may or may not"
        " have happened"
    )
    assert stuck.status is RunStatus.CLOSED, stuck
    results = {e.step_id: e for e in await sqlite_store.load("stuck") if e.phase is Phase.RESULT}
    assert results["m1.t1"].payload["error"] == f"tool 'stuck_lookup' timed out after {TIMEOUT} s"
    assert not (tmp_path / "returned.stuck").exists(), "the hung tool returned after all"
    page = shown(str(sqlite_path), "hung")
    assert f"it timed out after {TIMEOUT} s, and may or may not have happened" in page
    assert fleet.stop() == [75]


async def grace_then_resume(store: Checkpointer, fleet: Fleet, folder: Path) -> None:
    """SIGTERM with a tool that never returns: exit 75 once the 2 s grace is over, the
    run's lease released and not counted; resumed by another worker, it closes."""
    await submit(store, "stuck", "stuck", agent="stuck")
    healthy = await submit_runs(store, 2, "send")
    (worker,) = fleet.start(1, *OPTIONS, "--grace", "2")
    wait_for((folder / "started.stuck").exists, 30)
    await settle(store, 30, until=lambda runs: sum(r.status is RunStatus.CLOSED for r in runs) == 2)
    wait_for(lambda: any(e["ev"] == "ready" and e["pid"] == worker.pid for e in fleet.logs()), 30)
    worker.terminate()
    # The tool waits WAIT_LIMIT s for DIR/go: a worker that waited for it would be late.
    assert worker.wait(timeout=WAIT_LIMIT - 10) == 75, fleet.stderr()
    fleet.live.remove(worker)
    assert not (folder / "returned.stuck").exists(), "the tool returned: nothing was cut"
    run = {r.run_id: r for r in await store.runs()}["stuck"]
    assert (run.status, run.lease_owner, run.attempts) == (RunStatus.RUNNING, None, 0), run
    (folder / "go").touch()
    fleet.start(1, *OPTIONS)
    runs = {r.run_id: r for r in await settle(store, 60)}
    assert runs["stuck"].status is RunStatus.CLOSED, runs["stuck"]
    assert (folder / "returned.stuck").exists()
    assert fleet.ledger() == Counter(dict.fromkeys(healthy, 1))
    assert fleet.stop() == [75]


async def test_sigterm_grace_cuts_a_hung_tool_on_sqlite(
    sqlite_store: Checkpointer,
    sqlite_path: Path,
    fleet_factory: Callable[[str], Fleet],
    tmp_path: Path,
) -> None:
    await grace_then_resume(sqlite_store, fleet_factory(str(sqlite_path)), tmp_path)


async def test_sigterm_grace_cuts_a_hung_tool_on_postgres(
    pg_store: PostgresCheckpointer,
    pg_url: str,
    fleet_factory: Callable[[str], Fleet],
    tmp_path: Path,
) -> None:
    await grace_then_resume(pg_store, fleet_factory(pg_url), tmp_path)
