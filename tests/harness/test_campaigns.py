"""The crash harness on our own agents: every crash point, kill storms, lease races.

Everything here runs real child processes killed with real SIGKILLs, on real
SQLite files and a real PostgreSQL server (``pg_dsn``: a schema of its own per
test). The sizes are small; ``bench/reliability.py --tier ci`` runs the full ones.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from asiento.testing import CRASH_POINTS, CrashHarness
from asiento.testing.invariants import INVARIANTS
from asiento.testing.invoices import InvoiceServer
from journal import pg_server

from . import app
from .conftest import TESTS

SampleHarness = Callable[..., CrashHarness]


def test_matrix_covers_every_crash_point_on_sqlite(
    sample_harness: SampleHarness, invoices: InvoiceServer
) -> None:
    """Each crash point at each passage is killed once, resumed, and breaks no invariant."""
    report = sample_harness().matrix()
    report.raise_if_violations()
    assert all(report.coverage[point] > 0 for point in CRASH_POINTS), report.coverage
    assert report.trials == report.kills == sum(report.coverage.values())
    assert report.by_invariant == dict.fromkeys(INVARIANTS, 0)
    outcomes = {outcome for run in report.runs for _, _, outcome in run.ops}
    assert {"uncertain", "suspended", "closed", "killed"} <= outcomes  # every path was taken
    numbers = [invoice["number"] for invoice in invoices.invoices]
    assert len(numbers) == len(set(numbers)) >= report.trials  # every run billed, once


def test_matrix_on_postgresql(sample_harness: SampleHarness, pg_dsn: str) -> None:
    """The same matrix on PostgreSQL: kills inside COMMIT included, nothing repeated."""
    report = sample_harness(store=pg_dsn).matrix()
    report.raise_if_violations()
    assert report.coverage["inside_commit"] >= 8
    assert report.kills == report.trials


def test_storm_on_sqlite(sample_harness: SampleHarness) -> None:
    """Random crash points and SIGKILLs at random instants: both kinds land, none harms."""
    report = sample_harness().storm(120, seed=1234, max_seconds=90)
    report.raise_if_violations()
    assert report.kills >= 120, report.summary()
    assert report.faults["SIGKILL at a crash point"]
    assert report.faults["SIGKILL at a random instant"]


@pytest.fixture
def restartable(pg_cluster: pg_server.Cluster) -> Callable[[], None]:
    """Restart the session's PostgreSQL as a crash would (immediate), at most twice."""
    done: list[int] = []

    def restart() -> None:
        assert len(done) < 2, "a bounded number of restarts"
        done.append(1)
        pg_cluster.restart("immediate")

    return restart


def test_storm_on_postgresql_with_cut_connections_and_a_restart(
    sample_harness: SampleHarness, pg_dsn: str, restartable: Callable[[], None]
) -> None:
    """SIGKILLs, connections cut in commits and at random, a server restart: no violation."""
    harness = sample_harness(store=pg_dsn, pg_restart=restartable)
    report = harness.storm(80, seed=99, max_seconds=120, restarts=1)
    report.raise_if_violations()
    assert report.kills >= 80, report.summary()
    assert report.faults["server restarts"] == 1
    assert report.faults["connections cut in a commit"] + report.faults["connections terminated"]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_lease_race(
    sample_harness: SampleHarness, backend: str, request: pytest.FixtureRequest
) -> None:
    """A driver stopped past its lease is taken over; continued, it writes and runs nothing."""
    store = request.getfixturevalue("pg_dsn") if backend == "postgresql" else None
    harness = sample_harness(store=store) if store else sample_harness()
    report = harness.lease_race(2, seed=5)
    report.raise_if_violations()
    assert report.trials == 2
    assert report.faults["takeovers of a stopped holder"] == 2


def test_a_users_app_loaded_by_module_path(crash_harness: Callable[..., CrashHarness]) -> None:
    """An app outside asiento (async tools, its own crash point, an effect) passes too."""
    harness = crash_harness("harness.app:make", task=app.TASK, pythonpath=[TESTS])
    matrix = harness.matrix()
    matrix.raise_if_violations()
    assert matrix.coverage["after_prepare"]
    assert matrix.coverage["inside_tool"] >= 3
    harness.storm(40, seed=7, max_seconds=60).raise_if_violations()


def test_a_failing_tool_is_an_outcome_not_a_violation(
    crash_harness: Callable[..., CrashHarness],
) -> None:
    """A tool that raises records its failure; the harness sees no broken promise."""
    harness = crash_harness(
        "harness.app:make", task=app.TASK, pythonpath=[TESTS], env={"HARNESS_APP_BROKEN": "1"}
    )
    harness.matrix().raise_if_violations()


def test_storm_seed_replays_the_same_trial(sample_harness: SampleHarness) -> None:
    """A trial's seed makes the same fault choices again, as long as the run behaves alike."""
    harness = sample_harness()
    storm = harness.storm(15, seed=4321, max_seconds=60)
    storm.raise_if_violations()
    first = next(run for run in storm.runs if run.seed is not None)
    again = harness.replay(first.seed)
    again.raise_if_violations()
    assert again.trials == 1
    assert len(again.runs) == 2
    replayed = again.runs[-1]
    assert replayed.ops[0][:2] == first.ops[0][:2]  # the same first fault, always
    for (op, fault, outcome), (op2, fault2, outcome2) in zip(first.ops, replayed.ops, strict=False):
        if fault is None or fault2 is None:
            break  # the storm's budget, or the end of the faulty phase
        assert (op, fault) == (op2, fault2)
        if outcome != outcome2:
            break  # a SIGKILL at an instant landed elsewhere: the paths part here
