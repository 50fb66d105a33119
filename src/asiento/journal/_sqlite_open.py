"""Opening an SQLite journal: whether it can be written, whether it is one, its schema.

Nothing here writes to a file before it is known to be an asiento journal (or an
empty one) that this process can write; the errors SQLite raises on the way are
turned into asiento's by the store, which knows the file's name and state.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from ..errors import JournalError, JournalReadOnly, JournalTooNew, NotAJournal, UsageError
from ._backfill import BUDGET_RECORDS, CACHE_RECORDS, CacheTotals, RunBudgets
from ._sqlite_schema import APPLICATION_ID, MIGRATIONS, SCHEMA_VERSION

# The 16 bytes every SQLite 3 file starts with, and where its header keeps application_id.
_MAGIC = b"SQLite format 3\x00"
_APPLICATION_ID_AT = 68


def connect(path: Path, timeout: float, *, read_only: bool) -> sqlite3.Connection:
    """A connection to the journal at ``path``; refused first if it could not be written."""
    if path.is_dir():
        raise UsageError(
            f"{path} is a directory, not a journal file; name the journal's file "
            f"(such as {path / 'runs.db'})"
        )
    if read_only:
        return _connect_read_only(path, timeout)
    if why := unwritable(path):
        reading = (
            " To only read it, open it with SqliteCheckpointer(path, read_only=True) (the "
            "asiento commands do so by themselves)"
            if path.exists()
            else ""
        )
        raise JournalReadOnly(
            f"cannot write the journal {path}: {why}; nothing was written. asiento writes its "
            f"journal at every step (and SQLite keeps {path.name}-wal and -shm beside it): make "
            f"it writable, or copy it where it can be written.{reading}"
        )
    return _sqlite_connect(str(path), timeout, uri=False)


def unwritable(path: Path) -> str | None:
    """Why this process cannot write the journal at ``path`` and its -wal and -shm, or None."""
    folder = path.absolute().parent
    if path.exists() and not os.access(path, os.W_OK):
        target, what = path, "it"
    elif folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK) and not _sidecars_ok(path):
        target, what = folder, f"its folder {folder}"
    else:
        return None
    if os.statvfs(target).f_flag & os.ST_RDONLY:
        return f"{what} is on a read-only file system"
    return f"this process (uid {os.geteuid()}) may not write {what}"


def _sidecars_ok(path: Path) -> bool:
    """Whether the -wal and -shm exist already and can be written (a closed folder is then fine)."""
    return all(os.access(f"{path}{suffix}", os.W_OK) for suffix in ("-wal", "-shm"))


def _connect_read_only(path: Path, timeout: float) -> sqlite3.Connection:
    """A connection that cannot write: ``mode=ro``, else immutable where no -shm can be made.

    Reading a WAL journal needs its -shm file. Where SQLite cannot create one (a
    read-only file system) and no -wal lies beside the journal, every commit is in
    the main file and nobody can be writing it there: it is read as immutable.
    """
    if not path.is_file():
        raise UsageError(f"no journal at {path}: a read-only store opens an existing journal")
    db = _sqlite_connect(_uri(path, "mode=ro"), timeout, uri=True)
    try:
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return db
    except sqlite3.Error as exc:
        cannot_open = getattr(exc, "sqlite_errorname", "") == "SQLITE_CANTOPEN"
        if not cannot_open or Path(f"{path}-wal").exists():
            return db  # the identity check raises the same error again, and names it
    db.close()
    return _sqlite_connect(_uri(path, "immutable=1"), timeout, uri=True)


def _uri(path: Path, option: str) -> str:
    return f"file:{quote(str(path.absolute()))}?{option}"


def _sqlite_connect(target: str, timeout: float, *, uri: bool) -> sqlite3.Connection:
    try:
        return sqlite3.connect(
            target, timeout=timeout, isolation_level=None, check_same_thread=False, uri=uri
        )
    except sqlite3.Error as exc:
        raise JournalError(f"cannot open journal {target}: {exc}") from exc


_IDENTITY = (
    "SELECT (SELECT application_id FROM pragma_application_id),"
    " (SELECT user_version FROM pragma_user_version), (SELECT count(*) FROM sqlite_master)"
)


def identity(db: sqlite3.Connection, path: Path, *, read_only: bool, timeout: float = 5.0) -> int:
    """Refuse a file that is not an asiento journal before touching it; its schema version.

    SQLite's own errors (a damaged or locked file) pass, for the store to translate.
    """
    # One statement, one snapshot: another process may create the journal meanwhile
    # (workers started together on a new file), and reads of before and after mixed
    # would be an empty file's id beside the new tables.
    app_id, version, tables = db.execute(_IDENTITY).fetchone()
    version = int(version)
    if app_id != APPLICATION_ID and (app_id != 0 or tables):
        raise NotAJournal(f"{path} is an SQLite database but not an asiento journal")
    if version > SCHEMA_VERSION:
        raise JournalTooNew(
            f"{path} has journal schema {version}; this asiento reads up to {SCHEMA_VERSION}. "
            "Upgrade asiento to resume these runs"
        )
    if read_only:
        _check_readable_as_is(path, version, tables)
    else:
        _to_wal(db, timeout)
    return version


def _to_wal(db: sqlite3.Connection, timeout: float) -> None:
    """A new file's one switch to WAL (a journal's is WAL already: nothing to do).

    Several processes opening a new file at once all want the switch; SQLite refuses
    at once, without waiting, the one whose lock could deadlock with another's, so it
    is asked again (and the mode read again: another may have switched it) for up to
    ``timeout`` seconds, as any other lock is waited for.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


