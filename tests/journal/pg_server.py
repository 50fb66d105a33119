"""A real PostgreSQL server for the tests, started once per session.

``ASIENTO_TEST_PG_DSN`` points the tests at an existing server (its role needs
CREATE on its database). Otherwise a throwaway cluster is started from the
binaries bundled in the ``pgserver`` package, in a temporary directory,
listening only on a Unix socket there.

Each test gets a schema of its own (a new database costs 0.1 s, a schema 1 ms):
its DSN sets ``search_path`` to that schema, as a user would to keep asiento's
tables apart, and ``application_name`` to the schema's name, so a test can find
(and terminate) the backends of its own stores in ``pg_stat_activity``.

As root, PostgreSQL refuses to start, and pgserver's own answer is to create a
``pgserver`` user and ``chmod o+rx`` every parent of its install (``/root``
included). Instead, the binaries are hard-linked (or copied) into the
temporary directory and the server runs as ``nobody``: nothing outside that
directory is touched. The package is located, not imported: importing it warns
about ``XDG_RUNTIME_DIR``, and the tests turn warnings into errors.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

ENV_VAR = "ASIENTO_TEST_PG_DSN"
PREFIX = "asiento_t_"


class ServerUnavailable(RuntimeError):
    """No PostgreSQL server for the tests; the message says how to get one."""


@dataclass
class Cluster:
    """A server the tests may create databases on."""

    admin_dsn: str
    base: Path | None = None  # the temporary directory of a server we started
    bin: Path = Path()
    run_as: tuple[int, int] | None = None
    created: list[str] = field(default_factory=list)

    def new_dsn(self) -> str:
        """Create an empty schema and return a DSN whose tables live in it."""
        name = PREFIX + uuid.uuid4().hex[:16]
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        self.created.append(name)
        return make_conninfo(self.admin_dsn, options=f"-csearch_path={name}", application_name=name)

    def halt(self, mode: str = "fast") -> None:
        """Stop a server we started, keeping its data: every client loses its connections.

        ``mode`` is pg_ctl's: ``fast`` (a clean shutdown) or ``immediate`` (a crash,
        recovered at the next start).
        """
        self._ours("halt")
        _pg(self, "pg_ctl", "-D", "data", "-m", mode, "-w", "stop")

    def resume(self) -> None:
        """Start again, on the same socket and data, a server stopped by ``halt()``."""
        self._ours("resume")
        _pg(self, "pg_ctl", "-D", "data", "-l", "server.log", "-w", "-o", _options(self), "start")

    def restart(self, mode: str = "fast") -> None:
        """``halt()`` then ``resume()``: what a restart or a fail-over looks like to clients."""
        self.halt(mode)
        self.resume()

    def _ours(self, what: str) -> None:
        if self.base is None:
            raise ServerUnavailable(f"cannot {what} the server {ENV_VAR} names, only ours")

    def stop(self) -> None:
        """Stop a server we started (and delete it), or drop our databases on a given one."""
        if self.base is None:
            self._drop_created()
            return
        _pg(self, "pg_ctl", "-D", "data", "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.base, ignore_errors=True)

    def _drop_created(self) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            for name in self.created:
                conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def start() -> Cluster:
    """The session's server: the one ``ASIENTO_TEST_PG_DSN`` names, or a new one."""
    given = os.environ.get(ENV_VAR)
    if given:
        _check_reachable(given)
        return Cluster(admin_dsn=given)
    return _start_local()


def _check_reachable(dsn: str) -> None:
    try:
        with psycopg.connect(dsn, connect_timeout=10) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        raise ServerUnavailable(f"{ENV_VAR} is set but the server does not answer: {exc}") from exc


def _install_dir() -> Path:
    spec = importlib.util.find_spec("pgserver")
    if spec is None or spec.origin is None:
        raise ServerUnavailable(
            f"no PostgreSQL for the tests: pip install pgserver, or set {ENV_VAR} to a DSN"
        )
    return Path(spec.origin).parent / "pginstall"


def _start_local() -> Cluster:
    base = Path(tempfile.mkdtemp(prefix="asiento-pg-"))
    cluster = Cluster(admin_dsn=f"host={base} port=5432 user=postgres dbname=postgres", base=base)
    try:
        _prepare(cluster, _install_dir())
        _pg(cluster, "initdb", "-D", "data", "-U", "postgres", "--auth=trust", "-E", "UTF8")
        options = _options(cluster)
        _pg(cluster, "pg_ctl", "-D", "data", "-l", "server.log", "-w", "-o", options, "start")
    except (OSError, subprocess.SubprocessError, ServerUnavailable) as exc:
        log = base / "server.log"
        detail = log.read_text() if log.exists() else ""
        shutil.rmtree(base, ignore_errors=True)
        raise ServerUnavailable(
            f"could not start PostgreSQL from pgserver ({exc}); set {ENV_VAR} to use another "
            f"server.\n{detail}"
        ) from exc
    return cluster


def _options(cluster: Cluster) -> str:
    """The server's options: a Unix socket in ``base`` only, and no fsync (tests only)."""
    return f"-k {cluster.base} -h '' -p 5432 -c fsync=off -c full_page_writes=off"


def _prepare(cluster: Cluster, install: Path) -> None:
    """Make the binaries runnable; as root, by ``nobody``, from copies inside ``base``."""
    assert cluster.base is not None
    cluster.bin = install / "bin"
    if os.geteuid() != 0:
        return
    # The binaries find their libraries at $ORIGIN/../../../pgserver.libs: keep that layout.
    site, copy = install.parent.parent, cluster.base / "pkg"
    for part in ("pgserver/pginstall/bin", "pgserver/pginstall/lib", "pgserver/pginstall/share"):
        shutil.copytree(site / part, copy / part, copy_function=_link_or_copy)
    shutil.copytree(site / "pgserver.libs", copy / "pgserver.libs", copy_function=_link_or_copy)
    cluster.bin = copy / "pgserver/pginstall/bin"
    nobody = pwd.getpwnam("nobody")
    cluster.run_as = (nobody.pw_uid, nobody.pw_gid)
    os.chown(cluster.base, *cluster.run_as)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _pg(cluster: Cluster, program: str, *args: str, check: bool = True) -> None:
    """Run one of the bundled programs; output goes to a file (a pipe can hang pg_ctl)."""
    assert cluster.base is not None
    user = {} if cluster.run_as is None else {"user": cluster.run_as[0], "group": cluster.run_as[1]}
    with tempfile.TemporaryFile("w+") as out:
        done = subprocess.run(
            [str(cluster.bin / program), *args],
            cwd=cluster.base,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=90,
            env={**os.environ, "LC_ALL": "C", "HOME": str(cluster.base)},
            check=False,
            **user,  # type: ignore[arg-type]
        )
        out.seek(0)
        if check and done.returncode != 0:
            raise ServerUnavailable(f"{program} {' '.join(args)} failed:\n{out.read()}")


def host_and_port(dsn: str) -> tuple[str, int]:
    """Where a DSN connects: a host name or a socket directory, and the port."""
    params = conninfo_to_dict(dsn)
    return str(params.get("host") or "/var/run/postgresql"), int(params.get("port") or 5432)
