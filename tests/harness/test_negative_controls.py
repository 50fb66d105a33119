"""Negative controls: each campaign catches a bug planted in its children, within its CI size.

A campaign that cannot fail proves nothing. The plants (``asiento.testing._plants``)
are monkeypatched into the harness's child processes only:

- no write-ahead before the effect: the ``submitted`` record is never written,
  so a crash inside a non-idempotent tool is taken for "never tried" and the
  tool runs again. Caught by the matrix and by the storm (``effect_once``).
- no fencing check: ``append`` ignores its lease. Caught by the lease race
  (``stale_writes_nothing``): the stopped holder, continued, writes.
- no directory fsync in ``write_atomic``. A SIGKILL cannot lose a rename the
  kernel already holds (only a power cut can), so no kill campaign can see it:
  the fsync audit catches it by reading the order of the system calls under
  strace (``dir_fsync``).
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable

import pytest

from asiento.testing import CampaignFailed, CrashHarness

SampleHarness = Callable[..., CrashHarness]


def _invariants(report_violations: list[object]) -> set[str]:
    return {v.invariant for v in report_violations}  # type: ignore[attr-defined]


def test_matrix_catches_a_missing_write_ahead(sample_harness: SampleHarness) -> None:
    """Without the submitted record, a kill inside send makes it run twice: the matrix says so."""
    report = sample_harness(plant="no_write_ahead").matrix()
    doubled = [v for v in report.violations if "send applied 2 times" in v.message]
    assert doubled, report.summary()
    assert {v.case for v in doubled} >= {"op0:inside_tool@2"}
    with pytest.raises(CampaignFailed, match="effect_once"):
        report.raise_if_violations()


def test_storm_catches_a_missing_write_ahead(sample_harness: SampleHarness) -> None:
    """The random storm finds the same bug within its CI-sized budget, and prints its seed."""
    report = sample_harness(plant="no_write_ahead").storm(200, seed=2024, max_seconds=90)
    assert "effect_once" in _invariants(report.violations), report.summary()
    seeded = [v for v in report.violations if v.seed is not None]
    assert seeded
    assert all(f"--seed {v.seed}" in (v.replay or "") for v in seeded)


def test_a_printed_seed_replays_the_violation(sample_harness: SampleHarness) -> None:
    """Replaying a failing matrix case with its printed command line fails again."""
    harness = sample_harness(plant="no_write_ahead")
    report = harness.matrix()
    case = next(v for v in report.violations if v.case == "op0:inside_tool@2")
    again = harness.replay(case=case.case)
    assert any("send applied 2 times" in v.message for v in again.violations), again.summary()
    assert case.replay is not None
    assert "--plant=no_write_ahead" in case.replay
    command = shlex.split(case.replay)
    done = subprocess.run(
        [*command, "--env", f"ASIENTO_SAMPLE_INVOICES={harness.env['ASIENTO_SAMPLE_INVOICES']}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "send applied 2 times for m1.t2" in done.stdout


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_lease_race_catches_a_missing_fencing_check(
    sample_harness: SampleHarness, backend: str, request: pytest.FixtureRequest
) -> None:
    """A stale holder whose appends skip the fence writes after the takeover: caught."""
    options = {"store": request.getfixturevalue("pg_dsn")} if backend == "postgresql" else {}
    report = sample_harness(plant="no_fencing", **options).lease_race(1, seed=3)
    stale = [v for v in report.violations if v.invariant == "stale_writes_nothing"]
    assert any("the stale holder wrote" in v.message for v in stale), report.summary()


def test_fsync_audit_passes_the_real_write_atomic(sample_harness: SampleHarness) -> None:
    """The positive control: write_atomic's rename is followed by a directory fsync."""
    report = sample_harness().fsync_audit()
    report.raise_if_violations()
    assert report.trials >= 1, report.summary()  # it saw the rename it audits


def test_fsync_audit_catches_a_missing_directory_fsync(sample_harness: SampleHarness) -> None:
    """Without the directory fsync, the journal commits the result first: the audit says so."""
    report = sample_harness(plant="no_dir_fsync").fsync_audit()
    assert _invariants(report.violations) == {"dir_fsync"}, report.summary()
    assert "journal committed before" in report.violations[0].message
