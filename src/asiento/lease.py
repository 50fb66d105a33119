"""Who holds a run: the holder's identity and whether it is provably dead.

A lease names its holder's host, PID namespace and process, with the process
start time, so a pid reused by another program is not mistaken for the holder.
A pid means something only in its own PID namespace (two containers on one host
share the host name and boot id, not their pids): a holder recorded in this
very namespace whose process is gone is taken over at once; any other holder
(another host, another namespace, or a row written before namespaces were
recorded) only once its lease expires.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True, slots=True, kw_only=True)
class Holder:
    """A session that holds (or wants) a run's lease."""

    owner: str
    host: str  # where ``pid`` means what it says: see hostname()
    pid: int
    started: str

    @classmethod
    def here(cls) -> Holder:
        """A new holder identity for a session of this process."""
        pid = os.getpid()
        host, started = _identity(pid)
        return cls(owner=uuid.uuid4().hex, host=host, pid=pid, started=started)

    def describe(self) -> str:
        return f"{self.owner[:8]} (pid {self.pid} on {self.host})"


@cache
def _identity(pid: int) -> tuple[str, str]:
    """This process's host and start time: read from ``/proc`` once per process.

    A worker builds a holder for every run it drives; reading three ``/proc`` files
    each time was a tenth of its CPU per run. A forked child is another pid, so it
    reads its own; a process's own PID namespace and start time never change.
    """
    return hostname(), process_start(pid)


# PID namespaces are Linux's; elsewhere a host's pids are one space.
_HAS_PID_NAMESPACES = sys.platform == "linux"
_NAMESPACE_LINK = re.compile(r"pid:\[(\d+)\]")


def hostname() -> str:
    """Where this process's pids mean what they say: host name, boot id, PID namespace.

    For example ``"vm/2c6bc361/pidns:4026531836"``; without the namespace part
    where it cannot be read (then no holder is provably dead on Linux).
    """
    namespace = _pid_namespace()
    return f"{_machine()}/pidns:{namespace}" if namespace else _machine()


@cache
def _machine() -> str:
    """This machine: host name plus boot id where the OS has one (a whole lease host, once)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    boot_id = boot.read_text().strip()[:8] if boot.exists() else ""
    return f"{socket.gethostname()}/{boot_id}" if boot_id else socket.gethostname()


def _pid_namespace() -> str:
    """The inode of this process's PID namespace ("4026531836"), or "" where it cannot be read.

    Read each time, not cached: a child forked after ``unshare(CLONE_NEWPID)``
    lives in another namespace than the parent that imported this module.
    """
    try:
        link = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    found = _NAMESPACE_LINK.fullmatch(link)
    return found.group(1) if found else ""


def process_start(pid: int) -> str:
    """The start time of ``pid`` in clock ticks since boot, or "" where it cannot be read.

    "" too when the ``/proc`` mounted here belongs to another PID namespace (a
    container started without its own ``/proc``): its pid numbers are not ours.
    """
    if not _proc_is_ours():
        return ""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # Field 22 (starttime), counted after the command name, which may hold spaces.
    return stat.rsplit(")", 1)[1].split()[19]


def _proc_is_ours() -> bool:
    """Whether ``/proc`` numbers processes as this process's PID namespace does.

    ``NSpid`` lists our pid in every namespace from the one ``/proc`` was mounted
    for down to ours: a single entry, equal to ``getpid()``, means they are one.
    """
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return line.split()[1:] == [str(os.getpid())]
    return not _HAS_PID_NAMESPACES  # a Linux too old to say: assume nothing


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
    """True only when the holder is provably gone: its pids are ours, and its process is not there.

    In this very process, a holder is gone when its session ended, even if the
    release could not be written (the journal was busy, say).
    """
    if pid is None or not _pids_are_ours(host):
        return False
    if pid == os.getpid():  # our own pid: another process's before, or an ended session
        current = process_start(pid)
        if started and current and started != current:
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


def _pids_are_ours(host: str | None) -> bool:
    """Whether the holder's pid names a process of this host and PID namespace.

    On Linux the holder must have recorded its namespace, and it must be ours:
    a row without one (written before namespaces were recorded, or where it
    could not be read) proves nothing.
    """
    here = hostname()
    return host == here and (not _HAS_PID_NAMESPACES or "/pidns:" in here)
