"""What only the SQLite journal promises: durability, identity, refusal to touch foreign files."""

from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest

from asiento import (
    DuplicateRecord,
    JournalCorrupt,
    JournalReadOnly,
    JournalTooNew,
    NotAJournal,
    Phase,
    RunStatus,
    SqliteCheckpointer,
    StepEvent,
    UsageError,
)
from asiento.journal._sqlite_open import identity
from asiento.journal._sqlite_schema import APPLICATION_ID, SCHEMA_VERSION
from journal.mounts import read_only_view

CHILD_TIMEOUT = 30


def ev(step_id: str, run_id: str = "run-1", **payload: object) -> StepEvent:
    """A result record with a small payload."""
    return StepEvent(run_id=run_id, step_id=step_id, phase=Phase.RESULT, payload=payload)


def pragma(path: Path, name: str) -> object:
    """Read one PRAGMA through a connection of our own, then close it."""
    with closing(sqlite3.connect(path)) as db:
        return db.execute(f"PRAGMA {name}").fetchone()[0]


def run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python process, bounded in time."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        check=False,
    )


async def fill(path: Path, rows: int, *, durability: str = "process") -> None:
    """A real journal with ``rows`` records of a few hundred bytes, closed cleanly."""
    store = SqliteCheckpointer(path, durability=durability)  # type: ignore[arg-type]
    for start in range(0, rows, 20):
        batch = [ev(f"m{i}", text="ledger entry " * 15, n=i) for i in range(start, start + 20)]
        await store.append(*batch)
    await store.close()


async def open_read_write(path: Path) -> None:
    """Open a journal, read a run and append to it, as a resumed run would."""
    store = SqliteCheckpointer(path)
    try:
        await store.load("run-1")
        await store.append(ev("new"))
    finally:
        await store.close()


async def test_records_survive_a_new_process(sqlite_path: Path) -> None:
    """What a child process appended and closed is read back by another process."""
    child = run_child(
        """
        import asyncio, sys
        from asiento import SqliteCheckpointer, StepEvent, Phase, Decision, RunStatus

        async def main():
            store = SqliteCheckpointer(sys.argv[1])
            await store.append(
                StepEvent(run_id="r", step_id="m1", phase=Phase.RESULT, payload={"t": "ñ"}),
                StepEvent(run_id="r", step_id="m1.t1", phase=Phase.INTENT,
                          decision=Decision.ALLOW, payload={"tool": "x"}),
            )
            await store.append(
                StepEvent(run_id="r", step_id="m1.t1", phase=Phase.RESULT, payload={"v": 1}),
                status=RunStatus.SUSPENDED,
            )
            await store.close()

        asyncio.run(main())
        """,
        str(sqlite_path),
    )
    assert child.returncode == 0, child.stderr
    store = SqliteCheckpointer(sqlite_path)
    try:
        events = await store.load("r")
        [run] = await store.runs()
    finally:
        await store.close()
    assert [(e.step_id, e.phase, e.payload) for e in events] == [
        ("m1", Phase.RESULT, {"t": "ñ"}),
        ("m1.t1", Phase.INTENT, {"tool": "x"}),
        ("m1.t1", Phase.RESULT, {"v": 1}),
    ]
    assert (run.run_id, run.status, run.events) == ("r", RunStatus.SUSPENDED, 3)


async def test_wal_mode_is_on(sqlite_path: Path) -> None:
    """The journal file is in WAL mode, as seen by a separate connection."""
    store = SqliteCheckpointer(sqlite_path)
    await store.append(ev("m1"))
    try:
        assert pragma(sqlite_path, "journal_mode") == "wal"
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("kwargs", "expected"), [({}, 2), ({"durability": "full"}, 2), ({"durability": "process"}, 1)]
)
async def test_synchronous_follows_durability(
    sqlite_path: Path, kwargs: dict[str, str], expected: int
) -> None:
    """synchronous is FULL by default and NORMAL with durability="process"."""
    store = SqliteCheckpointer(sqlite_path, **kwargs)  # type: ignore[arg-type]
    try:
        assert store._db.execute("PRAGMA synchronous").fetchone()[0] == expected
    finally:
        await store.close()


def test_invalid_durability_is_refused(sqlite_path: Path) -> None:
    """An unknown durability is a UsageError and creates no file."""
    with pytest.raises(UsageError, match="durability"):
        SqliteCheckpointer(sqlite_path, durability="fast")  # type: ignore[arg-type]
    assert not sqlite_path.exists()


