"""Fixtures of the crash tests: one fork-server shared by the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .oracle import ForkServer


@pytest.fixture(scope="session")
def fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """A ``child.py serve`` process: each command runs in a freshly forked child."""
    server = ForkServer(tmp_path_factory.mktemp("fork-server") / "stderr.log")
    yield server
    server.close()
