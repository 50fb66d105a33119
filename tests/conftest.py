"""Fixtures shared by every test module.

The PostgreSQL fixtures live here so that every test folder shares one server;
the server itself is ``tests/journal/pg_server.py`` (``tests/`` is on
``sys.path`` as the rootdir of these conftests, so it is ``journal.pg_server``).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from journal import pg_server
from sqlite_files import Journal


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The on-demand tier (``@pytest.mark.full``) runs only with ``ASIENTO_TIER=full``:
    CI keeps a smaller case of each such campaign, within its 25 minutes."""
    if os.environ.get("ASIENTO_TIER") == "full":
        return
    skip = pytest.mark.skip(reason="on-demand tier: ASIENTO_TIER=full bash scripts/test")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Path:
    """A path for a fresh SQLite journal file inside the test's own directory."""
    return tmp_path / "runs.db"


@pytest.fixture
async def journal(tmp_path: Path) -> AsyncIterator[Journal]:
    """One SQLite journal file the test opens as many times as it has processes."""
    j = Journal(tmp_path / "runs.db")
    yield j
    for store in j.opened:
        await store.close()


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


@pytest.fixture(scope="session")
def reader() -> InMemoryMetricReader:
    """The SDK's in-memory reader, on the process's global MeterProvider (set once)."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.set_meter_provider(provider)
    if metrics.get_meter_provider() is not provider:
        pytest.fail("something set the global MeterProvider before this fixture")
    return reader


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """A tracer provider of the test's own (``Telemetry(tracer_provider=...)``), its spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()
