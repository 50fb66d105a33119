"""The README's code runs as written, and the demo prints the table the README shows.

Each ```python block of README.md is a complete program: it is run as it stands, in a
fresh process and an empty directory, twice (a reader runs it again), and must leave
that directory as it found it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(language: str) -> list[tuple[int, str]]:
    """The README's fenced blocks in ``language`` ('' for plain): (line number, text)."""
    text = README.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(2))
        for m in FENCE.finditer(text)
        if m.group(1) == language
    ]


PYTHON = blocks("python")


def env() -> dict[str, str]:
    """This environment without a crash point armed or a provider key: the blocks need none."""
    dropped = {"ASIENTO_CRASH_AT", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "ASIENTO_STORE"}
    return {k: v for k, v in os.environ.items() if k not in dropped}


def run(script: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with this interpreter in ``cwd``, bounded in time."""
    argv = [sys.executable, str(script)]
    return subprocess.run(
        argv, cwd=cwd, env=env(), capture_output=True, text=True, timeout=60, check=False
    )


def test_the_readme_has_python_blocks() -> None:
    """The block finder sees the README's code (a changed fence is not silently skipped)."""
    assert len(PYTHON) >= 2


@pytest.mark.parametrize(("line", "code"), PYTHON, ids=[f"README.md:{n}" for n, _ in PYTHON])
def test_python_block_runs_as_written(line: int, code: str, tmp_path: Path) -> None:
    """The block exits 0 twice in the same directory and leaves nothing in it."""
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    head = "\n".join(code.splitlines()[:3])
    where = f"README.md line {line} ({code.splitlines()[0]})"
    for attempt in (1, 2):
        proc = run(script, cwd)
        assert proc.returncode == 0, (
            f"README.md line {line}, run {attempt}, exit {proc.returncode}:\n"
            f"{head}\n...\nstderr:\n{proc.stderr}"
        )
        assert proc.stdout.strip(), f"{where} printed nothing"
    left = sorted(p.name for p in cwd.iterdir())
    assert left == [], f"{where} left {left} behind"


def squeeze(line: str) -> str:
    """A line with its runs of spaces made one: the table's padding is rich's business."""
    return " ".join(line.split())


def test_the_demo_prints_the_readme_table(tmp_path: Path) -> None:
    """`python -m asiento demo` prints, line for line, the table the README shows."""
    shown = [squeeze(line) for line in blocks("")[0][1].splitlines() if line.strip()]
    proc = subprocess.run(
        [sys.executable, "-m", "asiento", "demo"],
        cwd=tmp_path,
        env={**env(), "COLUMNS": "80"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = [squeeze(line) for line in proc.stdout.splitlines() if line.strip()]
    found = any(printed[i : i + len(shown)] == shown for i in range(len(printed)))
    assert found, "the README shows:\n" + "\n".join(shown) + "\nthe demo printed:\n" + proc.stdout
