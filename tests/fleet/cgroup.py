"""A memory cgroup for a worker process, so that the kernel's OOM killer ends it.

The tests ask the kernel, not Python, to kill a worker that allocates too much, as it
would in production: the worker is moved into a new memory cgroup of this process's own
(cgroup v1 ``memory.limit_in_bytes`` or v2 ``memory.max``), whose limit its tool
exceeds. Where no such cgroup can be made (no write access), ``MemoryCgroup.make``
says why and the test is skipped.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_V1, _V2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")


class CgroupUnavailable(Exception):
    """No memory cgroup could be made here; the message says why."""


class MemoryCgroup:
    """A child cgroup of this process's memory cgroup, with a memory limit."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def make(cls, name: str, limit: int) -> MemoryCgroup:
        for parent, limit_files in _parents():
            group = parent / name
            try:
                group.mkdir(exist_ok=True)
                for limit_file in limit_files:
                    if (group / limit_file).exists():
                        (group / limit_file).write_text(str(limit))
                return cls(group)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    group.rmdir()
                last = exc
                continue
        raise CgroupUnavailable(f"no memory cgroup could be made: {locals().get('last')}")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _parents() -> list[tuple[Path, tuple[str, ...]]]:
    """Where this process's memory cgroup is, with the files that set a limit there."""
    found = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        relative = where.lstrip("/")
        if "memory" in controllers.split(",") and _V1.is_dir():
            limits = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
            found.append((_V1 / relative, limits))
        elif controllers == "" and (_V2 / "cgroup.controllers").exists():
            found.append((_V2 / relative, ("memory.max", "memory.swap.max")))
    return [(p, f) for p, f in found if p.is_dir() and os.access(p, os.W_OK)]
