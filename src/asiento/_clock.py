"""This process's clock, read through one function so that a test can skew it.

What a process stamps on its records (``StepEvent.created_at``) and, on SQLite and
in memory, how old a record is (``Checkpointer.age``) are read here. PostgreSQL
judges ages on the server's clock instead, so no client clock counts there. The
tests run writers and resumers whose clocks are ahead or behind by setting
``skew`` in a child process; nothing else sets it.
"""

from __future__ import annotations

import time

# Seconds this process's clock reads ahead of the system's (behind when negative).
skew = 0.0


def now() -> float:
    """Seconds since the epoch, as ``time.time()`` (plus a test's ``skew``)."""
    return time.time() + skew