async def test_primary_key_is_run_step_phase(sqlite_path: Path) -> None:
    """The dedup key (run_id, step_id, phase) is the table's PRIMARY KEY, in that order."""
    await SqliteCheckpointer(sqlite_path).close()
    with closing(sqlite3.connect(sqlite_path)) as db:
        info = db.execute("PRAGMA table_info(journal)").fetchall()
    pk = sorted((col[5], col[1]) for col in info if col[5])
    assert pk == [(1, "run_id"), (2, "step_id"), (3, "phase")]


async def test_file_carries_schema_version_and_application_id(sqlite_path: Path) -> None:
    """user_version is the schema version and application_id marks an asiento journal."""
    await SqliteCheckpointer(sqlite_path).close()
    assert pragma(sqlite_path, "user_version") == SCHEMA_VERSION
    assert pragma(sqlite_path, "application_id") == APPLICATION_ID
    assert APPLICATION_ID != 0
    assert SCHEMA_VERSION >= 1


async def test_reopening_keeps_records(sqlite_path: Path) -> None:
    """Opening an existing journal again migrates nothing and loses nothing."""
    await fill(sqlite_path, 40)
    store = SqliteCheckpointer(sqlite_path)
    try:
        assert len(await store.load("run-1")) == 40
    finally:
        await store.close()


def test_text_file_is_not_a_journal(tmp_path: Path) -> None:
    """A plain text file is refused with NotAJournal and left byte for byte as it was."""
    path = tmp_path / "notes.txt"
    content = ("not a database, just notes\n" * 200).encode()
    path.write_bytes(content)
    with pytest.raises(NotAJournal, match=r"notes\.txt"):
        SqliteCheckpointer(path)
    assert path.read_bytes() == content


def test_other_sqlite_database_is_not_a_journal(tmp_path: Path) -> None:
    """Another application's SQLite file is refused with NotAJournal and left unchanged."""
    path = tmp_path / "app.db"
    with closing(sqlite3.connect(path)) as db, db:
        db.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        db.execute("INSERT INTO users (name) VALUES ('ana')")
    before = path.read_bytes()
    with pytest.raises(NotAJournal):
        SqliteCheckpointer(path)
    assert path.read_bytes() == before
    assert not Path(f"{path}-wal").exists()


async def test_newer_schema_is_refused(sqlite_path: Path) -> None:
    """A journal from a newer asiento raises JournalTooNew naming both versions."""
    await fill(sqlite_path, 20)
    newer = SCHEMA_VERSION + 1
    with closing(sqlite3.connect(sqlite_path)) as db:
        db.execute(f"PRAGMA user_version = {newer}")
    before = sqlite_path.read_bytes()
    with pytest.raises(JournalTooNew) as info:
        SqliteCheckpointer(sqlite_path)
    assert str(newer) in str(info.value)
    assert str(SCHEMA_VERSION) in str(info.value)
    assert sqlite_path.read_bytes() == before


def test_directory_is_a_usage_error(tmp_path: Path) -> None:
    """A directory path is a UsageError that names a file to open instead."""
    with pytest.raises(UsageError) as refused:
        SqliteCheckpointer(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path} is a directory, not a journal file; name the journal's file "
        f"(such as {tmp_path / 'runs.db'})"
    )
    assert list(tmp_path.iterdir()) == []


async def test_corrupt_journal_raises_typed_error_and_is_not_rewritten(
    sqlite_path: Path,
) -> None:
    """Garbage over a real journal's pages gives a typed error; the file is never rewritten."""
    await fill(sqlite_path, 600)
    data = bytearray(sqlite_path.read_bytes())
    page = 4096
    assert len(data) > 10 * page
    garbage = random.Random(1234).randbytes(len(data) - 2 * page - page)
    data[2 * page : len(data) - page] = garbage
    sqlite_path.write_bytes(bytes(data))
    with pytest.raises((JournalCorrupt, NotAJournal)):
        await open_read_write(sqlite_path)
    assert sqlite_path.read_bytes() == bytes(data)


@pytest.mark.parametrize(
    ("find", "damage"), [(b"ledger entry", b"\xff"), (b'{"text"', b"X")], ids=["utf8", "json"]
)
async def test_damaged_record_is_journal_corrupt(
    sqlite_path: Path, find: bytes, damage: bytes
) -> None:
    """A record whose stored bytes were damaged reads as JournalCorrupt, not as a guess."""
    await fill(sqlite_path, 40)
    data = bytearray(sqlite_path.read_bytes())
    at = data.index(find)
    data[at : at + 1] = damage
    sqlite_path.write_bytes(bytes(data))
    store = SqliteCheckpointer(sqlite_path)
    try:
        with pytest.raises(JournalCorrupt):
            await store.load("run-1")
    finally:
        await store.close()
    assert sqlite_path.read_bytes() == bytes(data)


