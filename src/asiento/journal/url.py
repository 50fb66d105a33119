"""Open a journal by URL: the same code on SQLite or PostgreSQL.

    await open_store("runs.db")                      # a path: SQLite
    await open_store("sqlite:///runs.db")            # relative path
    await open_store("sqlite:////var/lib/runs.db")   # absolute path (four slashes)
    await open_store("sqlite:///runs.db?durability=process")
    await open_store("postgresql://app@db/agents")   # or postgres://

A SQLite URL takes ``durability`` and ``timeout`` as query parameters; a
PostgreSQL URL is handed to libpq as it is. Text without ``://`` is a path,
unless it starts like a scheme (``sqlite:runs.db``): that is refused rather
than taken for a file name. Write ``./name:with:colons.db`` for such a file.
"""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qsl

from ..errors import UsageError
from .base import Checkpointer
from .sqlite import Durability, SqliteCheckpointer

SCHEMES = ("sqlite", "postgresql", "postgres")

_DURABILITY: dict[str, Durability] = {"full": "full", "process": "process"}

_SCHEME_LIKE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")


_LIBPQ_KEYWORDS = re.compile(r"^\s*(host|hostaddr|dbname|user|port|service)\s*=")


async def open_store(url: str | os.PathLike[str]) -> Checkpointer:
    """The journal ``url`` names, opened: a plain path or ``sqlite://`` / ``postgresql://``."""
    text = os.fspath(url)
    if _LIBPQ_KEYWORDS.match(text):  # "host=db dbname=runs ...": a libpq connection string
        return await _postgres(text)
    scheme, sep, rest = text.partition("://")
    if not sep:
        if _SCHEME_LIKE.match(text) or not text:
            raise _unsupported(text)
        return SqliteCheckpointer(text)
    if scheme == "sqlite":
        return _sqlite(text, rest)
    if scheme in ("postgresql", "postgres"):
        return await _postgres(text)
    raise _unsupported(text)


def _sqlite(url: str, rest: str) -> SqliteCheckpointer:
    path, _, query = rest.partition("?")
    if not path.startswith("/") or len(path) < 2:
        raise UsageError(
            f"{url!r}: write sqlite:///relative/path.db or sqlite:////absolute/path.db"
        )
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    unknown = set(options) - {"durability", "timeout"}
    if unknown:
        raise UsageError(f"{url!r}: unknown options {sorted(unknown)}; known: durability, timeout")
    durability = _DURABILITY.get(options.get("durability", "full"))
    if durability is None:
        raise UsageError(f"{url!r}: durability must be 'full' or 'process'")
    try:
        timeout = float(options.get("timeout", 5.0))
    except ValueError:
        raise UsageError(f"{url!r}: timeout must be a number of seconds") from None
    return SqliteCheckpointer(path[1:], durability=durability, timeout=timeout)


async def _postgres(url: str) -> Checkpointer:
    try:
        from .postgres import PostgresCheckpointer
    except ImportError as exc:
        raise UsageError(
            f"PostgreSQL journals need psycopg: pip install 'asiento[postgres]' ({exc})"
        ) from exc
    return await PostgresCheckpointer.connect(url)


def _unsupported(text: str) -> UsageError:
    shown = _hide_password(text)
    return UsageError(
        f"cannot open a journal at {shown!r}: supported are a file path, "
        "sqlite:///relative/path.db, sqlite:////absolute/path.db and postgresql:// "
        "(or postgres://) URLs"
    )


def _hide_password(text: str) -> str:
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", text)
