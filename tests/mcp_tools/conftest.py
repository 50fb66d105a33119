"""Fixtures of the MCP tests: a rig per test, and a Streamable HTTP server to kill."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .rig import HttpServer, Rig


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    made = Rig(tmp_path)
    yield made
    made.release()  # a stdio server still holding a call lets it go and exits


@pytest.fixture
def http_server(rig: Rig) -> Iterator[HttpServer]:
    """Not started yet: the test configures the rig (what to hold), then starts it."""
    server = HttpServer(rig)
    yield server
    rig.release()
    server.kill()