async def test_integrity_check_after_many_appends(sqlite_path: Path) -> None:
    """After many appends across runs, SQLite's own integrity check finds nothing."""
    store = SqliteCheckpointer(sqlite_path)
    for i in range(150):
        await store.append(ev(f"m{i}", run_id=f"run-{i % 7}", n=i, text="ñ" * (i % 50)))
    try:
        assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert sum(r.events for r in await store.runs()) == 150
    finally:
        await store.close()


RACER = """
import asyncio, os, sys, time
from asiento import SqliteCheckpointer, StepEvent, Phase, DuplicateRecord

async def main(path, go, me):
    store = SqliteCheckpointer(path)
    deadline = time.monotonic() + 20
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.002)
    event = StepEvent(run_id="r", step_id="m1.t1", phase=Phase.SUBMITTED, payload={"me": me})
    try:
        await store.append(event)
        print("won")
    except DuplicateRecord:
        print("lost")
    await store.close()

asyncio.run(main(*sys.argv[1:]))
"""


async def test_two_processes_racing_for_one_key(sqlite_path: Path, tmp_path: Path) -> None:
    """Two processes appending the same key at once: exactly one record, one DuplicateRecord."""
    await fill(sqlite_path, 20)
    go = tmp_path / "go"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(sqlite_path), str(go), name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    go.touch()
    outputs = [racer.communicate(timeout=CHILD_TIMEOUT) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], [err for _, err in outputs]
    assert sorted(out.strip() for out, _ in outputs) == ["lost", "won"]
    store = SqliteCheckpointer(sqlite_path)
    try:
        [record] = await store.load_step("r", "m1.t1")
    finally:
        await store.close()
    winner = "a" if outputs[0][0].strip() == "won" else "b"
    assert record.payload == {"me": winner}


async def test_duplicate_names_the_key(sqlite_path: Path) -> None:
    """DuplicateRecord from SQLite names the run, the step and the phase."""
    store = SqliteCheckpointer(sqlite_path)
    try:
        await store.append(ev("m1"))
        with pytest.raises(DuplicateRecord, match=r"'run-1'.*'m1'.*'result'"):
            await store.append(ev("m1"))
    finally:
        await store.close()


# -- damaged, unwritable and empty journals (issue 12, item 8) --------------------------


def overwritten(start: int, length: int) -> Callable[[bytes], bytes]:
    """Damage: ``length`` bytes of garbage from ``start`` on (the file keeps its size)."""

    def damage(data: bytes) -> bytes:
        garbage = random.Random(start).randbytes(length)
        return data[:start] + garbage + data[start + length :]

    return damage


PAGE = 4096
DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "cut-in-half": lambda data: data[: len(data) // 2],
    "cut-to-its-first-page": lambda data: data[:PAGE],
    "cut-inside-its-header": lambda data: data[:50],
    "first-page-overwritten-after-the-header": overwritten(100, PAGE - 100),
    "sqlite-magic-overwritten": overwritten(0, 16),  # application_id (offset 68) survives
    "middle-pages-overwritten": overwritten(10 * PAGE, 3 * PAGE),
}


@pytest.mark.parametrize("name", list(DAMAGE))
async def test_a_damaged_journal_is_journal_corrupt_and_says_what_to_do(
    sqlite_path: Path, name: str
) -> None:
    """A real journal cut short or with pages overwritten raises JournalCorrupt (not
    NotAJournal) naming the file, the damage and what to do; the file is left as it is."""
    await fill(sqlite_path, 600)
    data = DAMAGE[name](sqlite_path.read_bytes())
    assert data != sqlite_path.read_bytes()
    sqlite_path.write_bytes(data)
    with pytest.raises(JournalCorrupt) as damaged:
        await open_read_write(sqlite_path)
    message = str(damaged.value)
    assert str(sqlite_path) in message
    assert "is damaged" in message
    assert "left as it is" in message
    assert "backup" in message
    assert ".recover" in message
    assert sqlite_path.read_bytes() == data


