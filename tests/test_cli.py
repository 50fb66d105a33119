"""The ``asiento`` command, run as a real process against real journal files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest
from psycopg.conninfo import conninfo_to_dict

from asiento import (
    Agent,
    App,
    ApprovalStep,
    FinalStep,
    Holder,
    ModelRequest,
    ModelResponse,
    Session,
    SqliteCheckpointer,
    Step,
    ToolCall,
    ToolStep,
    UncertainEffect,
    Usage,
    UsageError,
    Worker,
    open_store,
    require_approval_for,
    shutdown,
    submit,
    tool,
)
from asiento.journal.url import address_of, shown
from asiento.testing import ScriptedGateway
from journal.mounts import read_only_view
from web.runs import book, closed_with_effect
from web.runs import uncertain as priced_uncertain

SCRIPT = [
    ModelResponse(
        tool_calls=[ToolCall(name="pay", arguments={"amount": 120})],
        usage=Usage(input_tokens=400, output_tokens=30),
    ),
    ModelResponse(text="paid", usage=Usage(input_tokens=450, output_tokens=5)),
]


class Killed(BaseException):
    """Stands for the process dying inside the tool: not an error the loop records."""


def cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m asiento ARGS`` in ``cwd`` (with ``env`` added to a clean environment)."""
    env = {**clean_env(), "COLUMNS": "200", **(env or {})}
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


async def drive(db: Path | str, run_id: str, *, dies: bool = False) -> tuple[list[Step], int]:
    """One pass of a payment run that needs approval (or dies inside an uncertain tool).

    ``db`` is an SQLite file, or any other store string ``open_store`` takes.
    """
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
    store = await open_store(db)
    try:
        session = Session(run_id, ScriptedGateway(SCRIPT), store)
        steps = [s async for s in agent.run("pay 120", session=session)]
    finally:
        await store.close()
    return steps, len(executions)


