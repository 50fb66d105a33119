"""Traces of runs killed with SIGKILL (#24): real child processes, spans read from a file.

Each case drives one run through new interpreters (``trace_child.py``), the first
passes killed at named crash points, the next ones resuming until the run closes,
then one more on the closed run. Everything is checked from outside the killed
processes: the spans each pass exported (one fsynced JSON line per span), the model
ledger (generations asked for, i.e. billed, and answered), the effects ledger (tools
that ran) and the journal file.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from asiento import Agent, Session, SqliteCheckpointer
from asiento.testing import ENV_VAR, ScriptedGateway
from asiento.testing._files import read_lines

from .trace_child import AGENT, SCRIPT, TASK, make_tools

CHILD = Path(__file__).with_name("trace_child.py")
KILLED = -signal.SIGKILL
CALL_TIMEOUT = 60.0
MAX_PASSES = 8
PASS_NAME = f"invoke_agent {AGENT}"

# The crash armed in each of the first passes (one per pass); later passes are unarmed.
CASES: dict[str, tuple[str, ...]] = {
    # m2's call dies in flight; the resumed pass re-asks it, runs lookup(beta) and dies
    # before its result is recorded; the third runs lookup(beta) again and closes.
    "in_model_call-then-after_tool": ("inside_model_call@2", "after_tool@1"),
    # m1 answered (its chat span exported), killed before the pass's first step commit;
    # the second pass pays m1 again and dies once its answer is recorded.
    "before_first_commit-then-after_model_result": ("before_intent@1", "after_model_result@1"),
    # lookup(alpha) ran, its result lost; the second pass stands in for the first,
    # runs lookup(alpha) again, and dies inside m2's call.
    "after_tool-then-in_model_call": ("after_tool@1", "inside_model_call@2"),
}


@dataclass
class Files:
    db: Path
    effects: Path
    models: Path
    spans: Path

    @classmethod
    def under(cls, folder: Path) -> Files:
        return cls(
            folder / "runs.db", folder / "effects.jsonl", folder / "models.jsonl",
            folder / "spans.jsonl",
        )  # fmt: skip


def one_pass(files: Files, run_id: str, crash: str | None) -> int:
    """One pass of the run in a new interpreter, armed at ``crash``; its exit code."""
    argv = [sys.executable, str(CHILD), str(files.db), run_id]
    argv += ["--effects", str(files.effects), "--models", str(files.models)]
    argv += ["--spans", str(files.spans)]
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if crash:
        env[ENV_VAR] = crash
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=CALL_TIMEOUT, check=False
    )
    if done.returncode not in (0, KILLED):
        raise AssertionError(f"pass armed at {crash} failed ({done.returncode}):\n{done.stderr}")
    if crash and done.returncode != KILLED:
        raise AssertionError(f"the pass armed at {crash} was not killed:\n{done.stdout}")
    return done.returncode


def drive(files: Files, run_id: str, crashes: tuple[str, ...]) -> int:
    """Kill the first passes at ``crashes``, resume until closed; the passes that ran."""
    for n in range(MAX_PASSES):
        crash = crashes[n] if n < len(crashes) else None
        if one_pass(files, run_id, crash) == 0:
            return n + 1
    raise AssertionError(f"the run did not close in {MAX_PASSES} passes")


def journal_ids(db: Path, run_id: str) -> list[str]:
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT step_id FROM journal WHERE run_id = ?", (run_id,)).fetchall()
    finally:
        con.close()
    return [r[0] for r in rows]


def trace_records(db: Path, run_id: str) -> list[str]:
    return [s for s in journal_ids(db, run_id) if s == "trace" or s.startswith("trace/")]


def _step(key: str) -> str:
    """The model step an idempotency key names (``run:m2:fp`` -> ``m2``)."""
    return key.split(":")[1]


def check_trace(files: Files, crashes: tuple[str, ...], passes: int) -> None:
    spans: list[dict[str, Any]] = read_lines(files.spans)
    summary = "\n".join(
        f"  {s['name']} {s['context']['span_id']} <- {s['parent_id']}"
        f" { {k: v for k, v in s['attributes'].items() if k.startswith('asiento.pass')} }"
        for s in spans
    )
    ids = [s["context"]["span_id"] for s in spans]
    assert len(ids) == len(set(ids)), f"a span was exported twice:\n{summary}"
    by_id = {s["context"]["span_id"]: s for s in spans}

    # one trace for every span of every pass and process
    assert {s["context"]["trace_id"] for s in spans} == {spans[0]["context"]["trace_id"]}

    # no orphans: every parent is in the export; one root, the run's span, closed
    orphans = [s for s in spans if s["parent_id"] is not None and s["parent_id"] not in by_id]
    assert orphans == [], f"spans whose parent was never exported:\n{summary}"
    roots = [s for s in spans if s["parent_id"] is None]
    assert [r["name"] for r in roots] == [PASS_NAME], summary
    root = roots[0]
    assert root["attributes"]["asiento.run.status"] == "closed"
    assert "asiento.pass.fence" not in root["attributes"]

    # a chat span per generation answered to a pass; a call killed in flight leaves none
    models = read_lines(files.models)
    asked = Counter(_step(line["key"]) for line in models if line["event"] == "asked")
    answered = Counter(_step(line["key"]) for line in models if line["event"] == "answered")
    chats = [s for s in spans if s["name"].startswith("chat ")]
    assert Counter(s["attributes"]["asiento.step.id"] for s in chats) == answered, summary
    in_flight = sum(c.startswith("inside_model_call") for c in crashes)
    assert sum(asked.values()) - sum(answered.values()) == in_flight
    assert all(s["kind"] == "SpanKind.CLIENT" for s in chats)

    # an execute_tool span per effect applied
    effects = Counter(line["tool"] for line in read_lines(files.effects))
    tools = [s for s in spans if s["name"].startswith("execute_tool ")]
    assert Counter(s["attributes"]["gen_ai.tool.name"] for s in tools) == effects, summary

    # a pass span for every pass, a stand-in for each killed one, linked in fence order
    pass_spans = sorted(
        (s for s in spans if "asiento.pass.fence" in s["attributes"]),
        key=lambda s: s["attributes"]["asiento.pass.fence"],
    )
    fences = [s["attributes"]["asiento.pass.fence"] for s in pass_spans]
    assert fences == list(range(1, passes + 1)), summary
    died = [
        s["attributes"]["asiento.pass.fence"]
        for s in pass_spans
        if s["attributes"].get("asiento.pass.died")
    ]
    assert died == list(range(1, len(crashes) + 1)), summary
    for span in pass_spans:
        assert span["name"] == PASS_NAME
        assert span["parent_id"] == root["context"]["span_id"]
        dead = span["attributes"].get("asiento.pass.died", False)
        assert (span["status"]["status_code"] == "ERROR") == dead, span
    for before, after in itertools.pairwise(pass_spans):
        linked = [link["context"]["span_id"] for link in after["links"]]
        assert linked == [before["context"]["span_id"]], f"fence {after['attributes']}:\n{summary}"
    assert pass_spans[0]["links"] == []
    causes = [s["attributes"]["asiento.pass.cause"] for s in pass_spans]
    assert causes[0] == "first"
    assert all(c in ("resumed", "taken_over") for c in causes[1:])
    last = pass_spans[-1]["attributes"]
    assert last["asiento.run.status"] == "closed"
    assert last["asiento.replayed.model_calls"] >= 1
    for span in spans:  # each step span hangs under a pass span
        if span is not root and span not in pass_spans:
            assert by_id[span["parent_id"]] in pass_spans, span


@pytest.mark.parametrize("crashes", CASES.values(), ids=list(CASES))
def test_killed_passes_leave_one_whole_trace(tmp_path: Path, crashes: tuple[str, ...]) -> None:
    """Killed twice and resumed in new processes: one trace, whole, billed spans once each."""
    files = Files.under(tmp_path)
    passes = drive(files, "run-1", crashes)
    assert passes == len(crashes) + 1
    check_trace(files, crashes, passes)
    exported = files.spans.read_text()
    assert one_pass(files, "run-1", None) == 0  # a closed run is answered: no new span
    assert files.spans.read_text() == exported
    marks = trace_records(files.db, "run-1")
    assert marks.count("trace") == 1
    assert sorted(m for m in marks if m != "trace") == sorted(
        f"trace/{f}" for f in range(1, passes + 1) for _ in (0, 1)
    )  # each pass's begin and end mark, the killed ones' ends by the pass after


def test_untraced_run_records_no_trace(tmp_path: Path) -> None:
    """A run without telemetry writes no ``trace`` record: the journal is as before."""

    async def run() -> None:
        agent = Agent(instructions="untraced", tools=make_tools(str(tmp_path / "e")), name=AGENT)  # type: ignore[arg-type]
        store = SqliteCheckpointer(tmp_path / "runs.db")
        try:
            steps = [
                s
                async for s in agent.run(TASK, session=Session("r", ScriptedGateway(SCRIPT), store))
            ]
        finally:
            await store.close()
        assert steps[-1].step_id == "m3"  # type: ignore[union-attr]

    asyncio.run(run())
    ids = journal_ids(tmp_path / "runs.db", "r")
    assert "final" in ids
    assert "m3" in ids
    assert trace_records(tmp_path / "runs.db", "r") == []
