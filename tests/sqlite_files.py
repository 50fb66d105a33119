"""A SQLite journal file that stands for several processes' connections to it.

Tests that kill a pass and resume it open the same file again, as another
process would; the ``journal`` fixture (tests/conftest.py) closes them all.
"""

from __future__ import annotations

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
