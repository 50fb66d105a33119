"""The table behind IdempotencyKeys, between real processes on one SQLite file.

Each owner is a claimer.py process; the test process asks about its key as
another server process would, and edits the owner's row where a test needs an
owner it cannot start (on another host, or whose pid went to another process).
"""

from __future__ import annotations

import select
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from asiento.errors import UsageError
from asiento.mcp._calls import CallKey, CallTable
from asiento.mcp.server import IdempotencyKeys

CLAIMER = Path(__file__).with_name("claimer.py")
_WAIT = 30.0  # seconds a claimer may take to answer, at most


class Claimer:
    """One claimer.py process and its verdict."""

    def __init__(self, db: Path, key: str, *options: str) -> None:
        command = [sys.executable, str(CLAIMER), str(db), key, *options]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def verdict(self) -> str:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], _WAIT)
        assert ready, "the claimer did not answer"
        return self.process.stdout.readline().strip()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=_WAIT)

    def close(self) -> None:
        """Kill the process if it still runs, and close its pipes."""
        if self.process.poll() is None:
            self.kill()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def claimers() -> Iterator[list[Claimer]]:
    """Claimers a test starts; every one still running is ended after it."""
    started: list[Claimer] = []
    yield started
    for claimer in started:
        claimer.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "calls.db"


def holding(db: Path, claimers: list[Claimer], key: str, *options: str) -> Claimer:
    """A claimer that ran the claim for ``key`` and now holds the call."""
    claimer = Claimer(db, key, "--hold", *options)
    claimers.append(claimer)
    assert claimer.verdict() == "run"
    return claimer


def verdict_here(db: Path, key: str) -> str:
    """What this process, as another server on the file, is told about ``key``."""
    return CallTable(db, ttl=3600, lease=30).claim(CallKey("", key), "tool", "fingerprint").verdict


def edit_row(db: Path, key: str, assignment: str) -> None:
    with sqlite3.connect(db) as connection:
        connection.execute(f"UPDATE asiento_mcp_calls SET {assignment} WHERE key = ?", (key,))


def test_processes_racing_for_one_key_start_it_once(
    db: Path, tmp_path: Path, claimers: list[Claimer]
) -> None:
    """Six processes claim one key at once: one runs it, the others hear it is in progress."""
    go = tmp_path / "go"
    CallTable(db, ttl=3600, lease=30)  # the file exists before the race
    claimers.extend(Claimer(db, "k-race", "--go", str(go), "--hold") for _ in range(6))
    go.touch()
    verdicts = sorted(claimer.verdict() for claimer in claimers)
    assert verdicts == ["in-progress"] * 5 + ["run"]


def test_a_live_owner_is_in_progress_and_a_killed_one_unknown(
    db: Path, claimers: list[Claimer]
) -> None:
    """While its owner lives the key is in progress; once SIGKILLed, unknown at once."""
    owner = holding(db, claimers, "k-owner")
    assert verdict_here(db, "k-owner") == "in-progress"
    owner.kill()
    assert verdict_here(db, "k-owner") == "unknown"


def test_an_owner_whose_pid_went_to_another_process_is_dead(
    db: Path, claimers: list[Claimer]
) -> None:
    """A live process with the owner's pid but another start time is not the owner."""
    holding(db, claimers, "k-reused")
    edit_row(db, "k-reused", "process_start = '1'")
    assert verdict_here(db, "k-reused") == "unknown"


def test_an_owner_out_of_sight_counts_while_its_lease_lasts(
    db: Path, claimers: list[Claimer]
) -> None:
    """An owner on another host is in progress until its lease lapses, then unknown."""
    holding(db, claimers, "k-far", "--lease", "1000")
    edit_row(db, "k-far", "host = 'elsewhere/0000/pidns:1'")
    assert verdict_here(db, "k-far") == "in-progress"
    edit_row(db, "k-far", "lease_until = 0")
    assert verdict_here(db, "k-far") == "unknown"


def test_the_owner_renews_its_lease_while_the_call_runs(db: Path, claimers: list[Claimer]) -> None:
    """The lease of a running call moves forward without any request (bounded wait)."""
    holding(db, claimers, "k-renew", "--lease", "0.3")
    with sqlite3.connect(db) as connection:
        read = "SELECT lease_until FROM asiento_mcp_calls WHERE key = 'k-renew'"
        first = connection.execute(read).fetchone()[0]
        for _ in range(3000):
            if connection.execute(read).fetchone()[0] > first:
                break
            select.select([], [], [], 0.01)
        else:
            pytest.fail("the lease was never renewed")


def test_a_running_call_is_not_forgotten_past_the_ttl(db: Path, claimers: list[Claimer]) -> None:
    """A process whose clock is past the TTL still sees a call running under its lease."""
    holding(db, claimers, "k-long", "--ttl", "60", "--lease", "1000")
    late = Claimer(db, "k-long", "--ttl", "60", "--skew", "100")
    claimers.append(late)
    assert late.verdict() == "in-progress"


def test_a_file_that_is_not_sqlite_is_refused_clearly(tmp_path: Path) -> None:
    """Pointing the helper at a file of another kind names the file; the file is left alone."""
    path = tmp_path / "notes.txt"
    path.write_text("not a database, just notes\n" * 100)
    with pytest.raises(UsageError, match=r"notes\.txt"):
        IdempotencyKeys(path, ttl=60)
    assert path.read_text().startswith("not a database")


@pytest.mark.parametrize("ttl", [0, -1.0])
def test_a_ttl_that_is_not_positive_is_refused(tmp_path: Path, ttl: float) -> None:
    """A TTL of zero or less would forget every key at once: a usage error naming ttl."""
    with pytest.raises(UsageError, match="ttl"):
        IdempotencyKeys(tmp_path / "calls.db", ttl=ttl)


def test_one_string_of_tools_is_refused(tmp_path: Path) -> None:
    """``tools="transfer"`` would limit deduplication to tools named ``t``, ``r``...: the
    transfer itself would run again under a repeated key. Refused, naming the parameter."""
    with pytest.raises(UsageError, match=r"IdempotencyKeys\(tools=\.\.\.\) takes names"):
        IdempotencyKeys(tmp_path / "calls.db", ttl=60, tools="transfer")
    assert not (tmp_path / "calls.db").exists()  # refused before any file is made
