"""A process that claims one key in an IdempotencyKeys table, as a server process would.

    python claimer.py DB KEY [--ttl S] [--lease S] [--skew S] [--go FILE] [--hold]

Prints the verdict (run, replay, in-progress, unknown, conflict) on one line.
``--go`` waits for FILE to exist before claiming (so many claimers race);
``--hold`` then keeps the claimed call running, its lease renewed, until stdin
closes (or the process is killed). Used by tests/mcp/test_call_table.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from asiento import _clock
from asiento.mcp._calls import CallKey, CallTable
from asiento.mcp.server import _Renewer

_GO_LIMIT = 30.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("key")
    parser.add_argument("--ttl", type=float, default=3600.0)
    parser.add_argument("--lease", type=float, default=30.0)
    parser.add_argument("--skew", type=float, default=0.0)
    parser.add_argument("--go", type=Path)
    parser.add_argument("--hold", action="store_true")
    options = parser.parse_args()
    _clock.skew = options.skew
    calls = CallTable(options.db, ttl=options.ttl, lease=options.lease)
    deadline = time.monotonic() + _GO_LIMIT
    while options.go is not None and not options.go.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    seen = calls.claim(CallKey("", options.key), "tool", "fingerprint")
    print(seen.verdict, flush=True)
    if options.hold and seen.verdict == "run":
        _Renewer(calls).start()
        sys.stdin.read()


if __name__ == "__main__":
    main()