async def suspended(db: Path | str, run_id: str) -> str:
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
    """`show` prints each record step by step with its decision and what it says, and what
    the run awaits, with the command that decides it; --json has the same, whole."""
    fp = await suspended(tmp_path / "runs.db", "run-1")
    table = cli("show", "run-1", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "run 'run-1' · suspended · 2 steps · 2 records · last activity" in table.stdout
    assert "model calls 1 (400 in / 30 out)" in table.stdout
    at = r"\d\d:\d\d:\d\d"
    model = rf"m1\s*│\s*result\s*│\s*│\s*{at}\s*│\s*asks pay\(\{{\"amount\":120\}}\) \[400\+30"
    assert re.search(model, table.stdout)
    intent = rf"m1\.t1\s*│\s*intent\s*│\s*require_approval\s*│\s*{at}\s*│\s*pay\(\{{\"amount\":120"
    assert re.search(intent, table.stdout)
    assert f'awaiting approval: m1.t1 pay({{"amount":120}}), fingerprint {fp}' in table.stdout
    assert "asiento approve run-1 m1.t1 --by NAME" in table.stdout
    shown = json.loads(cli("show", "run-1", "--json", cwd=tmp_path).stdout)
    assert shown["status"] == "suspended"
    records = [(e["step_id"], e["phase"], e["decision"]) for e in shown["events"]]
    assert records == [("m1", "result", None), ("m1.t1", "intent", "require_approval")]
    assert shown["events"][1]["payload"] == {"tool": "pay", "args": {"amount": 120}, "fp": fp}
    [awaiting] = shown["awaiting"]
    assert (awaiting["kind"], awaiting["step_id"], awaiting["fingerprint"]) == (
        "approval",
        "m1.t1",
        fp,
    )
    assert shown["effects"] == []


# What a model may name a tool: a clear-screen, a clipboard write (OSC 52), a C1 CSI, and a
# right-to-left override; and an argument with a carriage return that rewrites the line.
HOSTILE = "\x1b[2J\x1b]52;c;aGkK\x07pay\u202egpj.exe\x9b"


async def test_show_spells_out_what_a_model_wrote_instead_of_obeying_it(tmp_path: Path) -> None:
    store = SqliteCheckpointer(tmp_path / "runs.db")
    call = ToolCall(name=HOSTILE, arguments={"to": "ana\rOK: nothing to see"})
    gw = ScriptedGateway([ModelResponse(tool_calls=[call]), ModelResponse(text="done")])
    async for _ in Agent(tools=[]).run("x", session=Session("run-1", gw, store)):
        pass
    await store.close()
    table = cli("show", "run-1", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    for raw in ("\x1b", "\x07", "\x9b", "\u202e", "\r"):
        assert raw not in table.stdout, f"{raw!r} reached the terminal"
    assert "\\x1b[2J\\x1b]52;c;aGkK\\x07pay\\u202egpj.exe\\x9b" in table.stdout
    as_json = cli("show", "run-1", "--json", cwd=tmp_path)
    for raw in ("\x1b", "\x07", "\x9b", "\u202e", "\r"):
        assert raw not in as_json.stdout, f"{raw!r} reached the terminal in --json"
    shown = json.loads(as_json.stdout)
    assert shown["events"][1]["payload"]["tool"] == HOSTILE  # the same string, parsed
    runs = cli("runs", cwd=tmp_path)
    assert "\x1b" not in runs.stdout


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


MEMO = {"amount": 120, "to": "ACME", "memo": "invoice 2026-11 for consulting services rendered"}


async def memo_run(db: Path, run_id: str) -> None:
    """A run suspended on a payment whose arguments are longer than an 80-column cell."""
    script = [ModelResponse(tool_calls=[ToolCall(name="pay", arguments=MEMO)]), ModelResponse()]

    @tool
    def pay(amount: int, to: str, memo: str) -> str:
        """Pay an amount, with a memo."""
        return "tx-1"

    store = SqliteCheckpointer(db)
    try:
        session = Session(run_id, ScriptedGateway(script), store)
        agent = Agent(tools=[pay], policy=require_approval_for("pay"))
        steps = [s async for s in agent.run("pay with a memo", session=session)]
    finally:
        await store.close()
    assert isinstance(steps[-1], ApprovalStep)


def cell_lines(out: str, step_id: str) -> list[str]:
    """The lines of the last column ("what") of ``step_id``'s first row in a rich table."""
    lines = out.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith(f"│ {step_id} "))
    cells = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("│ ") or line.split("│")[1].strip():
            break
        cells.append(line)
    return [line.split("│")[-2].strip() for line in cells]


async def test_show_at_80_columns_cuts_json_only_between_words(tmp_path: Path) -> None:
    """In an 80-column terminal `show` wraps and shortens a call's JSON between words and
    members, never inside one: its lines, joined by spaces, give the call's own text."""
    await memo_run(tmp_path / "runs.db", "run-1")
    out = cli("show", "run-1", cwd=tmp_path, env={"COLUMNS": "80"}).stdout
    assert max(len(line) for line in out.splitlines()) <= 80
    args = json.dumps(MEMO, ensure_ascii=False, separators=(", ", ":"))
    whole = f"pay({args})"
    for step_id, said in (("m1", f"asks {whole}"), ("m1.t1", whole)):
        pieces = cell_lines(out, step_id)
        assert len(pieces) > 1, out  # it did not fit one line of the cell
        shown = " ".join(pieces)
        kept = shown.removesuffix("…").rstrip()
        assert said.startswith(kept), (shown, said)
        assert kept == said or said[len(kept)] == " ", (shown, said)  # cut at a word's end
    waiting = out[out.index("awaiting approval:") : out.index("  asiento approve")]
    assert (
        " ".join(waiting.split())
        == f"awaiting approval: m1.t1 {whole}, fingerprint " + (waiting.split()[-1])
    )


async def test_deny_without_reason_is_refused(tmp_path: Path) -> None:
    """`deny` requires --reason: the model is told why, so a reason must exist."""
    await suspended(tmp_path / "runs.db", "run-1")
    proc = cli("deny", "run-1", "m1.t1", "--by", "ana", cwd=tmp_path)
    assert_one_line_error(proc, "Missing option '--reason'")
    shown = json.loads(cli("show", "run-1", "--json", cwd=tmp_path).stdout)
    assert [e["phase"] for e in shown["events"]] == ["result", "intent"]


async def test_the_uncertain_error_names_the_command_that_resolves_it(tmp_path: Path) -> None:
    """UncertainEffect's message gives the `asiento resolve` command besides the Python call;
    run as printed (with a name), it records the finding and the next pass does not pay."""
    db = tmp_path / "runs.db"
    with pytest.raises(Killed):
        await drive(db, "run 1", dies=True)
    with pytest.raises(UncertainEffect) as stopped:
        await drive(db, "run 1")
    message = str(stopped.value)
    assert "asiento.resolve(store, 'run 1', 'm1.t1', happened=...)" in message
    command = re.search(r"`(asiento resolve [^`]+)`", message)
    assert command is not None, message
    assert command.group(1) == (
        "asiento resolve 'run 1' m1.t1 --happened [--remote-id ID] | --not-happened --by NAME"
    )
    argv = [*shlex.split(command.group(1).split(" [")[0])[1:], "--by", "ana"]
    proc = cli(*argv, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    _, executions = await drive(db, "run 1")
    assert executions == 0


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


def test_a_directory_as_store_says_so_in_plain_words(tmp_path: Path) -> None:
    """`--store` naming a directory is one line saying it is a directory and naming a file
    in it to pass instead; the directory is left as it is."""
    (tmp_path / "journals").mkdir()
    proc = cli("runs", "--store", "journals", cwd=tmp_path)
    assert_one_line_error(
        proc,
        "journals is a directory, not a journal; pass --store PATH_OR_URL naming the "
        "journal's file (such as journals/runs.db)",
    )
    assert "no journal at journals is" not in proc.stderr
    assert list((tmp_path / "journals").iterdir()) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("approve", "run-1", "m1.t1"), "Missing option '--by'."),
        (("resolve", "run-1", "m1.t1", "--happened"), "Missing option '--by'."),
        (("abandon", "run-1", "--reason", "x"), "Missing option '--by'."),
        (("approve", "run-1", "--by", "ana"), "Missing argument 'STEP'."),
        (("runs", "--status", "asleep"), "Invalid value for '--status'"),
        (("show", "run-1", "--colour"), "No such option '--colour'"),
        (("shwo",), "No such command 'shwo'."),
    ],
)
async def test_a_usage_error_is_one_line_and_exit_status_1(
    tmp_path: Path, args: tuple[str, ...], says: str
) -> None:
    """A missing --by (or argument), a bad choice, an unknown option or command is one line
    on stderr naming it and how to get help, exit status 1, like every other error; nothing
    is recorded."""
    await suspended(tmp_path / "runs.db", "run-1")
    before = json.loads(cli("show", "run-1", "--json", cwd=tmp_path).stdout)["events"]
    proc = cli(*args, cwd=tmp_path)
    assert_one_line_error(proc, says, "for help.")
    assert "Usage:" not in proc.stderr
    assert json.loads(cli("show", "run-1", "--json", cwd=tmp_path).stdout)["events"] == before


def test_asiento_alone_still_prints_its_help(tmp_path: Path) -> None:
    """`asiento` with no command prints its help, as before (not an error line)."""
    proc = cli(cwd=tmp_path)
    assert "Usage:" in proc.stdout + proc.stderr
    assert "Commands:" in proc.stdout + proc.stderr


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
    assert_one_line_error(unknown_step, "run 'run-1' has no step 'm9.t1'")
    assert cli("approve", "run-1", "m1.t1", "--by", "ana", cwd=tmp_path).returncode == 0
    again = cli("deny", "run-1", "m1.t1", "--by", "bob", "--reason", "no", cwd=tmp_path)
    assert_one_line_error(again, "was already approved by ana at", "nothing was recorded")


