"""What SQLite does with a commit whose writer died between the WAL and the WAL index.

A writer SIGKILLed inside its commit's fsync has written the commit's frames to the
WAL but not published them in the WAL index (the -shm file). While another
connection keeps that index alive, nobody sees the commit; once every connection is
gone without a clean close, the next process to open the file rebuilds the index
from the WAL and sees it. The commit was never acknowledged (its COMMIT did not
return), so asiento acted on nothing in it; what matters is that any later write
erases it for good. The crash oracles (tests/crash/oracle.py, asiento.testing's
invariants) allow for such a commit surfacing late; these tests pin down why.
"""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")

HOLD = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("SELECT count(*) FROM t").fetchone()
print("holding", flush=True)
time.sleep(120)
"""

WRITE = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("PRAGMA synchronous=FULL")
con.execute("BEGIN IMMEDIATE")
con.execute("INSERT INTO t VALUES (?)", (sys.argv[2],))
con.execute("COMMIT")
"""


def rows(db: Path) -> list[str]:
    con = sqlite3.connect(db)
    try:
        return [x for (x,) in con.execute("SELECT x FROM t ORDER BY rowid")]
    finally:
        con.close()


def write(db: Path, value: str, *, die_in_fsync: bool = False) -> int:
    """Commit ``value`` from a new process; with ``die_in_fsync``, SIGKILL it in its fsync."""
    argv = [sys.executable, "-c", WRITE, str(db), value]
    if die_in_fsync:
        inject = ("-e", "trace=fdatasync,fsync", "-e", "inject=fdatasync,fsync:signal=KILL")
        argv = ["strace", "-f", "-qq", *inject, *argv]
    return subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode


@contextmanager
def index_kept_alive(db: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process with the file open (so the WAL index stays), SIGKILLed at the end."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(db)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "holding"
        assert write(db, "first") == 0  # the WAL has begun: its header is written and synced
        yield holder
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean close: no checkpoint, the WAL stays
        holder.wait(timeout=30)
        holder.stdout.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "t.db"
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("CREATE TABLE t (x TEXT)")
    con.execute("INSERT INTO t VALUES ('base')")
    con.close()
    return path


def test_an_unacknowledged_commit_hidden_from_others_surfaces_after_recovery(db: Path) -> None:
    """Killed in its fsync: unseen while the index lives, seen by the next lone opener."""
    with index_kept_alive(db):
        assert write(db, "killed", die_in_fsync=True) == -signal.SIGKILL
        assert rows(db) == ["base", "first"], "connections sharing the index do not see it"
    assert rows(db) == ["base", "first", "killed"], "recovery from the WAL brings it back"


def test_any_write_after_it_erases_the_hidden_commit(db: Path) -> None:
    """A commit made while it is hidden overwrites its frames: it never comes back."""
    with index_kept_alive(db):
        assert write(db, "killed", die_in_fsync=True) == -signal.SIGKILL
        assert write(db, "next") == 0
        assert rows(db) == ["base", "first", "next"]
    assert rows(db) == ["base", "first", "next"]
