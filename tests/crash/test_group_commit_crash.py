"""Many runs in one process on one SQLite file, SIGKILLed inside group commits, resumed.

Group commit (docs/journal.md) puts the appends of many runs in one transaction; a
kill inside it loses the whole batch, none of whose appends had returned. What each
run was promised must survive: no non-idempotent effect twice, no model answer paid
again once it was recorded, no record lost that an append had returned for.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from .child import IDEMPOTENT

CHILD = Path(__file__).resolve().parent / "group_child.py"
RUNS = 32
# The first batch holds every run's first append (32 passages of inside_commit); these
# land inside later batches, of many runs each.
KILLS = ("inside_commit@40", "inside_commit@75")


def _pass(db: Path, ledger: Path, crash: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ASIENTO_CRASH_AT"}
    if crash:
        env["ASIENTO_CRASH_AT"] = crash
    command = [sys.executable, str(CHILD), str(db), str(ledger), str(RUNS)]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def _lines(ledger: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in ledger.read_text().splitlines()]


def _journal(db: Path) -> set[tuple[str, str, str]]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return set(con.execute("SELECT run_id, step_id, phase FROM journal"))
    finally:
        con.close()


def test_sigkill_inside_group_commits_loses_nothing_promised(tmp_path: Path) -> None:
    db, ledger = tmp_path / "journal.db", tmp_path / "ledger.jsonl"
    for crash in KILLS:
        done = _pass(db, ledger, crash)
        assert done.returncode == -signal.SIGKILL, (crash, done.returncode, done.stderr[-2000:])
    final = _pass(db, ledger, None)
    assert final.returncode == 0, final.stderr[-3000:]
    outcomes = json.loads(final.stdout)
    assert len(outcomes) == RUNS
    assert set(outcomes.values()) <= {"closed", "uncertain"}
    # (All runs move in step, so a kill in a batch of results of ``send`` leaves every
    # run uncertain, and one in a batch of intents, none: both are right.)

    lines, journal = _lines(ledger), _journal(db)
    promised = {(x["run"], *x["durable"]) for x in lines if "durable" in x}
    assert promised, "no append returned"
    assert promised <= journal, sorted(promised - journal)[:5]

    effects = Counter((x["run"], x["tool"], x["step"]) for x in lines if "tool" in x)
    twice = [k for k, n in effects.items() if n > 1 and not IDEMPOTENT[k[1]]]
    assert not twice, twice

    answered: set[tuple[str, str]] = set()
    paid_again = []
    for line in lines:
        if "durable" in line and line["durable"][1] == "result":
            answered.add((line["run"], line["durable"][0]))
        elif "key" in line:
            step = (line["run"], line["key"].rsplit(":", 2)[1])
            if step in answered:
                paid_again.append(step)
    assert not paid_again, paid_again