def _check_readable_as_is(path: Path, version: int, tables: int) -> None:
    """A read-only store reads a journal at this asiento's schema only: it cannot migrate."""
    if version == 0 and not tables:
        raise NotAJournal(f"{path} is empty, not an asiento journal; it was left as it is")
    if version < SCHEMA_VERSION:
        raise JournalReadOnly(
            f"{path} has journal schema {version} and this asiento reads schema "
            f"{SCHEMA_VERSION}: upgrading it writes to it, which a read-only store does not. "
            "Open it once where it can be written (without read_only=True); nothing was written"
        )


def looks_like_a_journal(path: Path) -> bool:
    """Whether the file's first bytes are SQLite's or carry asiento's application_id.

    SQLite says "file is not a database" both for another kind of file and for a
    journal whose header was damaged; the bytes that survive tell them apart.
    """
    try:
        with path.open("rb") as file:
            head = file.read(100)
    except OSError:
        return False
    marked = head[_APPLICATION_ID_AT : _APPLICATION_ID_AT + 4] == APPLICATION_ID.to_bytes(4, "big")
    return head.startswith(_MAGIC) or marked


@dataclass(slots=True)
class Progress:
    """How far an upgrade got: the schema the journal was at, the migration being applied."""

    start: int
    number: int | None = None
    started: bool = False

    def step(self) -> str:
        """The migration that failed, in words."""
        if self.number is None:
            return f"the upgrade from schema {self.start} to {SCHEMA_VERSION}"
        return f"migration {self.number} (schema {self.number - 1} to {self.number})"

    def kept(self) -> str:
        """What is left of the upgrade: nothing, and why."""
        how = "its transaction was rolled back" if self.started else "it could not start"
        return f"The journal is unchanged, still at schema {self.start} ({how})"


def migrate(db: sqlite3.Connection, path: Path, progress: Progress) -> None:
    """Apply the missing migrations in one write transaction; safe to race.

    On any error the transaction is rolled back (the journal is as it was) and the
    error passes, with ``progress`` saying where it happened.
    """
    db.execute("BEGIN IMMEDIATE")
    progress.started = True
    try:
        progress.start = int(db.execute("PRAGMA user_version").fetchone()[0])
        if progress.start > SCHEMA_VERSION:
            raise JournalTooNew(
                f"{path} was upgraded to schema {progress.start} by a newer asiento"
            )
        for number in range(progress.start + 1, SCHEMA_VERSION + 1):
            progress.number = number
            _apply(db, number)
        progress.number = None
        db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        db.commit()
    except BaseException:
        if db.in_transaction:
            db.rollback()
        raise


def _apply(db: sqlite3.Connection, number: int) -> None:
    for statement in MIGRATIONS[number - 1].split(";"):
        if statement.strip():
            db.execute(statement)
    if backfill := _BACKFILLS.get(number):
        backfill(db)
    db.execute(f"PRAGMA user_version = {number}")


def _backfill_cache_tokens(db: sqlite3.Connection) -> None:
    """Migration 3: each run's prompt-cache tokens, summed from its recorded model results."""
    totals = CacheTotals()
    for run_id, payload in db.execute(CACHE_RECORDS):
        totals.add(run_id, payload)
    db.executemany(
        "UPDATE runs SET cached_input_tokens = ?, cache_write_tokens = ? WHERE run_id = ?",
        totals.updates(),
    )


def _backfill_budgets(db: sqlite3.Connection) -> None:
    """Migration 5: each run's budget, folded from the records that name one."""
    budgets = RunBudgets()
    for run_id, step_id, phase, payload in db.execute(BUDGET_RECORDS + " ORDER BY rowid"):
        budgets.add(run_id, step_id, phase, payload)
    db.executemany(
        "UPDATE runs SET budget_cost = ?, budget_tokens = ?, budget_model_calls = ?"
        " WHERE run_id = ?",
        budgets.updates(),
    )


# What a migration fills in after its SQL ran, by the version it brings the file to.
_BACKFILLS: dict[int, Callable[[sqlite3.Connection], None]] = {
    3: _backfill_cache_tokens,
    5: _backfill_budgets,
}
