"""``asiento.testing.postgres``: the throwaway server users (and our own suite) test on."""

from __future__ import annotations

import asyncio
import importlib.util

import psycopg
import pytest

from asiento import PostgresCheckpointer, RunStatus
from asiento.testing import postgres


def _status(dsn: str) -> RunStatus | None:
    async def read() -> RunStatus | None:
        store = PostgresCheckpointer(dsn)
        try:
            runs = await store.runs()
            if not runs:
                await store.submit("r1", "a task")
                return None
            return runs[0].status
        finally:
            await store.close()

    return asyncio.run(read())


def test_a_local_server_keeps_its_data_across_a_crash_and_is_gone_after_stop() -> None:
    server = postgres.start_local_postgres(fsync=False)
    try:
        assert str(server.base) in server.dsn  # a Unix socket in its own directory
        assert _status(server.dsn) is None  # submitted now
        server.halt("immediate")
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(server.dsn, connect_timeout=2).close()
        server.resume()
        assert _status(server.dsn) is RunStatus.RUNNING  # the run survived the crash
    finally:
        server.stop()
    assert not server.base.exists()


def test_without_pgserver_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def without_pgserver(name: str, *args: object) -> object:
        return None if name == "pgserver" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", without_pgserver)
    with pytest.raises(postgres.PostgresUnavailable, match="pip install pgserver"):
        postgres.start_local_postgres()