async def test_a_journal_on_a_read_only_file_system_is_journal_read_only(tmp_path: Path) -> None:
    """A journal on a read-only mount (a real one: root ignores file modes) is refused with
    JournalReadOnly saying it cannot be written and why, not NotAJournal; so is a new
    journal there. Nothing is written, and the journal reads the same afterwards."""
    with read_only_view(tmp_path) as (folder, view):
        await fill(folder / "runs.db", 40)
        before = (folder / "runs.db").read_bytes()
        with pytest.raises(JournalReadOnly) as refused:
            SqliteCheckpointer(view / "runs.db")
        message = str(refused.value)
        assert "cannot write the journal" in message
        assert "read-only file system" in message
        assert "nothing was written" in message
        assert "read_only=True" in message
        with pytest.raises(JournalReadOnly, match=r"its folder .* is on a read-only file system"):
            SqliteCheckpointer(view / "new.db")
        assert sorted(p.name for p in folder.iterdir()) == ["runs.db"]
        assert (folder / "runs.db").read_bytes() == before


async def test_a_read_only_store_reads_what_it_cannot_write(tmp_path: Path) -> None:
    """read_only=True reads a journal on a read-only mount, including what a live writer
    has in its WAL only; its writes raise JournalReadOnly and record nothing."""
    with read_only_view(tmp_path) as (folder, view):
        await fill(folder / "runs.db", 40)
        writer = SqliteCheckpointer(folder / "runs.db")
        reader = SqliteCheckpointer(view / "runs.db", read_only=True)
        try:
            assert len(await reader.load("run-1")) == 40
            await writer.append(ev("late", run_id="run-2"))  # in the writer's WAL only
            assert [e.step_id for e in await reader.load("run-2")] == ["late"]
            with pytest.raises(JournalReadOnly, match="read-only file system"):
                await reader.append(ev("forbidden", run_id="run-3"))
            assert await writer.load("run-3") == []
        finally:
            await reader.close()
            await writer.close()
        closed = SqliteCheckpointer(view / "runs.db", read_only=True)  # no -wal, no -shm now
        try:
            assert len(await closed.load("run-1")) == 40
        finally:
            await closed.close()


async def test_a_read_only_store_does_not_migrate_nor_make_a_journal(tmp_path: Path) -> None:
    """read_only=True refuses a journal at an older schema (upgrading writes) and an empty
    file (NotAJournal); both are left byte for byte as they were."""
    old = tmp_path / "old.db"
    await fill(old, 20)
    with closing(sqlite3.connect(old)) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION - 1}")
    before = old.read_bytes()
    with pytest.raises(JournalReadOnly, match=f"schema {SCHEMA_VERSION - 1}"):
        SqliteCheckpointer(old, read_only=True)
    assert old.read_bytes() == before
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(NotAJournal, match="empty"):
        SqliteCheckpointer(empty, read_only=True)
    assert empty.read_bytes() == b""


def test_a_journal_another_opener_creates_meanwhile_is_read_as_one(tmp_path: Path) -> None:
    """Two processes open a new file at once: the other one creates the journal (its
    schema and its application id, one transaction) while this one reads what the file
    is. This one sees the file as it was or as it became, never half of each (an empty
    file's id beside the new tables was NotAJournal)."""
    path = tmp_path / "new.db"
    other: list[SqliteCheckpointer] = []

    def meanwhile(statement: str) -> None:
        # the other opener commits once this one has begun to read (its second statement,
        # when it read the file in several)
        seen.append(statement)
        if len(seen) == 2 and not other:
            other.append(SqliteCheckpointer(path))

    seen: list[str] = []

    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.set_trace_callback(meanwhile)
        version = identity(db, path, read_only=False)
    finally:
        db.close()
        for store in other:
            store._db.close()
    assert version in (0, SCHEMA_VERSION)  # before the other's commit, or after it


OPENER = """
import sys, time
from asiento import SqliteCheckpointer
go = float(sys.argv[2])
while time.time() < go:
    time.sleep(0.0005)
SqliteCheckpointer(sys.argv[1])._db.close()
"""


def test_workers_started_together_on_a_new_file_all_open_it(tmp_path: Path) -> None:
    """Six processes open a journal file none of them has created yet, released at the
    same instant, a few times over: each opens it (no NotAJournal, no JournalBusy)."""
    for round_ in range(4):
        path = tmp_path / f"new-{round_}.db"
        go = time.time() + 1.5
        openers = [
            subprocess.Popen(
                [sys.executable, "-c", OPENER, str(path), str(go)],
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(6)
        ]
        for opener in openers:
            _, err = opener.communicate(timeout=60)
            assert opener.returncode == 0, err
