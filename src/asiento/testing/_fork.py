"""The fork-server's own side: made ready once, then a real process forked per command.

The parent (``_server.ForkServer``) writes one JSON command per line on stdin. The
server forks a process for each, which runs it and exits with ``os._exit`` (nothing
of the server's state is torn down in it), and answers with one JSON line: the
process's pid, exit code, outcome (None if it was killed) and how long it took. A
command's ``kill_after`` (seconds) makes the server SIGKILL the process after that
delay. The harness's child (``_child``) serves a user's app this way; asiento's own
crash tests (``tests/crash/child.py``) serve their child with it too.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
import traceback
from typing import Any, Protocol

Command = dict[str, Any]
Outcome = dict[str, Any]
MAX_COMMANDS = 1_000_000


class Served(Protocol):
    """What a fork-server serves: warmed up once, then one command per forked process."""

    def warm_up(self) -> None: ...

    def execute(self, cmd: Command) -> tuple[int, Outcome]:
        """Run ``cmd`` in this (forked) process: the exit code and the outcome."""
        ...


def serve(child: Served) -> int:
    """Answer one JSON line per command, forking a child for each."""
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the served code prints must not corrupt the protocol
    child.warm_up()
    protocol.write(json.dumps({"ready": os.getpid()}) + "\n")
    protocol.flush()
    for _ in range(MAX_COMMANDS):
        line = sys.stdin.readline()
        if not line:
            return 0
        protocol.write(json.dumps(fork_one(child, json.loads(line))) + "\n")
        protocol.flush()
    return 0


def fork_one(child: Served, cmd: Command) -> dict[str, Any]:
    """Run ``cmd`` in a forked process; SIGKILL it after ``kill_after`` if asked; reap it."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _forked(child, cmd, write_end)
    os.close(write_end)
    timer_killed = _wait_or_kill(pid, cmd.get("kill_after"))
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as pipe:
        text = pipe.read().decode()
    return {
        "pid": pid,
        "rc": os.waitstatus_to_exitcode(status),
        "out": json.loads(text) if text else None,
        "timer_killed": timer_killed,
        "seconds": time.monotonic() - started,
    }


def _wait_or_kill(pid: int, kill_after: float | None) -> bool:
    """Wait up to ``kill_after`` s for the child to exit; SIGKILL it if it has not."""
    if kill_after is None:
        return False
    fd = os.pidfd_open(pid)
    try:
        exited, _, _ = select.select([fd], [], [], kill_after)
    finally:
        os.close(fd)
    if exited:
        return False
    os.kill(pid, signal.SIGKILL)  # not reaped yet: the pid is still this child's
    return True


def _forked(child: Served, cmd: Command, fd: int) -> None:
    code = 1
    try:
        code, out = child.execute(cmd)
        os.write(fd, json.dumps(out).encode())
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)
