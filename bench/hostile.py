"""The hostile-condition campaigns of tests/inputs, run by pytest and counted for the table.

Disk full (``RLIMIT_FSIZE`` and a 2 MB tmpfs), ``SQLITE_BUSY`` from another process
holding the write lock, and the Hypothesis state machine over steps, approvals,
crashes, reopenings and rival sessions. Their checks live in the tests; this module
runs them in a child pytest and reads its JUnit report: trials are the test cases
(the Hypothesis examples for the state machine), violations the failures.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CAMPAIGNS = (
    ("disk full", "tests/inputs/test_disk_full.py"),
    ("SQLITE_BUSY", "tests/inputs/test_busy.py"),
    ("state machine", "tests/inputs/test_state_machine.py"),
)

# Hypothesis prints, per test, "- 100 passing examples, 0 failing examples, ..." (older)
# or "- 100 passing, 0 failing, and 13 invalid test cases" (newer).
_EXAMPLES = re.compile(r"(\d+) passing(?: examples?)?, (\d+) failing")


@dataclass(frozen=True)
class Outcome:
    campaign: str
    trials: int
    violations: int
    skipped: int
    seconds: float
    note: str = ""


def run(root: Path, *, hypothesis_profile: str, timeout: float) -> list[Outcome]:
    """Each campaign in a child pytest (bounded by ``timeout`` seconds each)."""
    found = []
    for campaign, path in CAMPAIGNS:
        if not (REPO / path).exists():
            found.append(Outcome(campaign, 0, 0, 0, 0.0, f"{path} not found: skipped"))
            continue
        found.append(_one(root, campaign, path, hypothesis_profile, timeout))
        print(f"  done: {campaign} (tests/inputs) in {found[-1].seconds:.1f} s", flush=True)
    return found


def _one(root: Path, campaign: str, path: str, profile: str, timeout: float) -> Outcome:
    report = root / f"{campaign.replace(' ', '_')}.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path]
    argv += [f"--junitxml={report}", "--hypothesis-show-statistics"]
    env = os.environ | {"ASIENTO_HYPOTHESIS": profile}
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return Outcome(campaign, 0, 1, 0, time.monotonic() - started, f"over {timeout:.0f} s")
    seconds = time.monotonic() - started
    if not report.exists():
        tail = (done.stdout + done.stderr)[-300:]
        return Outcome(campaign, 0, 1, 0, seconds, f"pytest wrote no report: {tail}")
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    examples = [int(a) + int(b) for a, b in _EXAMPLES.findall(done.stdout)]
    trials = sum(examples) if examples else tests - skipped
    note = f"Hypothesis examples, profile {profile}" if examples else ""
    if skipped:
        note = f"{skipped} skipped (see pytest -rs)" + (f"; {note}" if note else "")
    return Outcome(campaign, trials, failed, skipped, seconds, note)
