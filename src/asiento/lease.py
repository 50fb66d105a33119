"""Who holds a run: the holder's identity and whether it is provably dead.

A lease names its holder's host and process, with the process start time, so
a pid reused by another program is not mistaken for the holder. A holder on
this host whose process is gone is taken over at once; a holder on another
host only once its lease expires.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True, slots=True, kw_only=True)
class Holder:
    """A session that holds (or wants) a run's lease."""

    owner: str
    host: str
    pid: int
    started: str

    @classmethod
    def here(cls) -> Holder:
        """A new holder identity for a session of this process."""
        pid = os.getpid()
        return cls(owner=uuid.uuid4().hex, host=hostname(), pid=pid, started=process_start(pid))

    def describe(self) -> str:
        return f"{self.owner[:8]} (pid {self.pid} on {self.host})"


@cache
def hostname() -> str:
    """This machine, as leases name it: host name plus boot id where the OS has one."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    boot_id = boot.read_text().strip()[:8] if boot.exists() else ""
    return f"{socket.gethostname()}/{boot_id}" if boot_id else socket.gethostname()


def process_start(pid: int) -> str:
    """The start time of ``pid`` in clock ticks since boot, or "" where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # Field 22 (starttime), counted after the command name, which may hold spaces.
    return stat.rsplit(")", 1)[1].split()[19]


# Owners whose session in this process has ended; bounded, oldest forgotten first.
_ended_here: dict[str, None] = {}
_ENDED_KEPT = 10_000


def ended(owner: str) -> None:
    """The session of this process that held ``owner``'s lease has ended (released or not)."""
    _ended_here[owner] = None
    while len(_ended_here) > _ENDED_KEPT:
        del _ended_here[next(iter(_ended_here))]


def is_dead_here(
    host: str | None, pid: int | None, started: str | None, owner: str | None = None
) -> bool:
    """True only when the holder is provably gone: same host, and its process is not there.

    In this very process, a holder is gone when its session ended, even if the
    release could not be written (the journal was busy, say).
    """
    if host != hostname() or pid is None:
        return False
    if pid == os.getpid():  # our own pid: another process's before, or an ended session
        if started and started != process_start(pid):
            return True
        return owner is not None and owner in _ended_here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    current = process_start(pid)
    return bool(started) and bool(current) and current != started
