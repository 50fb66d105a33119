"""A throwaway PostgreSQL server for tests and benches, from the ``pgserver`` package.

    from asiento.testing.postgres import start_local_postgres

    server = start_local_postgres()          # initdb + start, in a temporary directory
    try:
        store = PostgresCheckpointer(server.dsn)
        ...
        server.restart("immediate")           # a crash of the server, recovered at start
    finally:
        server.stop()                         # and the directory is deleted

The server listens only on a Unix socket inside its temporary directory, so
nothing on the network can reach it. As root, PostgreSQL refuses to start, and
pgserver's own answer is to create a ``pgserver`` user and ``chmod o+rx`` every
parent of its install (``/root`` included). Instead, the binaries are
hard-linked (or copied) into the temporary directory and the server runs as
``nobody``: nothing outside that directory is touched. The package is located,
not imported: importing it warns about ``XDG_RUNTIME_DIR``, which a test suite
that turns warnings into errors would fail on. ``pip install pgserver`` (it is
in asiento's ``test`` extra) provides the binaries.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import AsientoError

__all__ = ["LocalPostgres", "PostgresUnavailable", "hot_updates", "start_local_postgres"]


class PostgresUnavailable(AsientoError, RuntimeError):
    """No PostgreSQL server could be started; the message says why."""


@dataclass
class LocalPostgres:
    """A server ``start_local_postgres`` started, in its own temporary directory."""

    base: Path
    bin: Path
    fsync: bool = True
    max_connections: int = 100
    run_as: tuple[int, int] | None = None

    @property
    def dsn(self) -> str:
        """The superuser's DSN (trust authentication, the socket in ``base``)."""
        return f"host={self.base} port=5432 user=postgres dbname=postgres"

    def halt(self, mode: str = "fast") -> None:
        """Stop the server, keeping its data: every client loses its connections.

        ``mode`` is pg_ctl's: ``fast`` (a clean shutdown) or ``immediate`` (a crash,
        recovered at the next start).
        """
        self._pg("pg_ctl", "-D", "data", "-m", mode, "-w", "stop")

    def resume(self) -> None:
        """Start again, on the same socket and data, a server stopped by ``halt()``."""
        self._pg("pg_ctl", "-D", "data", "-l", "server.log", "-w", "-o", self._options(), "start")

    def restart(self, mode: str = "fast") -> None:
        """``halt()`` then ``resume()``: what a restart or a fail-over looks like to clients."""
        self.halt(mode)
        self.resume()

    def stop(self) -> None:
        """Stop the server for good and delete its directory."""
        self._pg("pg_ctl", "-D", "data", "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.base, ignore_errors=True)

    def _options(self) -> str:
        """A Unix socket in ``base`` only; without fsync only where asked (tests)."""
        options = f"-k {self.base} -h '' -p 5432 -c max_connections={self.max_connections}"
        if not self.fsync:
            options += " -c fsync=off -c full_page_writes=off"
        return options

    def _pg(self, program: str, *args: str, check: bool = True) -> None:
        """Run one of the bundled programs; output goes to a file (a pipe can hang pg_ctl)."""
        user, group = self.run_as or (None, None)
        with tempfile.TemporaryFile("w+") as out:
            done = subprocess.run(
                [str(self.bin / program), *args],
                cwd=self.base,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=90,
                env={**os.environ, "LC_ALL": "C", "HOME": str(self.base)},
                check=False,
                user=user,
                group=group,
            )
            out.seek(0)
            if check and done.returncode != 0:
                raise PostgresUnavailable(f"{program} {' '.join(args)} failed:\n{out.read()}")


def start_local_postgres(*, fsync: bool = True, max_connections: int = 100) -> LocalPostgres:
    """A new cluster, started; ``fsync=False`` is faster and fit for tests only."""
    install = _install_dir()
    base = Path(tempfile.mkdtemp(prefix="asiento-pg-"))
    server = LocalPostgres(
        base=base, bin=install / "bin", fsync=fsync, max_connections=max_connections
    )
    try:
        _prepare(server, install)
        server._pg("initdb", "-D", "data", "-U", "postgres", "--auth=trust", "-E", "UTF8")
        server.resume()
    except (OSError, subprocess.SubprocessError, PostgresUnavailable) as exc:
        log = base / "server.log"
        detail = log.read_text(errors="replace") if log.exists() else ""
        shutil.rmtree(base, ignore_errors=True)
        raise PostgresUnavailable(
            f"could not start PostgreSQL from pgserver ({exc})\n{detail}".rstrip()
        ) from exc
    return server


def hot_updates(dsn: str, table: str = "runs") -> tuple[int, int]:
    """``table``'s (updates, HOT updates) in the DSN's current schema (``pg_stat_user_tables``).

    A backend reports its counts when it is idle or exits, so they lag; the snapshot
    is cleared so that each call reads them anew. (0, 0) while there are none.
    """
    import psycopg  # here: starting a server needs no client library

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
            " WHERE relname = %s AND schemaname = current_schema()",
            (table,),
        ).fetchone()
    return (0, 0) if row is None else (int(row[0]), int(row[1]))


def _install_dir() -> Path:
    spec = importlib.util.find_spec("pgserver")
    if spec is None or spec.origin is None:
        raise PostgresUnavailable("no PostgreSQL binaries here: pip install pgserver")
    return Path(spec.origin).parent / "pginstall"


def _prepare(server: LocalPostgres, install: Path) -> None:
    """Make the binaries runnable; as root, by ``nobody``, from copies inside ``base``."""
    if os.geteuid() != 0:
        return
    # The binaries find their libraries at $ORIGIN/../../../pgserver.libs: keep that layout.
    site, copy = install.parent.parent, server.base / "pkg"
    for part in ("pgserver/pginstall/bin", "pgserver/pginstall/lib", "pgserver/pginstall/share"):
        shutil.copytree(site / part, copy / part, copy_function=_link_or_copy)
    shutil.copytree(site / "pgserver.libs", copy / "pgserver.libs", copy_function=_link_or_copy)
    server.bin = copy / "pgserver/pginstall/bin"
    nobody = pwd.getpwnam("nobody")
    server.run_as = (nobody.pw_uid, nobody.pw_gid)
    os.chown(server.base, *server.run_as)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
