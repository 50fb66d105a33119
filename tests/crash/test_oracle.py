"""Negative controls: the invariant checker flags each broken promise planted in real data.

A crash test that cannot fail proves nothing. Each test here takes the ledgers
of a real run, plants one defect in a copy (a second effect, a paid answer asked
again, a wrong outcome) and shows that ``violations`` names it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from .oracle import ForkServer, RunLog, drive, read_ledger, violations


@pytest.fixture
def clean_log(tmp_path: Path, fork_server: ForkServer) -> RunLog:
    """A run driven to its end without crashes, then asked once more."""
    log = RunLog.new(tmp_path / "runs.db", "run-1", tmp_path)
    drive(log, fork_server)
    return log


@pytest.fixture
def uncertain_log(tmp_path: Path, fork_server: ForkServer) -> RunLog:
    """A run killed inside send m1.t2, stopped as uncertain, resolved and finished."""
    log = RunLog.new(tmp_path / "runs.db", "run-2", tmp_path)
    drive(log, fork_server, crash="inside_tool@2")
    return log


def _copy(source: Path, target: Path, edit: Any) -> Path:
    lines = edit(read_ledger(source))
    target.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return target


def _plant(log: RunLog, tmp_path: Path, ledger: str, edit: Any) -> RunLog:
    copy = _copy(getattr(log, ledger), tmp_path / f"planted.{ledger}", edit)
    return dataclasses.replace(log, **{ledger: copy})


def _send(lines: list[dict[str, Any]], step: str) -> dict[str, Any]:
    return next(line for line in lines if line["step"] == step)


PLANTED = {
    "double effect": (
        "effects",
        lambda lines: [*lines, _send(lines, "m1.t2")],
        "non-idempotent send applied 2 times for step m1.t2",
    ),
    "idempotent tool re-run after its result": (
        "effects",
        lambda lines: [*lines, _send(lines, "m1.t1")],
        "lookup ran again for step m1.t1 whose outcome was recorded",
    ),
    "lost effect": (
        "effects",
        lambda lines: [line for line in lines if line["step"] != "m2.t1"],
        "send m2.t1 has 0 ledger lines",
    ),
    "paid answer asked again": (
        "models",
        lambda lines: [*lines, lines[0]],
        "requested again after its answer was recorded",
    ),
    "same step under a new key": (
        "models",
        lambda lines: [*lines, lines[0] | {"key": lines[0]["key"][:-4] + "beef"}],
        "model step m1 was requested under 2 keys",
    ),
}


def test_checker_accepts_a_clean_run(clean_log: RunLog) -> None:
    """The positive control: an uncrashed run has no violations."""
    assert violations(clean_log) == []


@pytest.mark.parametrize(("ledger", "edit", "message"), PLANTED.values(), ids=list(PLANTED))
def test_checker_flags_a_planted_defect(
    clean_log: RunLog, tmp_path: Path, ledger: str, edit: Any, message: str
) -> None:
    """A defect planted in a copy of a real ledger is reported by name."""
    found = violations(_plant(clean_log, tmp_path, ledger, edit))
    assert any(message in v for v in found), found


def test_checker_flags_going_on_past_an_uncertain_step(
    uncertain_log: RunLog, tmp_path: Path
) -> None:
    """An effect applied by the pass that should have stopped as uncertain is reported."""
    stopped = next(i for i, op in enumerate(uncertain_log.ops) if op.rc == 3)
    at = uncertain_log.ops[stopped].effects_at
    line = {"run": "run-2", "tool": "send", "step": "m1.t2"}
    planted = _plant(uncertain_log, tmp_path, "effects", lambda ls: [*ls[:at], line, *ls[at:]])
    # The planted line belongs to the stopped pass: later passes start one line further.
    ops = [
        dataclasses.replace(op, effects_at=op.effects_at + 1) if i > stopped else op
        for i, op in enumerate(planted.ops)
    ]
    found = violations(dataclasses.replace(planted, ops=ops))
    assert any("went on past uncertain ['m1.t2']" in v for v in found), found
    assert any("applied 2 times for step m1.t2" in v for v in found), found


def test_checker_flags_an_uncertain_effect_that_was_not_raised(uncertain_log: RunLog) -> None:
    """A pass that ran on where the journal says 'unknown' is reported."""
    assert violations(uncertain_log) == []
    stopped = next(i for i, op in enumerate(uncertain_log.ops) if op.rc == 3)
    ops = list(uncertain_log.ops)
    ops[stopped] = dataclasses.replace(ops[stopped], rc=0, out={"outcome": "closed"})
    found = violations(dataclasses.replace(uncertain_log, ops=ops))
    assert any("journal had uncertain ['m1.t2'] but the pass ended" in v for v in found), found


def test_checker_flags_an_uncertain_effect_without_cause(clean_log: RunLog) -> None:
    """An UncertainEffect where the journal holds no unknown step is reported."""
    ops = list(clean_log.ops)
    ops[0] = dataclasses.replace(ops[0], rc=3, out={"outcome": "uncertain", "step": "m1.t2"})
    found = violations(dataclasses.replace(clean_log, ops=ops))
    assert any("with no uncertain step in the journal" in v for v in found), found


def _unseen_submit(log: RunLog, *, killed_before: bool) -> RunLog:
    """The stopping pass's snapshot lacks m1.t2's submitted record, as when the killed
    writer's commit was hidden from the oracle's snapshot and recovered by the pass."""
    stopped = next(i for i, op in enumerate(log.ops) if op.rc == 3)
    ops = list(log.ops)
    before = {step: dict(phases) for step, phases in ops[stopped].before.items()}
    del before["m1.t2"]["submitted"]
    ops[stopped] = dataclasses.replace(ops[stopped], before=before)
    if not killed_before:
        ops[:stopped] = [dataclasses.replace(op, rc=0) for op in ops[:stopped]]
    return dataclasses.replace(log, ops=ops)


def test_checker_accepts_a_commit_of_a_killed_writer_that_surfaced_late(
    uncertain_log: RunLog,
) -> None:
    """A killed op's commit missing from the snapshot but created before the pass started
    justifies the pass's UncertainEffect (tests/crash/test_wal_recovery.py shows how)."""
    assert violations(_unseen_submit(uncertain_log, killed_before=True)) == []


def test_checker_does_not_excuse_late_records_without_a_killed_writer(
    uncertain_log: RunLog,
) -> None:
    """Without an earlier killed op nothing can surface late: the same history is flagged."""
    found = violations(_unseen_submit(uncertain_log, killed_before=False))
    assert any("with no uncertain step in the journal" in v for v in found), found
