"""The parent's side of the fork-server: send a command, wait for how its child ended."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import AsientoError

CHILD_MODULE = "asiento.testing._child"


class HarnessError(AsientoError):
    """The harness itself could not work (a child server died, a command timed out)."""


def child_env(extra: Mapping[str, str], pythonpath: tuple[str, ...]) -> dict[str, str]:
    """The parent's environment, unarmed, with the harness's additions."""
    env = {k: v for k, v in os.environ.items() if k != "ASIENTO_CRASH_AT"}
    env.update(extra)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    return env


def serve_argv(config: dict[str, Any]) -> list[str]:
    """The command line of the harness's fork-server for one worker's ``config``."""
    return [sys.executable, "-m", CHILD_MODULE, "serve", json.dumps(config)]


class ForkServer:
    """A fork-server process (``argv``, see ``_fork``): warmed up once, forks per command.

    The harness's is ``serve_argv(config)``: it imports the user's app once.
    """

    def __init__(
        self, argv: Sequence[str], env: dict[str, str], stderr: Path, timeout: float
    ) -> None:
        self.stderr_path, self.timeout = stderr, timeout
        self._stderr = stderr.open("ab")
        self._buffer = b""
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
        )
        ready = json.loads(self._readline())
        self.pid = int(ready["ready"])

    def __call__(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        """Run ``cmd`` in a forked child; its pid, exit code and outcome (None if killed)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError as exc:
            raise HarnessError(f"the fork-server died:\n{self.stderr_tail()}") from exc
        reply: dict[str, Any] = json.loads(self._readline())
        return reply

    def _readline(self) -> bytes:
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + self.timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise HarnessError(
                    f"the fork-server was silent for {self.timeout:.0f}s:\n{self.stderr_tail()}"
                )
            chunk = os.read(fd, 65536)
            if not chunk:
                raise HarnessError(f"the fork-server died:\n{self.stderr_tail()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def stderr_tail(self, chars: int = 4000) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=30)
            self._stderr.close()
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def run_once(
    config: dict[str, Any],
    cmd: Mapping[str, Any],
    env: dict[str, str],
    timeout: float,
    prefix: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run ``cmd`` in a new interpreter (optionally under ``prefix``, e.g. strace)."""
    argv = [
        *prefix,
        sys.executable,
        "-m",
        CHILD_MODULE,
        "once",
        json.dumps(config),
        json.dumps(cmd),
    ]
    started = time.monotonic()
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    lines = done.stdout.strip().splitlines()
    out = None
    if lines:
        try:
            out = json.loads(lines[-1])
        except ValueError:
            out = None
    if out is None and done.returncode >= 0:
        raise HarnessError(f"child {cmd} exited {done.returncode} with no outcome:\n{done.stderr}")
    return {
        "pid": None,
        "rc": done.returncode,
        "out": out,
        "timer_killed": False,
        "seconds": time.monotonic() - started,
        "stderr": done.stderr[-4000:],
    }
