"""Tools for tests/test_isolated.py: isolated ones live at a module's top level, where the
child process that runs them imports them by name."""

from __future__ import annotations

import os
import signal

from asiento import tool

# sum(range(n)) runs in C and never gives the GIL up: a C library that holds it.
GIL_HOLD_N = 10**8


def hold_the_gil(n: int) -> int:
    """Hold the GIL for as long as summing ``n`` integers in C takes."""
    return sum(range(n))


@tool(isolated=True, idempotent=True)
def isolated_hold(n: int) -> int:
    """Hold the GIL in C, in a process of its own."""
    return hold_the_gil(n)


@tool(idempotent=True)
def plain_hold(n: int) -> int:
    """Hold the GIL in C, on a tool thread of this process."""
    return hold_the_gil(n)


@tool(isolated=True)
def where(text: str) -> str:
    """Say which process ran it."""
    return f"{text} from {os.getpid()}"


@tool(isolated=True)
def refuse(text: str) -> str:
    """Fail as a tool does."""
    raise ValueError(f"cannot {text}")


@tool(isolated=True)
def die(text: str) -> str:
    """Kill its own process mid-call, as a segfaulting C library would."""
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


@tool(isolated=True, idempotent=True, timeout=0.5)
def sleep_long(seconds: float) -> int:
    """Sleep past its timeout; returns its pid (never, here)."""
    import time

    time.sleep(seconds)
    return os.getpid()


@tool(isolated=True)
def pid_file(path: str) -> str:
    """Write this process's pid to ``path``, then hang for a while."""
    import time

    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(30)
    return "late"