def test_a_file_that_is_not_a_journal_is_an_error(tmp_path: Path) -> None:
    """A store that is not an asiento journal is refused in one line and left as it was."""
    (tmp_path / "notes.db").write_text("not sqlite at all " * 100)
    proc = cli("runs", "--store", "notes.db", cwd=tmp_path)
    assert_one_line_error(proc, "not an asiento journal")
    assert (tmp_path / "notes.db").read_text() == "not sqlite at all " * 100


# -- the run index, effects, store URLs --------------------------------------------------


async def test_runs_shows_lease_holder_ledger_and_filters(tmp_path: Path) -> None:
    """`runs` shows who holds a lease, calls and tokens paid and saved; --status repeats."""
    db = tmp_path / "runs.db"
    await suspended(db, "waiting")
    await uncertain(db, "unsure")
    await drive(db, "closed", dies=False)
    assert cli("approve", "closed", "m1.t1", "--by", "ana", cwd=tmp_path).returncode == 0
    await drive(db, "closed")
    store = SqliteCheckpointer(db)
    try:
        lease = await store.acquire("waiting", Holder.here(), ttl=600)
    finally:
        await store.close()
    table = cli("runs", cwd=tmp_path).stdout
    assert re.search(
        rf"waiting\s*│\s*suspended\s*│\s*2\s*│[^│]*│\s*{lease.owner[:8]} \(\d+s left\)", table
    )
    shown = cli("show", "waiting", cwd=tmp_path).stdout  # and which process holds it
    machine = socket.gethostname()
    assert re.search(
        rf"lease: {lease.owner[:8]} \(\d+s left\), pid {os.getpid()} on {re.escape(machine)}", shown
    )
    assert re.search(
        r"unsure\s*│\s*uncertain\s*│\s*2\s*│[^│]*│\s*│\s*1\s*│\s*400/30\s*│\s*1\s*│\s*400/30",
        table,
    )
    assert re.search(r"closed\s*│\s*closed\s*│\s*3\s*│[^│]*│\s*│\s*2\s*│\s*850/35\s*│", table)
    listed = json.loads(
        cli("runs", "--json", "--status", "uncertain", "--status", "closed", cwd=tmp_path).stdout
    )
    assert [(r["run_id"], r["replayed_calls"], r["saved_input_tokens"]) for r in listed] == [
        ("unsure", 1, 400),
        ("closed", 1, 400),
    ]
    held = json.loads(cli("runs", "--json", "--status", "suspended", cwd=tmp_path).stdout)
    assert held[0]["lease_owner"] == lease.owner
    assert "cost" not in table


KILLED_CHILD = """
import asyncio, os, signal, sys
from asiento import Agent, ModelResponse, Session, SqliteCheckpointer, ToolCall, tool
from asiento.testing import ScriptedGateway

@tool
def pay(amount: int) -> str:
    \"\"\"Pay an amount; the process is killed while it pays.\"\"\"
    os.kill(os.getpid(), signal.SIGKILL)
    return "tx-1"

async def main() -> None:
    script = [ModelResponse(tool_calls=[ToolCall(name="pay", arguments={"amount": 1})])]
    session = Session("killed", ScriptedGateway(script), SqliteCheckpointer(sys.argv[1]),
                      lease_ttl=float(sys.argv[2]))
    async for _ in Agent(tools=[pay]).run("pay 1", session=session):
        pass

asyncio.run(main())
"""


