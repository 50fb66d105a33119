"""The ``asiento`` command, run as a real process against real journal files."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asiento import (
    Agent,
    ApprovalStep,
    FinalStep,
    ModelResponse,
    Session,
    SqliteCheckpointer,
    Step,
    ToolCall,
    ToolStep,
    UncertainEffect,
    require_approval_for,
    tool,
)
from asiento.testing import ScriptedGateway

SCRIPT = [
    ModelResponse(tool_calls=[ToolCall(name="pay", arguments={"amount": 120})]),
    ModelResponse(text="paid"),
]


class Killed(BaseException):
    """Stands for the process dying inside the tool: not an error the loop records."""


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python -m asiento ARGS`` in ``cwd``."""
    env = {k: v for k, v in os.environ.items() if k != "ASIENTO_CRASH_AT"}
    env["COLUMNS"] = "200"
    argv = [sys.executable, "-m", "asiento", *args]
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 1, one line on stderr naming the problem, no traceback."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr


async def drive(db: Path, run_id: str, *, dies: bool = False) -> tuple[list[Step], int]:
    """One pass of a payment run that needs approval (or dies inside an uncertain tool)."""
    executions = []

    @tool
    def pay(amount: int) -> str:
        """Pay an amount."""
        executions.append(amount)
        if dies:
            raise Killed
        return "tx-1"

    policy = None if dies else require_approval_for("pay")
    agent = Agent(tools=[pay], policy=policy)
    store = SqliteCheckpointer(db)
    try:
        session = Session(run_id, ScriptedGateway(SCRIPT), store)
        steps = [s async for s in agent.run("pay 120", session=session)]
    finally:
        await store.close()
    return steps, len(executions)


async def suspended(db: Path, run_id: str) -> str:
    """A run suspended on its payment; the fingerprint of the frozen arguments."""
    steps, executions = await drive(db, run_id)
    assert executions == 0
    approval = steps[-1]
    assert isinstance(approval, ApprovalStep)
    return approval.fingerprint


async def uncertain(db: Path, run_id: str) -> None:
    """A run whose non-idempotent payment was submitted and has no recorded outcome."""
    with pytest.raises(Killed):
        await drive(db, run_id, dies=True)
    with pytest.raises(UncertainEffect):
        await drive(db, run_id)


def test_demo_prints_the_measured_table(tmp_path: Path) -> None:
    """`python -m asiento demo` kills and resumes real processes and prints the measured counts."""
    proc = cli("demo", "--keep", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"^ ?1\s+1\s+1\s+killed by SIGKILL\s+← el proceso muere aquí", out, re.M)
    assert re.search(r"^ ?2\s+1\s+0\s+closed\s+← solo ocurre lo que", out, re.M)
    assert re.search(r"^ ?3\s+0\s+0\s+already closed\s+← un run cerrado no se reabre", out, re.M)
    assert re.search(r"run-1:m2:[0-9a-f]{32}; pass 2 asked again with the same key", out)
    assert "Guarantee:" in out
    kept = Path(re.findall(r"The journal is kept at (\S+)", out)[-1])
    try:
        listed = json.loads(cli("runs", "--store", str(kept), "--json", cwd=tmp_path).stdout)
        assert [(r["run_id"], r["status"]) for r in listed] == [("run-1", "closed")]
    finally:
        shutil.rmtree(kept.parent)


def test_demo_refuses_an_existing_store(tmp_path: Path) -> None:
    """The demo needs a fresh journal: an existing --store file is a clear error."""
    (tmp_path / "old.db").write_text("keep me")
    proc = cli("demo", "--store", "old.db", cwd=tmp_path)
    assert_one_line_error(proc, "old.db already exists")
    assert (tmp_path / "old.db").read_text() == "keep me"


