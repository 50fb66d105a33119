"""Which backend a harness store names, and how the child and the parent reach it.

A store is a SQLite path or ``sqlite://`` URL, or a PostgreSQL ``postgresql://``
URL or libpq ``key=value`` connection string.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UsageError
from ..journal.base import Checkpointer


def is_postgres(store: str) -> bool:
    """Whether ``store`` names a PostgreSQL database rather than a SQLite file."""
    if store.startswith(("postgresql://", "postgres://")):
        return True
    if "://" in store or os.path.exists(store):
        return False
    words = store.split()
    return bool(words) and all("=" in word for word in words)


def backend(store: str) -> str:
    return "postgresql" if is_postgres(store) else "sqlite"


def sqlite_path(store: str) -> Path:
    """The file of a SQLite store: a plain path or ``sqlite:///rel`` / ``sqlite:////abs``."""
    if store.startswith("sqlite://"):
        rest = store.removeprefix("sqlite://").partition("?")[0]
        if not rest.startswith("/") or len(rest) < 2:
            raise UsageError(f"{store!r}: write sqlite:///relative.db or sqlite:////absolute.db")
        return Path(rest[1:])
    if "://" in store:
        raise UsageError(f"the crash harness cannot use the store {store!r}")
    return Path(store)


def pg_dsn(store: str, application_name: str) -> str:
    """The libpq connection string of ``store``, its connections named ``application_name``."""
    from psycopg.conninfo import make_conninfo

    return make_conninfo(store, application_name=application_name)


def pg_application_name(store: str) -> str | None:
    """The ``application_name`` the store's DSN sets, if any."""
    from psycopg.conninfo import conninfo_to_dict

    name = conninfo_to_dict(store).get("application_name")
    return None if name is None else str(name)


async def open_checkpointer(store: str, application_name: str) -> Checkpointer:
    """Open the store for one child: a small pool for PostgreSQL, the file for SQLite."""
    if is_postgres(store):
        from ..journal.postgres import PostgresCheckpointer

        dsn = pg_dsn(store, application_name)
        return await PostgresCheckpointer.connect(dsn, min_size=1, max_size=2, timeout=10.0)
    from ..journal.url import open_store

    return await open_store(store)
