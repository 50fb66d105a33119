"""A real PostgreSQL server for the tests, started once per session.

``ASIENTO_TEST_PG_DSN`` points the tests at an existing server (its role needs
CREATE on its database). Otherwise a throwaway cluster is started by
``asiento.testing.postgres`` from the binaries bundled in the ``pgserver``
package, in a temporary directory, listening only on a Unix socket there, with
fsync off (tests only).

Each test gets a schema of its own (a new database costs 0.1 s, a schema 1 ms):
its DSN sets ``search_path`` to that schema, as a user would to keep asiento's
tables apart, and ``application_name`` to the schema's name, so a test can find
(and terminate) the backends of its own stores in ``pg_stat_activity``.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from asiento.testing.postgres import LocalPostgres, PostgresUnavailable, start_local_postgres

ENV_VAR = "ASIENTO_TEST_PG_DSN"
PREFIX = "asiento_t_"


class ServerUnavailable(RuntimeError):
    """No PostgreSQL server for the tests; the message says how to get one."""


@dataclass
class Cluster:
    """A server the tests may create schemas on."""

    admin_dsn: str
    local: LocalPostgres | None = None  # a server we started (else the one ENV_VAR names)
    created: list[str] = field(default_factory=list)

    def new_dsn(self) -> str:
        """Create an empty schema and return a DSN whose tables live in it."""
        name = PREFIX + uuid.uuid4().hex[:16]
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        self.created.append(name)
        return make_conninfo(self.admin_dsn, options=f"-csearch_path={name}", application_name=name)

    def halt(self, mode: str = "fast") -> None:
        """Stop a server we started, keeping its data (``LocalPostgres.halt``)."""
        self._ours("halt").halt(mode)

    def resume(self) -> None:
        """Start again, on the same socket and data, a server stopped by ``halt()``."""
        self._ours("resume").resume()

    def restart(self, mode: str = "fast") -> None:
        """``halt()`` then ``resume()``: what a restart or a fail-over looks like to clients."""
        self._ours("restart").restart(mode)

    def _ours(self, what: str) -> LocalPostgres:
        if self.local is None:
            raise ServerUnavailable(f"cannot {what} the server {ENV_VAR} names, only ours")
        return self.local

    def stop(self) -> None:
        """Stop a server we started (and delete it), or drop our schemas on a given one."""
        if self.local is not None:
            self.local.stop()
            return
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            for name in self.created:
                conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def start() -> Cluster:
    """The session's server: the one ``ASIENTO_TEST_PG_DSN`` names, or a new one."""
    given = os.environ.get(ENV_VAR)
    if given:
        _check_reachable(given)
        return Cluster(admin_dsn=given)
    try:
        local = start_local_postgres(fsync=False)
    except PostgresUnavailable as exc:
        raise ServerUnavailable(f"{exc}\nOr set {ENV_VAR} to use another server.") from exc
    return Cluster(admin_dsn=local.dsn, local=local)


def _check_reachable(dsn: str) -> None:
    try:
        with psycopg.connect(dsn, connect_timeout=10) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        raise ServerUnavailable(f"{ENV_VAR} is set but the server does not answer: {exc}") from exc


def host_and_port(dsn: str) -> tuple[str, int]:
    """Where a DSN connects: a host name or a socket directory, and the port."""
    params = conninfo_to_dict(dsn)
    return str(params.get("host") or "/var/run/postgresql"), int(params.get("port") or 5432)