async def test_runs_lists_runs_from_the_default_store(tmp_path: Path) -> None:
    """`runs` reads ./runs.db by default, filters by status, and prints a table or JSON."""
    await suspended(tmp_path / "runs.db", "waiting")
    await uncertain(tmp_path / "runs.db", "unsure")
    table = cli("runs", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert re.search(r"waiting\s*│\s*suspended\s*│\s*2\s*│", table.stdout)
    assert re.search(r"unsure\s*│\s*uncertain", table.stdout)
    everything = json.loads(cli("runs", "--json", cwd=tmp_path).stdout)
    assert {r["run_id"]: r["status"] for r in everything} == {
        "waiting": "suspended",
        "unsure": "uncertain",
    }
    only = json.loads(cli("runs", "--status", "suspended", "--json", cwd=tmp_path).stdout)
    assert [r["run_id"] for r in only] == ["waiting"]


async def test_show_prints_the_timeline(tmp_path: Path) -> None:
    """`show` prints step, phase, decision and a short payload per record, or the JSON."""
    fp = await suspended(tmp_path / "runs.db", "run-1")
    table = cli("show", "run-1", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "run 'run-1' · suspended" in table.stdout
    assert re.search(r"m1\s*│\s*result\s*│\s*│\s*\{\"fp\"", table.stdout)
    intent = r"m1\.t1\s*│\s*intent\s*│\s*require_approval\s*│\s*\{\"tool\":\"pay\""
    assert re.search(intent, table.stdout)
    shown = json.loads(cli("show", "run-1", "--json", cwd=tmp_path).stdout)
    assert shown["status"] == "suspended"
    records = [(e["step_id"], e["phase"], e["decision"]) for e in shown["events"]]
    assert records == [("m1", "result", None), ("m1.t1", "intent", "require_approval")]
    assert shown["events"][1]["payload"] == {"tool": "pay", "args": {"amount": 120}, "fp": fp}


async def test_approve_lets_the_next_pass_pay_once(tmp_path: Path) -> None:
    """`approve` records who approved; the next pass pays exactly once and closes the run."""
    db = tmp_path / "runs.db"
    await suspended(db, "run-1")
    proc = cli("approve", "run-1", "m1.t1", "--by", "ana", "--reason", "ok", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "approved run 'run-1' step 'm1.t1'" in proc.stdout
    shown = json.loads(cli("show", "run-1", "--json", cwd=tmp_path).stdout)
    approval = shown["events"][-1]
    assert (approval["phase"], approval["decision"]) == ("approval", "approved")
    assert (approval["payload"]["by"], approval["payload"]["reason"]) == ("ana", "ok")
    steps, executions = await drive(db, "run-1")
    assert executions == 1
    assert isinstance(steps[-1], FinalStep)
    assert (await drive(db, "run-1"))[1] == 0


async def test_approve_checks_the_fingerprint(tmp_path: Path) -> None:
    """`approve --fingerprint` with other arguments' fingerprint records nothing."""
    fp = await suspended(tmp_path / "runs.db", "run-1")
    wrong = cli("approve", "run-1", "m1.t1", "--by", "ana", "--fingerprint", "0" * 64, cwd=tmp_path)
    assert_one_line_error(wrong, "nothing was recorded")
    right = cli("approve", "run-1", "m1.t1", "--by", "ana", "--fingerprint", fp, cwd=tmp_path)
    assert right.returncode == 0, right.stderr


async def test_deny_feeds_the_denial_to_the_model(tmp_path: Path) -> None:
    """`deny` records the reason; the next pass does not pay and tells the model why."""
    db = tmp_path / "runs.db"
    await suspended(db, "run-1")
    proc = cli("deny", "run-1", "m1.t1", "--by", "ana", "--reason", "too much", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    steps, executions = await drive(db, "run-1")
    assert executions == 0
    denied = [s for s in steps if isinstance(s, ToolStep)]
    assert [(s.status, s.result) for s in denied] == [("denied", "too much")]


async def test_deny_without_reason_is_refused(tmp_path: Path) -> None:
    """`deny` requires --reason: the model is told why, so a reason must exist."""
    await suspended(tmp_path / "runs.db", "run-1")
    proc = cli("deny", "run-1", "m1.t1", "--by", "ana", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--reason" in proc.stderr
    shown = json.loads(cli("show", "run-1", "--json", cwd=tmp_path).stdout)
    assert [e["phase"] for e in shown["events"]] == ["result", "intent"]


async def test_resolve_happened_feeds_the_recorded_outcome(tmp_path: Path) -> None:
    """`resolve --happened` records the remote id; the next pass does not pay again."""
    db = tmp_path / "runs.db"
    await uncertain(db, "run-1")
    args = ("run-1", "m1.t1", "--happened", "--remote-id", "tx-9", "--by", "ana")
    proc = cli("resolve", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(cli("show", "run-1", "--json", cwd=tmp_path).stdout)
    resolution = shown["events"][-1]
    assert resolution["phase"] == "resolution"
    assert (resolution["payload"]["happened"], resolution["payload"]["remote_id"]) == (True, "tx-9")
    steps, executions = await drive(db, "run-1")
    assert executions == 0
    assert isinstance(steps[-1], FinalStep)


async def test_resolve_not_happened_runs_the_effect_once_more(tmp_path: Path) -> None:
    """`resolve --not-happened` lets the next pass run the effect again, exactly once."""
    db = tmp_path / "runs.db"
    await uncertain(db, "run-1")
    proc = cli("resolve", "run-1", "m1.t1", "--not-happened", "--by", "ana", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    steps, executions = await drive(db, "run-1")
    assert executions == 1
    assert isinstance(steps[-1], FinalStep)


async def test_resolve_needs_a_finding_and_an_uncertain_step(tmp_path: Path) -> None:
    """`resolve` without --happened/--not-happened, or on a step that is not uncertain, fails."""
    await uncertain(tmp_path / "runs.db", "run-1")
    undecided = cli("resolve", "run-1", "m1.t1", "--by", "ana", cwd=tmp_path)
    assert_one_line_error(undecided, "--happened or --not-happened")
    certain = cli("resolve", "run-1", "m1", "--happened", "--by", "ana", cwd=tmp_path)
    assert_one_line_error(certain, "'m1'", "not uncertain")


@pytest.mark.parametrize(
    "args",
    [
        ("runs",),
        ("show", "run-1"),
        ("approve", "run-1", "m1.t1", "--by", "ana"),
        ("resolve", "run-1", "m1.t1", "--happened", "--by", "ana"),
    ],
)
def test_a_missing_store_is_an_error_and_is_not_created(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    """Every journal command refuses a missing store file and does not create it."""
    proc = cli(*args, "--store", "nope.db", cwd=tmp_path)
    assert_one_line_error(proc, "no journal at nope.db")
    assert list(tmp_path.iterdir()) == []


async def test_an_unknown_run_is_an_error(tmp_path: Path) -> None:
    """`show` and `approve` on a run the journal does not hold name it and exit 1."""
    await suspended(tmp_path / "runs.db", "run-1")
    assert_one_line_error(cli("show", "ghost", cwd=tmp_path), "unknown run 'ghost'")
    proc = cli("approve", "ghost", "m1.t1", "--by", "ana", cwd=tmp_path)
    assert_one_line_error(proc, "unknown run 'ghost'")


async def test_a_step_not_awaiting_approval_is_an_error(tmp_path: Path) -> None:
    """Approving a model step, an unknown step, or a step already decided exits 1, one line."""
    await suspended(tmp_path / "runs.db", "run-1")
    model_step = cli("approve", "run-1", "m1", "--by", "ana", cwd=tmp_path)
    assert_one_line_error(model_step, "'m1' is not awaiting approval")
    unknown_step = cli("deny", "run-1", "m9.t1", "--by", "ana", "--reason", "no", cwd=tmp_path)
    assert_one_line_error(unknown_step, "'m9.t1' is not awaiting approval")
    assert cli("approve", "run-1", "m1.t1", "--by", "ana", cwd=tmp_path).returncode == 0
    again = cli("deny", "run-1", "m1.t1", "--by", "bob", "--reason", "no", cwd=tmp_path)
    assert_one_line_error(again, "already decided")


def test_a_file_that_is_not_a_journal_is_an_error(tmp_path: Path) -> None:
    """A store that is not an asiento journal is refused in one line and left as it was."""
    (tmp_path / "notes.db").write_text("not sqlite at all " * 100)
    proc = cli("runs", "--store", "notes.db", cwd=tmp_path)
    assert_one_line_error(proc, "not an asiento journal")
    assert (tmp_path / "notes.db").read_text() == "not sqlite at all " * 100
