"""Closing a damaged journal leaves its WAL alone; closing a healthy one still checkpoints."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import pytest

from asiento import SqliteCheckpointer
from asiento.events import Phase, StepEvent
from asiento.journal._sqlite_capi import keep_wal_on_close, os_errno


def wal_database(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t (x)")
    db.execute("INSERT INTO t VALUES (1)")
    return db


def test_kept_connection_closes_without_checkpointing(tmp_path: Path) -> None:
    path = tmp_path / "kept.db"
    db = wal_database(path)
    main_before = path.read_bytes()
    assert keep_wal_on_close(db, path)
    db.close()
    assert Path(f"{path}-wal").exists(), "closing checkpointed and deleted the WAL"
    assert path.read_bytes() == main_before, "closing copied the WAL into the main file"
    reopened = sqlite3.connect(path)
    assert reopened.execute("SELECT x FROM t").fetchall() == [(1,)], "the WAL is still read"
    reopened.close()


def test_other_connections_checkpoint_on_close_as_usual(tmp_path: Path) -> None:
    path = tmp_path / "plain.db"
    wal_database(path).close()
    assert not Path(f"{path}-wal").exists()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12+ uses Connection.setconfig")
def test_handle_of_another_file_is_not_touched(tmp_path: Path) -> None:
    """The guard: a connection is only configured when its handle names the given file."""
    db = wal_database(tmp_path / "a.db")
    (tmp_path / "b.db").write_bytes(b"")
    assert not keep_wal_on_close(db, tmp_path / "b.db")
    db.close()
    assert not Path(f"{tmp_path / 'a.db'}-wal").exists()


async def test_healthy_store_checkpoints_on_close(tmp_path: Path) -> None:
    store = SqliteCheckpointer(tmp_path / "runs.db")
    await store.append(StepEvent(run_id="r", step_id="m1", phase=Phase.RESULT, payload={}))
    await store.close()
    assert not Path(f"{tmp_path / 'runs.db'}-wal").exists()


def test_os_errno_of_a_healthy_connection_is_none(tmp_path: Path) -> None:
    """No failed write, no errno (the figure that JournalFull for EFBIG is read from)."""
    path = tmp_path / "ok.db"
    db = wal_database(path)
    assert os_errno(db, path) is None
    db.close()
