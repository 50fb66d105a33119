"""Fixtures of the journal tests: one PostgreSQL server per session, a database per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from . import pg_server


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[pg_server.Cluster]:
    """The session's PostgreSQL server; if none can be had, the tests fail saying why."""
    try:
        cluster = pg_server.start()
    except pg_server.ServerUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    yield cluster
    cluster.stop()


@pytest.fixture
def pg_dsn(pg_cluster: pg_server.Cluster) -> str:
    """The DSN of a new, empty schema on the session's server (its application_name too)."""
    return pg_cluster.new_dsn()
