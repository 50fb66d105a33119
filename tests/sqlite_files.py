"""A SQLite journal file that stands for several processes' connections to it, and the
commits of one connection, counted.

Tests that kill a pass and resume it open the same file again, as another
process would; the ``journal`` fixture (tests/conftest.py) closes them all.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from asiento import SqliteCheckpointer


class Journal:
    """One SQLite journal file; every ``open()`` is another process's connection."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.opened: list[SqliteCheckpointer] = []

    def open(self) -> SqliteCheckpointer:
        store = SqliteCheckpointer(self.path)
        self.opened.append(store)
        return store


def record_commits(store: SqliteCheckpointer, *, every: bool = False) -> list[int]:
    """From now on, for each COMMIT of ``store`` that wrote journal records, how many
    (``every``: each other write transaction too, a lease's or the index's, as 0)."""
    commits: list[int] = []
    inserts = 0

    def seen(sql: str) -> None:
        nonlocal inserts
        if sql.lstrip().upper().startswith("INSERT INTO JOURNAL"):
            inserts += 1
        elif "COMMIT" in sql.upper() and (inserts or every):
            commits.append(inserts)
            inserts = 0

    db: sqlite3.Connection = store._db
    db.set_trace_callback(seen)
    return commits
