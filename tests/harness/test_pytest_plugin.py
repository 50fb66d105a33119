"""The pytest plugin, loaded as pytest loads it: options reach the fixture's harnesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

USER_TEST = """
from asiento.testing import sample


def test_my_agent(crash_harness):
    harness = crash_harness("asiento.testing.sample:factory", task=sample.TASK)
    assert harness.storm_kills == 12 and harness.seed == 77
    assert harness.workdir.parent.name.startswith("test_my_agent")
    report = harness.storm()
    report.raise_if_violations()
    assert report.seed == 77 and report.kills >= 12
"""


def test_plugin_options_reach_the_fixture(tmp_path: Path) -> None:
    """``--asiento-storm-kills`` and ``--asiento-seed`` set the storm of ``crash_harness``."""
    (tmp_path / "test_user.py").write_text(USER_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # -p loads ours, once
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-p", "asiento.testing.pytest_plugin",
            "--asiento-storm-kills", "12", "--asiento-seed", "77", str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
    assert "asiento crash harness: storm kills=12, seed=77" in done.stdout
