"""Open a journal by URL: the same code on SQLite or PostgreSQL.

    await open_store("runs.db")                      # a path: SQLite
    await open_store("sqlite:///runs.db")            # relative path
    await open_store("sqlite:////var/lib/runs.db")   # absolute path (four slashes)
    await open_store("sqlite:///runs.db?durability=process")
    await open_store("postgresql://app@db/agents")   # or postgres://
    await open_store("host=/tmp port=5432 dbname=agents")  # libpq keywords

``address_of`` is the one rule that says what a string names, for
``open_store`` and for the ``asiento`` command alike:

- ``sqlite://...``: an SQLite file, with ``durability`` and ``timeout`` as query
  parameters;
- ``postgresql://...`` or ``postgres://...``: PostgreSQL, handed to libpq as it is;
- text that starts with a libpq keyword and ``=`` (``host=``, ``dbname=``,
  ``service=``...): a libpq keyword string, PostgreSQL too;
- any other text without ``://``: a path to an SQLite file, unless it starts like
  a scheme (``sqlite:runs.db``): that is refused rather than taken for a file
  name. Write ``./name:with:colons.db`` (or ``./dbname=x.db``) for such a file.

``shown`` is what may be printed of such a string: its passwords hidden.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl

from ..errors import JournalReadOnly, UsageError
from .base import Checkpointer
from .sqlite import Durability, SqliteCheckpointer

SCHEMES = ("sqlite", "postgresql", "postgres")

_DURABILITY: dict[str, Durability] = {"full": "full", "process": "process"}

_SCHEME_LIKE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")

# The parameter keywords of libpq 17 (PostgreSQL's "Parameter Key Words"): a string
# that starts with one of them and "=" is a keyword/value connection string.
_LIBPQ_KEYWORDS = frozenset(
    """host hostaddr port dbname user password passfile require_auth channel_binding
    connect_timeout client_encoding options application_name fallback_application_name
    keepalives keepalives_idle keepalives_interval keepalives_count tcp_user_timeout
    replication gssencmode sslmode requiressl sslnegotiation sslcompression sslcert sslkey
    sslkeylogfile sslpassword sslcertmode sslrootcert sslcrl sslcrldir sslsni requirepeer
    ssl_min_protocol_version ssl_max_protocol_version krbsrvname gsslib gssdelegation
    service target_session_attrs load_balance_hosts""".split()  # noqa: SIM905 - as a list: 43 lines
)
_FIRST_KEYWORD = re.compile(r"^\s*([A-Za-z_]+)\s*=")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreAddress:
    """What a store string names: an SQLite file and its options, or a PostgreSQL database."""

    backend: Literal["sqlite", "postgresql"]
    given: str
    path: Path | None = None  # the SQLite file; None for PostgreSQL
    durability: Durability = "full"
    timeout: float = 5.0


def address_of(url: str | os.PathLike[str]) -> StoreAddress:
    """What ``url`` names (see the module's docstring), or a ``UsageError`` saying why not."""
    text = os.fspath(url)
    if _is_libpq_keywords(text):
        return StoreAddress(backend="postgresql", given=text)
    scheme, sep, rest = text.partition("://")
    if not sep:
        if _SCHEME_LIKE.match(text) or not text:
            raise _unsupported(text)
        return StoreAddress(backend="sqlite", given=text, path=Path(text))
    if scheme == "sqlite":
        return _sqlite(text, rest)
    if scheme in ("postgresql", "postgres"):
        return StoreAddress(backend="postgresql", given=text)
    raise _unsupported(text)


async def open_store(url: str | os.PathLike[str]) -> Checkpointer:
    """The journal ``url`` names, opened: a path, ``sqlite://``, ``postgresql://`` or libpq."""
    return await open_address(address_of(url))


async def open_address(address: StoreAddress) -> Checkpointer:
    """Open the journal ``address_of`` found (an SQLite file is created if missing)."""
    if address.path is None:
        return await _postgres(address.given)
    return SqliteCheckpointer(address.path, durability=address.durability, timeout=address.timeout)


async def open_existing(url: str | os.PathLike[str]) -> Checkpointer:
    """Open a journal that already exists: a missing or empty SQLite file is an error, never
    made a journal. One this process cannot write (a read-only mount) is opened read-only:
    everything can be read, and a write says why it cannot be made."""
    address = address_of(url)
    path = address.path
    if path is not None:
        _check_journal_file(path)
    try:
        return await open_address(address)
    except JournalReadOnly:
        if path is None or not path.is_file():
            raise
        return SqliteCheckpointer(path, read_only=True, timeout=address.timeout)


def _check_journal_file(path: Path) -> None:
    if path.is_dir():
        raise UsageError(
            f"{path} is a directory, not a journal; pass --store PATH_OR_URL naming the "
            f"journal's file (such as {path / 'runs.db'})"
        )
    if not path.is_file():
        raise UsageError(f"no journal at {path} (nothing was created); pass --store PATH_OR_URL")
    if path.stat().st_size == 0 and not _has_wal(path):
        raise UsageError(
            f"{path} is an empty file, not a journal (it was left as it is); "
            "pass --store PATH_OR_URL"
        )


def _has_wal(path: Path) -> bool:
    wal = Path(f"{path}-wal")
    return wal.is_file() and wal.stat().st_size > 0


def shown(text: str) -> str:
    """A store string fit to print: every password in it (URL or keywords) is ``***``."""
    if "://" in text:
        text = _URL_USERINFO.sub(r"\1***@", text)
        return _URL_PASSWORD.sub(r"\1***", text)
    return _KEYWORD_PASSWORD.sub(r"\1***", text)


# scheme://user:SECRET@host, ?password=SECRET&..., password=SECRET or password='SE CRET'
_URL_USERINFO = re.compile(r"(://[^:/@?]*:)[^/?]*@")
_URL_PASSWORD = re.compile(r"([?&](?:ssl)?password=)[^&#]*", re.I)
_KEYWORD_PASSWORD = re.compile(
    r"(\b(?:ssl)?password\s*=\s*)(?:'(?:\\.|[^'\\])*(?:'|$)|(?:\\.|[^\s\\])+)", re.I
)


def _is_libpq_keywords(text: str) -> bool:
    first = _FIRST_KEYWORD.match(text)
    return first is not None and first.group(1) in _LIBPQ_KEYWORDS


def _sqlite(url: str, rest: str) -> StoreAddress:
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
    return StoreAddress(
        backend="sqlite", given=url, path=Path(path[1:]), durability=durability, timeout=timeout
    )


async def _postgres(dsn: str) -> Checkpointer:
    try:
        from .postgres import PostgresCheckpointer
    except ImportError as exc:  # its message names the extra to install
        raise UsageError(str(exc)) from exc
    return await PostgresCheckpointer.connect(dsn)


def _unsupported(text: str) -> UsageError:
    return UsageError(
        f"cannot open a journal at {shown(text)!r}: supported are a file path, "
        "sqlite:///relative/path.db, sqlite:////absolute/path.db, postgresql:// "
        "(or postgres://) URLs and libpq keyword strings (host=... dbname=...)"
    )
