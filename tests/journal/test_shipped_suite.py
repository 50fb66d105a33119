"""The shipped conformance suite as a backend's author runs it: one test file in a
directory of their own, none of this repository's conftests or settings, pytest-asyncio
in strict mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

AUTHOR_FILE = '''
import pytest

from asiento import MemoryCheckpointer
from asiento.testing.conformance import JournalConformance


class LoadsBackwards(MemoryCheckpointer):
    """A backend that returns a run's records last first."""

    async def load(self, run_id):
        return list(reversed(await super().load(run_id)))


class TestMyStore(JournalConformance):
    @pytest.fixture
    def checkpointer_factory(self):
        return {backend}
'''


def run_suite(tmp_path: Path, backend: str) -> str:
    """pytest's report of the suite run on ``backend`` from a new directory."""
    (tmp_path / "test_mystore.py").write_text(AUTHOR_FILE.format(backend=backend))
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = strict\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_mystore.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return done.stdout + done.stderr


def test_a_sound_backend_passes_every_test(tmp_path: Path) -> None:
    """A subclass naming its factory collects and passes the whole suite, in strict mode."""
    report = run_suite(tmp_path, "MemoryCheckpointer")
    assert "87 passed" in report, report[-3000:]
    assert "failed" not in report, report[-3000:]
    assert "error" not in report, report[-3000:]


def test_a_backend_that_breaks_a_promise_fails_saying_how(tmp_path: Path) -> None:
    """A backend whose load() returns records out of order fails the order test, and the
    assert is explained (pytest rewrote the suite's asserts); lease tests still pass."""
    report = run_suite(tmp_path, "LoadsBackwards")
    assert "FAILED test_mystore.py::TestMyStore::test_load_keeps_append_order" in report
    assert "assert [StepEvent(" in report, report[-3000:]
    assert "test_renew_extends_a_current_lease" not in report
