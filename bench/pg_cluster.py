"""A throwaway PostgreSQL server for the benches (the approach of tests/journal/pg_server.py).

The binaries come from the ``pgserver`` package (located, not imported). The
server listens only on a Unix socket in a temporary directory; as root it runs
as ``nobody`` from hard-linked copies of the binaries, touching nothing else.
Unlike the tests' server it keeps ``fsync`` on: the figures are for a server
configured as in production.
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


class Unavailable(RuntimeError):
    """No PostgreSQL could be started; the message says why."""


@dataclass
class Cluster:
    base: Path
    bin: Path
    run_as: tuple[int, int] | None = None
    max_connections: int = 100

    @property
    def dsn(self) -> str:
        return f"host={self.base} port=5432 user=postgres dbname=postgres"

    def restart(self, mode: str = "immediate") -> None:
        """Stop (``immediate`` is a crash, recovered at start) and start again, same data."""
        self._pg("pg_ctl", "-D", "data", "-m", mode, "-w", "stop")
        self._start()

    def stop(self) -> None:
        self._pg("pg_ctl", "-D", "data", "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.base, ignore_errors=True)

    def _start(self) -> None:
        options = f"-k {self.base} -h '' -p 5432 -c max_connections={self.max_connections}"
        self._pg("pg_ctl", "-D", "data", "-l", "server.log", "-w", "-o", options, "start")

    def _pg(self, program: str, *args: str, check: bool = True) -> None:
        user = {} if self.run_as is None else {"user": self.run_as[0], "group": self.run_as[1]}
        with tempfile.TemporaryFile("w+") as out:
            done = subprocess.run(
                [str(self.bin / program), *args],
                cwd=self.base,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=90,
                env={**os.environ, "LC_ALL": "C", "HOME": str(self.base)},
                check=False,
                **user,  # type: ignore[arg-type]
            )
            out.seek(0)
            if check and done.returncode != 0:
                raise Unavailable(f"{program} {' '.join(args)} failed:\n{out.read()}")


def start(*, max_connections: int = 100) -> Cluster:
    spec = importlib.util.find_spec("pgserver")
    if spec is None or spec.origin is None:
        raise Unavailable("no PostgreSQL: pip install pgserver, or pass --pg-dsn")
    install = Path(spec.origin).parent / "pginstall"
    base = Path(tempfile.mkdtemp(prefix="asiento-bench-pg-"))
    cluster = Cluster(base=base, bin=install / "bin", max_connections=max_connections)
    try:
        _prepare(cluster, install)
        cluster._pg("initdb", "-D", "data", "-U", "postgres", "--auth=trust", "-E", "UTF8")
        cluster._start()
    except (OSError, subprocess.SubprocessError, Unavailable) as exc:
        shutil.rmtree(base, ignore_errors=True)
        raise Unavailable(f"could not start PostgreSQL from pgserver: {exc}") from exc
    return cluster


def _prepare(cluster: Cluster, install: Path) -> None:
    """As root, PostgreSQL refuses to start: run it as nobody, from copies inside ``base``."""
    if os.geteuid() != 0:
        return
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
