"""Closing a connection to a damaged journal without checkpointing its WAL.

SQLite checkpoints the WAL into the main file when the last connection closes.
After corruption was found, that would copy damaged pages over the only copy of
what was recorded. ``SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE`` turns that off; Python
3.12 exposes it as ``Connection.setconfig``, Python 3.11 does not, so there it
is set through the C library the ``_sqlite3`` module is linked against, on the
connection's own handle, after checking that the handle names the same file.
"""

from __future__ import annotations

import ctypes
import os
import sqlite3
import sys
from functools import cache

_NO_CKPT_ON_CLOSE = 1006  # SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE (sqlite3.h), since SQLite 3.16


def keep_wal_on_close(db: sqlite3.Connection, path: str | os.PathLike[str]) -> bool:
    """Make closing ``db`` leave the WAL and the main file as they are; True if it will."""
    if sys.version_info >= (3, 12):
        try:
            db.setconfig(sqlite3.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, True)
        except sqlite3.Error:
            return False
        return True
    try:
        return _set_through_the_library(db, path)
    except (OSError, AttributeError, ValueError):  # no such library or symbol here
        return False


def _set_through_the_library(db: sqlite3.Connection, path: str | os.PathLike[str]) -> bool:
    lib = _library()
    if lib is None:
        return False
    # CPython 3.11's connection object starts with the sqlite3* after PyObject_HEAD.
    handle = ctypes.c_void_p.from_address(id(db) + object.__basicsize__).value
    if not handle or not _names(lib, handle, path):
        return False
    now = ctypes.c_int(-1)
    rc = lib.sqlite3_db_config(
        ctypes.c_void_p(handle), ctypes.c_int(_NO_CKPT_ON_CLOSE), ctypes.c_int(1), ctypes.byref(now)
    )
    return rc == 0 and now.value == 1


def _names(lib: ctypes.CDLL, handle: int, path: str | os.PathLike[str]) -> bool:
    """Whether ``handle`` is a connection to ``path``: the guard against a wrong layout."""
    filename = lib.sqlite3_db_filename
    filename.restype = ctypes.c_char_p
    filename.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    found = filename(ctypes.c_void_p(handle), b"main")
    if not found:
        return False
    try:
        return os.path.samefile(os.fsdecode(found), path)
    except OSError:
        return False


@cache
def _library() -> ctypes.CDLL | None:
    import _sqlite3

    lib = ctypes.CDLL(_sqlite3.__file__)  # dlsym also searches the libsqlite3 it links
    version = lib.sqlite3_libversion_number
    version.restype = ctypes.c_int
    major, minor, patch = sqlite3.sqlite_version_info
    if version() != major * 1_000_000 + minor * 1000 + patch:
        return None  # another SQLite than the module's: do not touch its handles
    return lib