def killed_mid_run(db: Path, lease_ttl: float) -> None:
    """A real process drives run ``killed`` and dies by SIGKILL inside its tool."""
    argv = [sys.executable, "-c", KILLED_CHILD, str(db), str(lease_ttl)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr


def states(cwd: Path) -> dict[str, tuple[str, str, str]]:
    """run id: (status, state, next), as `runs --json` gives them."""
    listed = json.loads(cli("runs", "--json", cwd=cwd).stdout)
    return {r["run_id"]: (r["status"], r["state"], r["next"]) for r in listed}


async def test_runs_says_whether_a_process_drives_a_running_run(tmp_path: Path) -> None:
    """A run stored as `running` is shown `running` only while a session holds its lease;
    approved with nobody driving it, it is `ready to resume` (a run of one's own program)
    or `waiting for a worker` (submitted), in the table and in --json (whose `status` stays
    the stored one), each with what to do next."""
    db = tmp_path / "runs.db"
    await suspended(db, "mine")
    store = SqliteCheckpointer(db)
    try:
        await submit(store, "queued", "pay 120", agent="billing")
        await submit(store, "driven", "pay 120", agent="billing")
        await store.acquire("driven", Holder.here(), ttl=600)
    finally:
        await store.close()
    await drive(db, "queued")  # the submitted run suspends on its payment too
    approved = cli("approve", "mine", "m1.t1", "--by", "ana", cwd=tmp_path)
    assert approved.stdout.splitlines()[-1] == (
        "The run is ready to resume: run its agent again with the same run_id, "
        "Session('mine', gateway, store), to go on."
    )
    queued = cli("approve", "queued", "m1.t1", "--by", "ana", "--store", "./runs.db", cwd=tmp_path)
    assert queued.stdout.splitlines()[-1] == (
        "The run is waiting for a worker: a worker picks it up by itself (if none runs, "
        "start one with asiento worker --app MODULE:ATTR --store ./runs.db)."
    )
    found = states(tmp_path)
    assert {run: (status, state) for run, (status, state, _) in found.items()} == {
        "mine": ("running", "ready to resume"),
        "queued": ("running", "waiting for a worker"),
        "driven": ("running", "running"),
    }
    assert "asiento worker --app MODULE:ATTR" in found["queued"][2]
    assert found["driven"][2] == "the session driving it goes on by itself"
    table = cli("runs", cwd=tmp_path).stdout
    assert re.search(r"┃\s*run\s*┃\s*state\s*┃\s*steps\s*┃", table), table
    assert re.search(r"mine\s*│\s*ready to resume\s*│", table), table
    assert re.search(r"queued\s*│\s*waiting for a worker\s*│", table), table
    assert re.search(r"driven\s*│\s*running\s*│", table), table
    shown = cli("show", "mine", cwd=tmp_path).stdout
    assert "run 'mine' · ready to resume (status running) · 2 steps" in shown, shown
    assert "next: run its agent again with the same run_id, Session('mine', gateway," in shown
    whole = json.loads(cli("show", "mine", "--json", cwd=tmp_path).stdout)
    assert (whole["status"], whole["state"], whole["run"]["state"]) == (
        "running",
        "ready to resume",
        "ready to resume",
    )


async def test_a_run_whose_process_was_killed_is_ready_once_its_lease_expires(
    tmp_path: Path,
) -> None:
    """A run whose process died by SIGKILL holds its lease until it expires (`running`:
    the lease cannot tell a killed holder from a live one); then it is `ready to resume`."""
    db = tmp_path / "runs.db"
    killed_mid_run(db, lease_ttl=600)
    assert states(tmp_path)["killed"][:2] == ("running", "running")
    killed_mid_run(tmp_path / "short.db", lease_ttl=0.2)
    store = SqliteCheckpointer(tmp_path / "short.db")
    try:
        info = await store.run("killed")
    finally:
        await store.close()
    assert info is not None
    assert info.lease_expires is not None
    for _ in range(100):  # until the lease the killed process held has expired (20 s at most)
        if time.time() > info.lease_expires:
            break
        await asyncio.sleep(0.2)
    listed = json.loads(cli("runs", "--json", "--store", "short.db", cwd=tmp_path).stdout)
    assert [(r["status"], r["state"]) for r in listed] == [("running", "ready to resume")]
    shown = cli("show", "killed", "--store", "short.db", cwd=tmp_path).stdout
    assert "run 'killed' · ready to resume (status running)" in shown, shown
    assert "in flight: m1.t1 pay" in shown


async def test_runs_counts_steps_not_records(tmp_path: Path) -> None:
    """`runs` shows a run's steps (model steps and tool calls), not its journal records;
    --json has steps beside the records (events), model calls and tool steps."""
    db = tmp_path / "runs.db"
    await suspended(db, "paid")
    assert cli("approve", "paid", "m1.t1", "--by", "ana", cwd=tmp_path).returncode == 0
    await drive(db, "paid")
    await uncertain(db, "unsure")
    table = cli("runs", cwd=tmp_path).stdout
    assert re.search(r"┃\s*run\s*┃\s*state\s*┃\s*steps\s*┃\s*activity", table)
    assert "records" not in table
    assert re.search(r"paid\s*│\s*closed\s*│\s*3\s*│", table)
    assert re.search(r"unsure\s*│\s*uncertain\s*│\s*2\s*│", table)
    listed = json.loads(cli("runs", "--json", cwd=tmp_path).stdout)
    counted = [(r["steps"], r["model_calls"], r["tool_steps"], r["events"]) for r in listed]
    assert counted == [(3, 2, 1, 7), (2, 1, 1, 3)]
    shown = cli("show", "paid", cwd=tmp_path).stdout
    assert "run 'paid' · closed · 3 steps · 7 records · last activity" in shown


async def test_runs_shows_cost_when_prices_were_known(tmp_path: Path) -> None:
    """With a price table, `runs` adds what each run cost and what replay saved."""
    db = tmp_path / "runs.db"
    await priced_uncertain(db, "unsure")
    table = cli("runs", cwd=tmp_path).stdout
    paid = r"412/38\s*│\s*0\.0018\s*│"  # 412 x 3 + 38 x 15 per million tokens
    assert re.search(rf"unsure\s*│.*{paid}\s*1\s*│\s*412/38\s*│\s*0\.0018", table)


async def test_runs_in_a_narrow_terminal_leaves_columns_out_rather_than_cutting_cells(
    tmp_path: Path,
) -> None:
    """At 80 columns: statuses and times whole, no "…"; the least needed columns left out."""
    db = tmp_path / "runs.db"
    await priced_uncertain(db, "unsure")
    await suspended(db, "a-rather-long-run-id-for-an-invoice-0001")
    table = cli("runs", cwd=tmp_path, env={"COLUMNS": "80"}).stdout
    assert max(len(line) for line in table.splitlines()) <= 80, table
    assert "…" not in table, table
    assert re.search(r"unsure\s*│\s*uncertain\s*│\s*2\s*│\s*\d\d:\d\d:\d\d\s*│", table), table
    assert "suspended" in table
    assert "saved" not in table, "the least needed columns go first"
    wide = cli("runs", cwd=tmp_path, env={"COLUMNS": "200"}).stdout
    assert "saved" in wide
    assert "0.0018" in wide


async def test_show_says_which_tokens_came_from_the_prompt_cache(tmp_path: Path) -> None:
    """A model step that read and wrote the provider's cache says so in `show`."""
    usage = Usage(
        input_tokens=1200, output_tokens=30, cached_input_tokens=900, cache_write_tokens=200
    )
    gateway = ScriptedGateway([ModelResponse(text="done", usage=usage)])
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        async for _ in Agent().run("hi", session=Session("cached", gateway, store)):
            pass
    finally:
        await store.close()
    shown = cli("show", "cached", cwd=tmp_path).stdout
    assert "[1200+30 tokens, 900 from cache, 200 written to cache]" in shown, shown
    assert "1,200 in / 30 out, 900 in from cache, 200 written to cache" in shown, shown
    [listed] = json.loads(cli("runs", "--json", cwd=tmp_path).stdout)
    assert (listed["cached_input_tokens"], listed["cache_write_tokens"]) == (900, 200)


async def test_show_lists_effect_records(tmp_path: Path) -> None:
    """`show` lists each effect's idem_key, status, remote_id and attempts (table and JSON)."""
    db = tmp_path / "runs.db"
    await closed_with_effect(db, "fee-3")
    table = cli("show", "fee-3", cwd=tmp_path).stdout
    assert re.search(
        r"m1\.t1\s*│\s*fee-3:m1\.t1:[0-9a-f]{6}\s*│\s*confirmed\s*│\s*entry-0001\s*│\s*1", table
    )
    assert "awaiting: nothing from a person" in table
    [effect] = json.loads(cli("show", "fee-3", "--json", cwd=tmp_path).stdout)["effects"]
    assert (effect["status"], effect["remote_id"], effect["attempts"]) == (
        "confirmed",
        "entry-0001",
        1,
    )
    assert effect["idem_key"].startswith("fee-3:m1.t1:")


async def test_show_tells_how_to_resolve_an_uncertain_step(tmp_path: Path) -> None:
    """An uncertain run's `show` names the step and the resolve command."""
    await uncertain(tmp_path / "journal.db", "run-1")
    out = cli("show", "run-1", "--store", "journal.db", cwd=tmp_path).stdout
    assert 'awaiting a person: m1.t1 pay({"amount":120}) is uncertain' in out
    assert (
        "asiento resolve run-1 m1.t1 --happened [--remote-id ID] | --not-happened --by NAME"
        " --store journal.db" in out
    )


async def test_approve_and_deny_print_the_exact_arguments(tmp_path: Path) -> None:
    """`approve` prints the tool, the frozen arguments and their fingerprint it approved."""
    db = tmp_path / "runs.db"
    fp = await suspended(db, "run-1")
    await suspended(db, "run-2")
    approved = cli("approve", "run-1", "m1.t1", "--by", "ana", cwd=tmp_path).stdout
    assert '  arguments    {"amount": 120}' in approved
    assert f"  fingerprint  {fp}" in approved
    denied = cli("deny", "run-2", "m1.t1", "--by", "ana", "--reason", "no", cwd=tmp_path).stdout
    assert "denied run 'run-2' step 'm1.t1' (by ana: no)" in denied
    assert '  arguments    {"amount": 120}' in denied


async def test_approving_an_effect_prints_the_payload_it_will_publish(tmp_path: Path) -> None:
    """For an effect, `approve` prints the frozen payload and the idempotency key it approved."""
    await book(tmp_path / "runs.db", "fee-3", approval=True)
    out = cli("approve", "fee-3", "m1.t1", "--by", "ana", cwd=tmp_path).stdout
    assert '  prepared     {"account": "4300", "amount": 75}' in out
    assert re.search(r"  idem_key     fee-3:m1\.t1:[0-9a-f]{6}", out)


async def test_resolve_waits_for_a_session_that_holds_the_run(tmp_path: Path) -> None:
    """While a live session holds the run, `resolve` refuses: the step may still record itself."""
    db = tmp_path / "runs.db"
    await uncertain(db, "run-1")
    store = SqliteCheckpointer(db)
    try:
        await store.acquire("run-1", Holder.here(), ttl=600)
    finally:
        await store.close()
    proc = cli("resolve", "run-1", "m1.t1", "--happened", "--by", "ana", cwd=tmp_path)
    assert_one_line_error(proc, "is being driven right now")
    shown = json.loads(cli("show", "run-1", "--json", cwd=tmp_path).stdout)
    assert "resolution" not in [e["phase"] for e in shown["events"]]


async def test_stores_are_named_by_path_or_url(tmp_path: Path) -> None:
    """`--store` takes sqlite:/// URLs (never creating a missing file) and refuses other schemes."""
    await suspended(tmp_path / "runs.db", "run-1")
    listed = json.loads(cli("runs", "--json", "--store", "sqlite:///runs.db", cwd=tmp_path).stdout)
    assert [r["run_id"] for r in listed] == ["run-1"]
    env_listed = cli(
        "runs", "--json", cwd=tmp_path / "..", env={"ASIENTO_STORE": str(tmp_path / "runs.db")}
    )
    assert [r["run_id"] for r in json.loads(env_listed.stdout)] == ["run-1"]
    missing = cli("show", "run-1", "--store", "sqlite:///gone.db", cwd=tmp_path)
    assert_one_line_error(missing, "no journal at gone.db")
    assert not (tmp_path / "gone.db").exists()
    assert_one_line_error(
        cli("runs", "--store", "mysql://db/x", cwd=tmp_path), "cannot open a journal"
    )


async def test_a_journal_from_a_newer_asiento_is_refused(tmp_path: Path) -> None:
    """A journal whose schema is newer than this asiento is refused in one line, untouched."""
    db = tmp_path / "runs.db"
    await suspended(db, "run-1")
    with contextlib.closing(sqlite3.connect(db)) as conn:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        conn.execute(f"PRAGMA user_version = {version + 1}")
    before = db.read_bytes()
    proc = cli("runs", cwd=tmp_path)
    assert_one_line_error(proc, f"schema {version + 1}", "Upgrade asiento")
    assert db.read_bytes() == before


def libpq_keywords(dsn: str, **extra: str) -> str:
    """``dsn`` as a libpq keyword string that starts ``host=... port=... dbname=...``."""
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    first = {k: params.pop(k) for k in ("host", "port", "dbname")}
    pairs = {**first, **params, **extra}
    assert not any(" " in v or "'" in v for v in pairs.values()), pairs
    return " ".join(f"{key}={value}" for key, value in pairs.items())


async def test_every_command_takes_a_libpq_keyword_string(pg_dsn: str, tmp_path: Path) -> None:
    """`--store 'host=... port=... dbname=...'` and $ASIENTO_STORE reach PostgreSQL in the
    reading and deciding commands; what they print hides the password.

    Before the fix the CLI took any string without ``://`` for an SQLite path and
    answered ``no journal at host=...``.
    """
    secret = "pg-secret-4711"  # the test server trusts local sockets: libpq sends it unused
    dsn = libpq_keywords(pg_dsn, password=secret)
    assert dsn.startswith("host=/")
    await suspended(dsn, "pg-run")
    listed = cli("runs", "--json", "--store", dsn, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert [(r["run_id"], r["status"]) for r in json.loads(listed.stdout)] == [
        ("pg-run", "suspended")
    ]
    table = cli("runs", "--store", dsn, cwd=tmp_path)
    shown = cli("show", "pg-run", "--store", dsn, cwd=tmp_path)
    assert (table.returncode, shown.returncode) == (0, 0), table.stderr + shown.stderr
    assert "password=***" in table.stdout
    assert "asiento approve pg-run m1.t1 --by NAME --store 'host=/" in shown.stdout
    assert "password=***'" in shown.stdout
    from_env = {"ASIENTO_STORE": dsn}
    approved = cli("approve", "pg-run", "m1.t1", "--by", "ana", cwd=tmp_path, env=from_env)
    assert approved.returncode == 0, approved.stderr
    after = cli("show", "pg-run", cwd=tmp_path, env=from_env)
    assert "--store" not in after.stdout  # $ASIENTO_STORE finds it again: no hint needed
    for proc in (listed, table, shown, approved, after):
        assert secret not in proc.stdout + proc.stderr
    decided = json.loads(cli("show", "pg-run", "--json", cwd=tmp_path, env=from_env).stdout)
    assert [e["payload"]["by"] for e in decided["events"] if e["phase"] == "approval"] == ["ana"]
    assert list(tmp_path.iterdir()) == []


def test_a_missing_sqlite_file_is_still_an_error(tmp_path: Path) -> None:
    """A path that only looks like keywords (`sort=1.db`, `./dbname=x.db`) is an SQLite file:
    missing, it is an error and nothing is created; an empty libpq string is refused."""
    for store in ("sort=1.db", "./dbname=x.db", "sqlite:///port=1.db"):
        assert_one_line_error(cli("runs", "--store", store, cwd=tmp_path), "no journal at")
    assert list(tmp_path.iterdir()) == []


def test_one_rule_says_what_a_store_string_names() -> None:
    """`address_of` decides for `open_store` and the CLI alike: SQLite file or PostgreSQL."""
    kinds = {
        "runs.db": ("sqlite", Path("runs.db")),
        "sqlite:///sub/runs.db?timeout=9": ("sqlite", Path("sub/runs.db")),
        "./host=x.db": ("sqlite", Path("host=x.db")),
        "sort=1.db": ("sqlite", Path("sort=1.db")),
        "host=/tmp port=5432 dbname=x": ("postgresql", None),
        "  dbname = x": ("postgresql", None),
        "service=billing": ("postgresql", None),
        "postgres://db/x": ("postgresql", None),
    }
    for text, kind in kinds.items():
        address = address_of(text)
        assert (address.backend, address.path) == kind, text
    for text in ("", "sqlite:runs.db", "mysql://db/x"):
        with pytest.raises(UsageError, match="libpq keyword strings"):
            address_of(text)


def test_printed_store_names_hide_every_password() -> None:
    """`shown` hides passwords in URLs (user info, query) and in libpq keyword strings."""
    cases = {
        "postgresql://app:s3cr3t@db/x": "postgresql://app:***@db/x",
        "postgresql://app@db/x?password=s3cr3t&sslmode=require": (
            "postgresql://app@db/x?password=***&sslmode=require"
        ),
        "host=db password=s3cr3t dbname=x": "host=db password=*** dbname=x",
        "host=db password = 's3 cr\\'3t' dbname=x": "host=db password = *** dbname=x",
        "host=db sslpassword=s3cr3t": "host=db sslpassword=***",
        "host=db PASSWORD=s3cr3t": "host=db PASSWORD=***",
        "runs.db": "runs.db",
    }
    for given, printed in cases.items():
        assert shown(given) == printed, given


def test_runs_on_postgresql_by_url(pg_dsn: str, tmp_path: Path) -> None:
    """A postgresql:// store is opened by URL: `runs` lists what a run wrote there."""
    params = {k: v for k, v in conninfo_to_dict(pg_dsn).items() if v is not None}
    url = "postgresql://?" + urlencode(params)

    async def write() -> None:
        store = await open_store(url)
        try:
            await submit(store, "pg-run", "pay 120")
        finally:
            await store.close()

    asyncio.run(write())
    listed = json.loads(cli("runs", "--json", "--store", url, cwd=tmp_path).stdout)
    assert [(r["run_id"], r["task"]) for r in listed] == [("pg-run", "pay 120")]


# -- worker, serve, gateway ----------------------------------------------------------------

APP_MODULE = '''
import os, time
from pathlib import Path
from asiento import Agent, App, ModelResponse, ToolCall, tool
from asiento import shutdown
from asiento.journal.url import address_of, shown
from asiento.testing import ScriptedGateway

PAID = Path(os.environ["PAID"])
SCRIPT = [
    ModelResponse(tool_calls=[ToolCall(name="pay", arguments={"amount": 120})]),
    ModelResponse(text="paid"),
]

@tool
def pay(amount: int) -> str:
    """Pay an amount."""
    with PAID.open("a") as f:
        f.write(f"{amount}\\n")
        f.flush()
        os.fsync(f.fileno())
    if os.environ.get("SLOW"):
        Path(os.environ["SLOW"]).touch()
        time.sleep(1.5)
    return "tx-1"

app = App(agents={"billing": Agent(tools=[pay])}, gateway=lambda: ScriptedGateway(SCRIPT))
not_an_app = 42
'''


async def submitted(db: Path, *run_ids: str) -> None:
    """Queue runs for the billing agent on a fresh journal file."""
    store = SqliteCheckpointer(db)
    try:
        for run_id in run_ids:
            await submit(store, run_id, "pay 120", agent="billing")
    finally:
        await store.close()


async def test_worker_drives_submitted_runs_until_idle(tmp_path: Path) -> None:
    """`worker --until-idle` closes every submitted run, paying once each, and exits 0."""
    (tmp_path / "billing.py").write_text(APP_MODULE)
    await submitted(tmp_path / "runs.db", "a", "b")
    env = {"PAID": str(tmp_path / "paid.log")}
    proc = cli(
        "worker", "--app", "billing:app", "--until-idle", "--poll", "0.05", cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert "claimed 2: closed 2" in proc.stderr
    assert (tmp_path / "paid.log").read_text() == "120\n120\n"
    listed = json.loads(cli("runs", "--json", cwd=tmp_path).stdout)
    assert [(r["run_id"], r["status"]) for r in listed] == [("a", "closed"), ("b", "closed")]


async def test_worker_stops_on_sigterm_with_75_and_the_run_resumes(tmp_path: Path) -> None:
    """SIGTERM mid-tool: the payment finishes and is recorded, exit 75; no second payment."""
    (tmp_path / "billing.py").write_text(APP_MODULE)
    await submitted(tmp_path / "runs.db", "a")
    started = tmp_path / "started"
    env = {**clean_env(), "PAID": str(tmp_path / "paid.log"), "SLOW": str(started)}
    argv = [sys.executable, "-m", "asiento", "worker", "--app", "billing:app"]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert "stopped by a signal" in err
    again = cli(
        "worker", "--app", "billing:app", "--until-idle", cwd=tmp_path, env={"PAID": env["PAID"]}
    )
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "paid.log").read_text() == "120\n"
    shown = json.loads(cli("show", "a", "--json", cwd=tmp_path).stdout)
    assert shown["status"] == "closed"


async def test_worker_refuses_what_is_not_an_app(tmp_path: Path) -> None:
    """`--app` naming a missing module, a missing attribute or something else is one line."""
    (tmp_path / "billing.py").write_text(APP_MODULE)
    await submitted(tmp_path / "runs.db", "a")
    env = {"PAID": str(tmp_path / "paid.log")}
    assert_one_line_error(
        cli("worker", "--app", "nope:app", cwd=tmp_path, env=env), "cannot import 'nope'"
    )
    assert_one_line_error(
        cli("worker", "--app", "billing:ghost", cwd=tmp_path, env=env), "has no 'ghost'"
    )
    assert_one_line_error(
        cli("worker", "--app", "billing:not_an_app", cwd=tmp_path, env=env),
        "is a int, not an asiento.App",
    )
    assert_one_line_error(cli("worker", "--app", "billing", cwd=tmp_path, env=env), "MODULE:ATTR")
    missing = cli("worker", "--app", "billing:app", "--store", "nope.db", cwd=tmp_path, env=env)
    assert_one_line_error(missing, "no journal at nope.db")
    assert not (tmp_path / "paid.log").exists()
    assert "no records yet: the run is queued" in cli("show", "a", cwd=tmp_path).stdout


async def test_graceful_stops_do_not_park_a_run_that_makes_progress(tmp_path: Path) -> None:
    """A run stopped by SIGTERM (exit 75) at every pass, progressing each time, is not parked.

    Core bug: each claim counts as a failed attempt until the run is stable, and a
    graceful stop never resets it, so after ``max_attempts`` deploys a healthy run
    is parked as if its workers had died.
    """

    def answer(request: ModelRequest) -> ModelResponse:
        turns = sum(1 for m in request.messages if m.role == "assistant")
        if turns < 7:
            return ModelResponse(tool_calls=[ToolCall(name="step", arguments={"n": turns})])
        return ModelResponse(text="done")

    @tool(idempotent=True)
    def step(n: int) -> int:
        """One step of a long run; a deploy sends SIGTERM while it runs."""
        shutdown.request()
        return n

    store = SqliteCheckpointer(tmp_path / "runs.db")
    app = App(agents={"a": Agent(tools=[step])}, gateway=lambda: ScriptedGateway(answer))
    try:
        await submit(store, "long", "work", agent="a")
        for _ in range(7):
            shutdown.reset()
            with contextlib.suppress(shutdown.ShutdownRequested):
                await Worker(store, app).run_once()
            [info] = await store.runs()
            assert info.status != "parked", info.reason
    finally:
        shutdown.reset()
        await store.close()


async def test_serve_prints_a_token_that_opens_the_page(tmp_path: Path) -> None:
    """`serve --port 0` prints its URL, a generated token and its mode; the page is shown
    only after logging in with that token, not a wrong one."""
    await suspended(tmp_path / "runs.db", "run-1")
    argv = [sys.executable, "-m", "asiento", "serve", "--port", "0"]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=clean_env(), stderr=subprocess.PIPE, text=True)
    try:
        url, token, mode = first_lines(proc, 3)
        assert url.startswith("asiento serve: http://127.0.0.1:")
        assert url.endswith("(journal runs.db)")
        assert mode == "mode: every page and /api/ answer needs the token"
        base, secret = url.split()[2], token.split()[1]
        assert len(secret) >= 24
        with httpx.Client(base_url=base, timeout=30) as client:
            anonymous = client.get("/")
            wrong = client.post("/login", data={"by": "ana", "token": secret + "x"})
            right = client.post(
                "/login", data={"by": "ana", "token": secret}, follow_redirects=False
            )
            listing = client.get("/")
        assert (anonymous.status_code, wrong.status_code, right.status_code) == (401, 401, 303)
        assert "run-1" not in anonymous.text
        assert "run-1" in listing.text
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


async def test_serve_refuses_a_missing_store_and_a_weak_token(tmp_path: Path) -> None:
    """`serve` on a missing file, or with a short $ASIENTO_WEB_TOKEN, stops at once in one line."""
    assert_one_line_error(cli("serve", "--store", "nope.db", cwd=tmp_path), "no journal at nope.db")
    assert list(tmp_path.iterdir()) == []
    await suspended(tmp_path / "runs.db", "run-1")
    weak = cli("serve", cwd=tmp_path, env={"ASIENTO_WEB_TOKEN": "short"})
    assert_one_line_error(weak, "$ASIENTO_WEB_TOKEN has 5 characters")


def test_gateway_serves_the_proxy(tmp_path: Path) -> None:
    """`gateway --port 0` prints its URL, forwards upstream (502: it is down), creates --db."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    upstream = f"http://127.0.0.1:{dead}/v1"
    argv = [
        sys.executable,
        "-m",
        "asiento",
        "gateway",
        "--upstream",
        upstream,
        "--db",
        "keys.db",
        "--port",
        "0",
    ]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=clean_env(), stderr=subprocess.PIPE, text=True)
    try:
        [line] = first_lines(proc, 1)
        assert f"-> {upstream}" in line
        answer = httpx.post(line.split()[2] + "/chat/completions", json={"model": "m"}, timeout=30)
        assert answer.status_code == 502
        assert answer.json()["error"]["code"] == "upstream"
        assert (tmp_path / "keys.db").is_file()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_gateway_defaults_are_the_proxys() -> None:
    """The defaults `gateway --help` documents are the proxy's own."""
    from asiento.cli import gateway
    from asiento.proxy import (
        DEFAULT_LEASE,
        DEFAULT_PORT,
        DEFAULT_TTL,
        DEFAULT_UPSTREAM,
        DEFAULT_UPSTREAM_TIMEOUT,
    )

    defaults = {p.name: p.default for p in gateway.params}
    assert (defaults["upstream"], defaults["port"], defaults["ttl"]) == (
        DEFAULT_UPSTREAM,
        DEFAULT_PORT,
        DEFAULT_TTL,
    )
    assert (defaults["upstream_timeout"], defaults["lease"]) == (
        DEFAULT_UPSTREAM_TIMEOUT,
        DEFAULT_LEASE,
    )
    assert defaults["read_timeout"] is None  # the proxy's default: the upstream timeout


def clean_env() -> dict[str, str]:
    """This process's environment without crash points, tokens or a store."""
    drop = {"ASIENTO_CRASH_AT", "ASIENTO_WEB_TOKEN", "ASIENTO_STORE"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def first_lines(proc: subprocess.Popen[str], n: int) -> list[str]:
    """The first ``n`` lines a server prints on stderr (within 30 s)."""
    assert proc.stderr is not None
    lines: queue.Queue[str] = queue.Queue()
    stream = proc.stderr
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    try:
        return [lines.get(timeout=30).strip() for _ in range(n)]
    except queue.Empty:
        proc.kill()
        pytest.fail(f"{proc.args} printed fewer than {n} lines", pytrace=False)


def test_unpark_gives_a_parked_run_back_with_a_fresh_count(tmp_path: Path) -> None:
    """`asiento unpark` gives a parked run back to the workers (status running, waiting for a
    worker) and resets its claim and lapse counts (parked here by its lapses: its
    claims lapsed with no tool in flight)."""
    import asyncio

    from asiento import RunStatus, SqliteCheckpointer, submit
    from asiento.lease import Holder

    async def park() -> None:
        store = SqliteCheckpointer(tmp_path / "runs.db")
        await submit(store, "r1", "task")
        for _ in range(2):
            claim = await store.claim(Holder.here(), ttl=0.01, max_attempts=2, max_lapses=2)
            assert claim is not None
            await asyncio.sleep(0.02)
        assert await store.claim(Holder.here(), ttl=1, max_attempts=2, max_lapses=2) is None
        assert [r.status for r in await store.runs()] == [RunStatus.PARKED]

    asyncio.run(park())
    out = cli("unpark", "r1", "--by", "ana", "--reason", "fixed the tool", cwd=tmp_path)
    assert out.stdout.startswith(
        "run 'r1' is unparked. The run is waiting for a worker: a worker picks it up by itself"
    ), out.stdout

    async def check() -> None:
        store = SqliteCheckpointer(tmp_path / "runs.db")
        [info] = await store.runs()
        assert (info.status, info.attempts, info.lapses) == (RunStatus.RUNNING, 0, 0)
        assert info.reason == "unparked by ana: fixed the tool"
        assert await store.claim(Holder.here(), ttl=1, max_attempts=2) is not None

    asyncio.run(check())
    assert_one_line_error(cli("unpark", "r1", "--by", "ana", cwd=tmp_path), "not parked")


# -- empty, damaged and read-only journals (issue 12, item 8) ----------------------------


def test_an_empty_file_is_not_made_a_journal(tmp_path: Path) -> None:
    """`runs` and `show` on a zero-byte file exit 1 in one line; the file stays empty
    and nothing is created beside it."""
    (tmp_path / "empty.db").touch()
    for args in (["runs"], ["show", "run-1"]):
        proc = cli(*args, "--store", "empty.db", cwd=tmp_path)
        assert_one_line_error(proc, "empty.db is an empty file, not a journal")
    assert (tmp_path / "empty.db").read_bytes() == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db"]


async def test_a_damaged_journal_is_named_damaged(tmp_path: Path) -> None:
    """A journal cut short is reported damaged, with what to do, in one line; not as
    "not an asiento journal"."""
    db = tmp_path / "runs.db"
    await suspended(db, "run-1")
    db.write_bytes(db.read_bytes()[:4096])
    proc = cli("runs", "--store", "runs.db", cwd=tmp_path)
    assert_one_line_error(proc, "the journal file is damaged", "backup", ".recover")


async def test_a_journal_on_a_read_only_mount_can_be_read_but_not_decided(tmp_path: Path) -> None:
    """On a read-only mount, `runs` and `show` read the journal; `approve` exits 1 in one
    line saying the journal cannot be written and why, and records nothing."""
    with read_only_view(tmp_path) as (folder, view):
        await suspended(folder / "runs.db", "run-1")
        before = (folder / "runs.db").read_bytes()
        store = str(view / "runs.db")
        listed = cli("runs", "--json", "--store", store, cwd=tmp_path)
        assert listed.returncode == 0, listed.stderr
        assert [(r["run_id"], r["status"]) for r in json.loads(listed.stdout)] == [
            ("run-1", "suspended")
        ]
        shown = cli("show", "run-1", "--store", store, cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert "m1.t1" in shown.stdout
        proc = cli("approve", "run-1", "m1.t1", "--by", "ana", "--store", store, cwd=tmp_path)
        assert_one_line_error(proc, "cannot write the journal", "read-only file system")
        assert (folder / "runs.db").read_bytes() == before
