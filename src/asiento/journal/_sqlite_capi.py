"""Two calls of SQLite's C API that Python's ``sqlite3`` module does not offer.

- Closing a connection to a damaged journal without checkpointing its WAL: SQLite
  checkpoints the WAL into the main file when the last connection closes, which
  after corruption was found would copy damaged pages over the only copy of what
  was recorded. ``SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE`` turns that off (Python 3.12
  exposes it as ``Connection.setconfig``; 3.11 does not).
- The OS error behind a "disk I/O error" (``SQLITE_FCNTL_LAST_ERRNO`` of the WAL
  file), to tell a file size limit or a quota (a full disk, for the user) from
  failing hardware.

Both go through the C library the ``_sqlite3`` module is linked against, on the
connection's own handle, after checking that the handle names the same file; when
that is not possible they report that they could not, and nothing is touched.
"""

from __future__ import annotations

import ctypes
import os
import sqlite3
import sys
from functools import cache

# CPython versions whose sqlite3 connection object starts with its sqlite3* handle
# (read before any call; a handle read from another layout could crash the process).
_LAYOUT_KNOWN = sys.implementation.name == "cpython" and (3, 11) <= sys.version_info[:2] <= (3, 14)

_FCNTL_LAST_ERRNO = 4  # SQLITE_FCNTL_LAST_ERRNO
_FCNTL_JOURNAL_POINTER = 28  # SQLITE_FCNTL_JOURNAL_POINTER: the WAL's sqlite3_file in WAL mode
_NO_CKPT_ON_CLOSE = 1006  # SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE (sqlite3.h), since SQLite 3.16

_FILE_CONTROL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)


class _IoMethods(ctypes.Structure):
    """The head of ``sqlite3_io_methods``, up to ``xFileControl`` (version 1 and later)."""

    _fields_ = [
        ("iVersion", ctypes.c_int),
        *[
            (name, ctypes.c_void_p)
            for name in (
                "xClose",
                "xRead",
                "xWrite",
                "xTruncate",
                "xSync",
                "xFileSize",
                "xLock",
                "xUnlock",
                "xCheckReservedLock",
            )
        ],
        ("xFileControl", _FILE_CONTROL),
    ]


class _File(ctypes.Structure):
    """``sqlite3_file``: every VFS's file object starts with its methods."""

    _fields_ = [("pMethods", ctypes.POINTER(_IoMethods))]


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


def os_errno(db: sqlite3.Connection, path: str | os.PathLike[str]) -> int | None:
    """The errno of the last failed write to ``db``'s WAL (else main file), or None."""
    try:
        found = _handle(db, path)
        if found is None:
            return None
        lib, handle = found
        control = lib.sqlite3_file_control
        control.restype = ctypes.c_int
        control.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p]
        wal = ctypes.c_void_p()
        control(handle, b"main", _FCNTL_JOURNAL_POINTER, ctypes.byref(wal))
        if wal.value and (code := _file_errno(wal)):
            return code
        main = ctypes.c_int(0)
        control(handle, b"main", _FCNTL_LAST_ERRNO, ctypes.byref(main))
        return main.value or None
    except (OSError, AttributeError, ValueError):
        return None


def _file_errno(file: ctypes.c_void_p) -> int:
    """``SQLITE_FCNTL_LAST_ERRNO`` asked of one ``sqlite3_file`` through its own methods."""
    methods = ctypes.cast(file, ctypes.POINTER(_File)).contents.pMethods
    if not methods:  # the file is not open
        return 0
    code = ctypes.c_int(0)
    methods.contents.xFileControl(file, _FCNTL_LAST_ERRNO, ctypes.byref(code))
    return code.value


def _handle(db: sqlite3.Connection, path: str | os.PathLike[str]) -> tuple[ctypes.CDLL, int] | None:
    """The C library and ``db``'s ``sqlite3*``, if that handle is a connection to ``path``."""
    lib = _library() if _LAYOUT_KNOWN else None
    if lib is None:
        return None
    # CPython's connection object (3.11 to 3.14) starts with the sqlite3* after PyObject_HEAD.
    handle = ctypes.c_void_p.from_address(id(db) + object.__basicsize__).value
    if not handle or not _names(lib, handle, path):
        return None
    return lib, handle


def _set_through_the_library(db: sqlite3.Connection, path: str | os.PathLike[str]) -> bool:
    found = _handle(db, path)
    if found is None:
        return False
    lib, handle = found
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
