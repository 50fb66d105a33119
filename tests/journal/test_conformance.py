"""The journal conformance suite (asiento.testing.conformance) on asiento's own backends.

The suite ships in the package so that any backend can run it; a backend joins here
as a third party's would, with a class that names its factory. The PostgreSQL server
is started only if a postgres test runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asiento import MemoryCheckpointer, SqliteCheckpointer
from asiento.journal.postgres import PostgresCheckpointer
from asiento.testing.conformance import CheckpointerFactory, JournalConformance


class TestMemory(JournalConformance):
    @pytest.fixture
    def checkpointer_factory(self) -> CheckpointerFactory:
        return MemoryCheckpointer


class TestSqlite(JournalConformance):
    @pytest.fixture
    def checkpointer_factory(self, tmp_path: Path) -> CheckpointerFactory:
        return lambda: SqliteCheckpointer(tmp_path / "runs.db")


class TestPostgres(JournalConformance):
    store_clock = "server"

    @pytest.fixture
    def checkpointer_factory(self, pg_dsn: str) -> CheckpointerFactory:
        return lambda: PostgresCheckpointer.connect(pg_dsn)
