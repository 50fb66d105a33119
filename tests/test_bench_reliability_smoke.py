"""The reliability bench's smoke tier runs, shows zero violations and catches every plant."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "reliability.py"


def _rows(output: str, first_column: str) -> list[dict[str, str]]:
    """The rows of the printed table whose header starts with ``first_column``."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [first_column])
    header = lines[start].split()
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        rows.append(dict(zip(header, line.split(), strict=True)))
    return rows


@pytest.mark.skipif(
    os.environ.get("ASIENTO_CI_TIER_FOLLOWS") == "1",
    reason="scripts/test runs the ci tier (the same campaigns, larger) right after pytest",
)
def test_smoke_tier_has_zero_violations_and_catches_the_plants(tmp_path: Path) -> None:
    """`--tier smoke` exits 0; every campaign row has 0 violations; every plant is caught."""
    done = subprocess.run(
        [sys.executable, str(BENCH), "--tier", "smoke", "--seed", "1", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    campaigns = _rows(done.stdout, "campaign")
    assert {(r["campaign"], r["backend"]) for r in campaigns} >= {
        ("every_crash_point", "sqlite"),
        ("every_crash_point", "postgresql"),
        ("random_SIGKILLs", "sqlite"),
        ("random_SIGKILLs", "postgresql"),
        ("lease_races", "sqlite"),
        ("lease_races", "postgresql"),
        ("decision_races", "sqlite"),
        ("decision_races", "postgresql"),
        ("abandon_while_driven", "sqlite"),
        ("abandon_while_driven", "postgresql"),
    }, done.stdout
    assert all(r["violations"] == "0" and int(r["trials"]) > 0 for r in campaigns), done.stdout
    controls = _rows(done.stdout, "plant")
    planted = {"no_write_ahead", "no_fencing", "no_dir_fsync", "stale_status", "unfenced_abandon"}
    assert {r["plant"] for r in controls} == planted
    assert all(r["caught"] == "yes" for r in controls), done.stdout
