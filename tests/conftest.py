"""Fixtures shared by every test module."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Path:
    """A path for a fresh SQLite journal file inside the test's own directory."""
    return tmp_path / "runs.db"
