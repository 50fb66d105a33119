"""Crash-point matrix: a real child SIGKILLs itself at each named point; new children resume.

The script (see child.py) passes the tool crash points four times per run:
@1 lookup m1.t1 (idempotent), @2 send m1.t2 (not idempotent), @3 send m2.t1,
@4 lookup m2.t2. The commits (see agent.py ``_flush``), in order:
  1 m1 answer + m1.t1 intent/submitted     5 m2.t1 result + m2.t2 intent/submitted
  2 m1.t1 result + m1.t2 intent/submitted  6 m2.t2 result
  3 m1.t2 result                           7 m3 answer + final
  4 m2 answer + m2.t1 intent/submitted
A resume is uncertain exactly when the commit holding a ``send``'s submitted
record is durable and the one holding its result is not: send m1.t2 between
commits 2 and 3, send m2.t1 between 4 and 5. So after_result@1 and
after_model_result@2 are uncertain too (their commit carries the next send's
submitted record), and so are before_intent@4 and inside_commit@3 and @5.
Each case also resolves what is uncertain from the ledger, as a person would,
and drives the run to its end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asiento.testing import CRASH_POINTS

from .oracle import (
    KILLED,
    NOT_APPLICABLE,
    ForkServer,
    RunLog,
    Runner,
    drive,
    fresh_child,
    integrity,
    violations,
)

_TOOL_POINTS = ("after_intent", "after_submitted", "inside_tool", "after_tool")

# Crash armed in the first pass -> the step UncertainEffect must name on resume (or None).
PLAIN: dict[str, str | None] = {
    "before_intent@1": None,
    "before_intent@2": None,  # m1.t1's result is lost: lookup is idempotent, it runs again
    "before_intent@3": None,
    "before_intent@4": "m2.t1",  # send m2.t1 ran, its result was to share this lost commit
    **{
        f"{p}@{n}": s
        for p in _TOOL_POINTS
        for n, s in ((1, None), (2, "m1.t2"), (3, "m2.t1"), (4, None))
    },
    "after_result@1": "m1.t2",  # that commit also holds m1.t2's submitted record
    **{f"after_result@{n}": None for n in (2, 3, 4)},
    **{f"inside_model_call@{n}": None for n in (1, 2, 3)},
    "after_model_result@1": None,
    "after_model_result@2": "m2.t1",  # that commit also holds m2.t1's submitted record
    "after_model_result@3": None,
    **{f"inside_commit@{n}": None for n in (1, 2, 4, 6, 7)},
    "inside_commit@3": "m1.t2",  # the commit of m1.t2's result is rolled back
    "inside_commit@5": "m2.t1",  # the commit of m2.t1's result is rolled back
}

# send needs approval. Pass 1 runs m1.t1 and suspends on m1.t2; pass 2 (after the
# first approval) runs m1.t2 and suspends on m2.t1; pass 3 runs m2.t1, m2.t2, m3.
APPROVAL: dict[tuple[str, int], str | None] = {
    ("after_intent@2", 1): None,  # the require_approval intent is durable: it waits, not unknown
    ("inside_commit@2", 1): None,
    ("inside_commit@1", 2): None,  # the approved step's submitted record is rolled back
    ("after_submitted@1", 2): "m1.t2",
    ("inside_tool@1", 2): "m1.t2",
    ("after_tool@1", 2): "m1.t2",
    ("inside_commit@2", 2): "m1.t2",
    ("after_result@1", 2): None,
    ("inside_model_call@1", 2): None,
    ("before_intent@1", 2): None,
    ("after_intent@1", 2): None,
    ("after_submitted@1", 3): "m2.t1",
    ("before_intent@1", 3): "m2.t1",
    ("inside_tool@2", 3): None,
    ("after_model_result@1", 3): None,
}


def _check(log: RunLog, crash: str, expected: str | None) -> None:
    history = f"{crash}:\n{log.summary()}"
    kills = [op.crash for op in log.ops if op.rc == KILLED]
    assert kills == [crash], f"the armed point did not kill exactly once; {history}"
    uncertain = [op.out["step"] for op in log.ops if op.out and op.out["outcome"] == "uncertain"]
    assert uncertain == ([expected] if expected else []), history
    assert violations(log) == [], history
    assert integrity(log.db) == "ok"


def _case(tmp_path: Path, runner: Runner, crash: str, expected: str | None, **kw: object) -> RunLog:
    log = RunLog.new(
        tmp_path / "runs.db", "run-1", tmp_path, approval=bool(kw.pop("approval", False))
    )
    drive(log, runner, crash=crash, **kw)  # type: ignore[arg-type]
    _check(log, crash, expected)
    return log


def test_matrix_covers_every_crash_point() -> None:
    """Every crash point the core defines is in the matrix or declared not applicable."""
    covered = {spec.split("@")[0] for spec in PLAIN} | {s.split("@")[0] for s, _ in APPROVAL}
    assert set(CRASH_POINTS) == covered | {"during_approval"} | NOT_APPLICABLE


@pytest.mark.parametrize(("crash", "expected"), PLAIN.items(), ids=list(PLAIN))
def test_crash_point_then_resume(
    tmp_path: Path, fork_server: ForkServer, crash: str, expected: str | None
) -> None:
    """A run killed at a crash point resumes with no repeated effect or paid answer."""
    _case(tmp_path, fork_server, crash, expected)


@pytest.mark.parametrize(
    ("crash", "run_pass", "expected"),
    [(c, n, e) for (c, n), e in APPROVAL.items()],
    ids=[f"{c}-pass{n}" for c, n in APPROVAL],
)
def test_crash_point_with_approvals(
    tmp_path: Path, fork_server: ForkServer, crash: str, run_pass: int, expected: str | None
) -> None:
    """With send behind approval, a crash around the approved effect is exact too."""
    _case(tmp_path, fork_server, crash, expected, approval=True, target=("run", run_pass))


@pytest.mark.parametrize(
    ("crash", "approval"), [("during_approval", 1), ("inside_commit@1", 1), ("during_approval", 2)]
)
def test_harness_killed_while_approving(
    tmp_path: Path, fork_server: ForkServer, crash: str, approval: int
) -> None:
    """A harness killed while approving records nothing; approving again runs send once."""
    log = _case(tmp_path, fork_server, crash, None, approval=True, target=("approve", approval))
    killed = next(i for i, op in enumerate(log.ops) if op.rc == KILLED)
    step = log.ops[killed - 1].out["step"]  # the suspension the harness was answering
    resumed, approved = log.ops[killed + 1], log.ops[killed + 2]
    assert "approval" not in resumed.before.get(step, {})
    assert resumed.status_before == "suspended"
    assert resumed.out == log.ops[killed - 1].out
    assert (approved.op, approved.rc, approved.out["step"]) == ("approve", 0, step)
    assert [e["step"] for e in log.effect_lines()].count(step) == 1


@pytest.mark.parametrize(
    ("crash", "expected"),
    [("inside_tool@2", "m1.t2"), ("inside_model_call@2", None), ("after_tool@1", None)],
)
def test_fresh_interpreters_armed_by_environment(
    tmp_path: Path, crash: str, expected: str | None
) -> None:
    """The same holds with a new interpreter per pass, armed through ASIENTO_CRASH_AT."""
    _case(tmp_path, fresh_child, crash, expected)


def test_crash_inside_a_retry_is_uncertain_too(tmp_path: Path, fork_server: ForkServer) -> None:
    """After 'did not happen', a crash inside the retry stops uncertain at attempt /2."""
    log = RunLog.new(tmp_path / "runs.db", "run-1", tmp_path)
    assert log.advance(fork_server, crash="after_submitted@2").rc == KILLED  # send not run
    assert log.advance(fork_server).out == {"outcome": "uncertain", "step": "m1.t2", "tool": "send"}
    assert log.advance(fork_server).out["happened"] is False
    assert log.advance(fork_server, crash="inside_tool@1").rc == KILLED  # the retry, inside send
    assert log.advance(fork_server).out["step"] == "m1.t2/2"
    assert log.advance(fork_server).out["happened"] is True
    drive(log, fork_server)
    assert violations(log) == []
    assert [e["step"] for e in log.effect_lines()].count("m1.t2") == 1
