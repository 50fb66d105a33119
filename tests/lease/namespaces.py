"""Start processes in a PID namespace of their own, as containers on one host are.

``unshare`` comes with util-linux (essential on Debian): a missing one is a
broken test machine and fails the test; a kernel or sandbox that refuses new
PID namespaces skips it, with unshare's own words.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HOLDER = Path(__file__).with_name("ns_holder.py")


@functools.cache
def _unshare() -> tuple[list[str], str]:
    """The unshare prefix that creates a PID namespace here, or "" and why none does."""
    found = shutil.which("unshare") or next(
        (p for p in ("/usr/bin/unshare", "/bin/unshare") if os.access(p, os.X_OK)), None
    )
    if found is None:
        return [], "missing"
    why = ""
    for extra in ([], ["--user", "--map-root-user"]):  # as root, or root in a user namespace
        prefix = [found, *extra, "--pid", "--fork", "--kill-child"]
        probe = [*prefix, "--mount-proc", "true"]
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False)
        if done.returncode == 0:
            return prefix, ""
        why = done.stderr.strip()
    return [], why


def unshare(*, own_proc: bool = True) -> list[str]:
    """The command prefix for a new PID namespace (with its own /proc unless told not to)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PID namespaces are Linux's")
    prefix, why = _unshare()
    if why == "missing":
        pytest.fail("unshare (util-linux) is not installed: apt-get install util-linux")
    if not prefix:
        pytest.skip(f"this machine refuses new PID namespaces: {why}")
    return [*prefix, "--mount-proc"] if own_proc else prefix


def free_pid() -> int:
    """A pid number no process of this namespace has (high, so it stays free meanwhile)."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    return next(p for p in range(top - 1, 300, -1) if not Path(f"/proc/{p}").exists())


def holder_argv(*args: object) -> list[str]:
    """The argv of ``ns_holder.py`` with ``args``."""
    return [sys.executable, str(HOLDER), *map(str, args)]


def as_pid(pid: int, argv: list[str]) -> list[str]:
    """``argv`` run by a shell (pid 1 of a new namespace) as that namespace's pid ``pid``."""
    script = f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid && {shlex.join(argv)}; exit $?"
    return ["sh", "-c", script]


def start(argv: list[str], tmp_path: Path, *, output: bool = False) -> subprocess.Popen[str]:
    """Start ``argv``; its stderr goes to a file in ``tmp_path``, its stdout to a pipe if asked."""
    errors = (tmp_path / f"stderr.{time.monotonic_ns()}").open("w")
    stdout = subprocess.PIPE if output else subprocess.DEVNULL
    try:
        return subprocess.Popen(argv, stdout=stdout, stderr=errors, text=True)
    finally:
        errors.close()


def wait_for(check: Callable[[], bool], seconds: float = 30.0) -> None:
    """Poll ``check`` until it holds, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def ready(path: Path, proc: subprocess.Popen[str]) -> dict[str, Any]:
    """What a holder wrote once it held its lease (it must not have exited first)."""
    wait_for(lambda: path.exists() or proc.poll() is not None)
    assert path.exists(), f"the holder exited with {proc.returncode} before holding"
    facts: dict[str, Any] = json.loads(path.read_text())
    return facts


def kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL unshare; ``--kill-child`` takes the namespace's pid 1, and so all of it, along."""
    proc.kill()
    proc.communicate(timeout=30)
