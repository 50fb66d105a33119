"""The pytest plugin: a ``crash_harness`` fixture and options for the storm's size and seed.

Registered as the ``asiento`` entry point of ``pytest11``, so installing asiento
is enough:

    def test_my_agent_survives_crashes(crash_harness):
        harness = crash_harness("myapp.agents:make", task="Serve customer ana")
        harness.matrix().raise_if_violations()
        harness.storm().raise_if_violations()

``crash_harness(app, *, task, store=None, **options)`` builds a ``CrashHarness``
whose workdir (and, unless ``store`` is given, SQLite journal) lives in the
test's ``tmp_path``. ``pytest --asiento-storm-kills N`` sets how many SIGKILLs
``storm()`` lands by default, ``--asiento-seed S`` its seed: a failure prints
the seed of each failing trial, and ``harness.replay(seed)`` drives it again.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .harness import CrashHarness

KILLS = "--asiento-storm-kills"
SEED = "--asiento-seed"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("asiento", "asiento crash harness")
    group.addoption(KILLS, type=int, default=None, help="SIGKILLs a storm lands (default 200)")
    group.addoption(SEED, type=int, default=None, help="the storms' seed (default: random)")


def pytest_report_header(config: pytest.Config) -> str | None:
    kills, seed = config.getoption(KILLS, None), config.getoption(SEED, None)
    if kills is None and seed is None:
        return None
    return f"asiento crash harness: storm kills={kills}, seed={seed}"


@pytest.fixture
def crash_harness(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., CrashHarness]]:
    """Build crash harnesses for the test, in its own temporary directory."""
    from .harness import CrashHarness  # on first use: every pytest run loads this plugin

    made: list[CrashHarness] = []
    kills = request.config.getoption(KILLS, None)
    seed = request.config.getoption(SEED, None)

    def make(
        app: str, *, task: str, store: str | os.PathLike[str] | None = None, **options: Any
    ) -> CrashHarness:
        workdir = tmp_path / f"crash-harness-{len(made)}"
        workdir.mkdir()
        if kills is not None:
            options.setdefault("storm_kills", kills)
        if seed is not None:
            options.setdefault("seed", seed)
        harness = CrashHarness(
            app, task=task, store=store or workdir / "runs.db", workdir=workdir, **options
        )
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()
