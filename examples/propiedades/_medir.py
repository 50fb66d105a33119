"""What the property scripts share: fsynced counters, child processes, a plain table.

Every figure the scripts print is measured. A process appends one line to a
count file each time the model answers or a tool runs, and fsyncs it, so the
line survives the SIGKILL that may follow; the parent only counts the lines.
A crash is real: the script starts itself again as a child process armed with
``ASIENTO_CRASH_AT=point``, and the child kills itself with SIGKILL there.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from asiento import ModelRequest, ModelResponse
from asiento.testing import ENV_VAR, ScriptedGateway

KILLED = -signal.SIGKILL


def tally(path: Path, line: str = "1") -> None:
    """Append ``line`` to ``path`` and fsync it before going on."""
    with path.open("a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def lines(path: Path, prefix: str = "") -> list[str]:
    """The lines of a count file that start with ``prefix`` (none if it was never written)."""
    if not path.exists():
        return []
    return [x for x in path.read_text(encoding="utf-8").splitlines() if x.startswith(prefix)]


class CountingGateway:
    """A ``ScriptedGateway`` that writes ``sent KEY`` before each request and
    ``answered KEY`` after each answer, to an fsynced count file."""

    def __init__(self, responses: Sequence[ModelResponse], log: Path) -> None:
        self.inner = ScriptedGateway(responses)
        self.log = log

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        tally(self.log, f"sent {idempotency_key}")
        response = await self.inner.complete(request, idempotency_key=idempotency_key)
        tally(self.log, f"answered {idempotency_key}")
        return response


def model_calls(log: Path) -> int:
    """Model answers received, as the gateway counted them."""
    return len(lines(log, "answered "))


def child(script: str, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``script`` again in a new process, armed to die at ``crash_at`` if given."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if crash_at:
        env[ENV_VAR] = crash_at
    argv = [sys.executable, script, *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)


def run_pass(vuelta: Callable[[Path, Path, int], Awaitable[None]]) -> bool:
    """In a process ``pass_child`` started: run ``vuelta(db, work, n)`` and say so (True)."""
    if sys.argv[1:2] != ["--vuelta"]:
        return False
    asyncio.run(vuelta(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])))
    return True


def pass_child(
    script: str, work: Path, n: int, *, crash_at: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Pass ``n`` of ``script`` in a new process, on ``work``'s ``runs.db`` (``run_pass``)."""
    return child(script, "--vuelta", str(work / "runs.db"), str(work), str(n), crash_at=crash_at)


def ending(proc: subprocess.CompletedProcess[str]) -> str:
    """How a child ended, from its exit status."""
    if proc.returncode == KILLED:
        return "killed by SIGKILL"
    if proc.returncode == 0:
        return "exit 0"
    return f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"


def report(data: Any) -> None:
    """What a child tells its parent: one JSON line on stdout."""
    print(json.dumps(data), flush=True)


def reported(proc: subprocess.CompletedProcess[str]) -> Any:
    """The child's JSON line, or None if it died before writing one."""
    out = proc.stdout.strip().splitlines()
    return json.loads(out[-1]) if proc.returncode == 0 and out else None


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print a plain text table."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    print(f"\n{title}\n")
    for n, row in enumerate(cells):
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))
    print()


def verdict(problems: Sequence[str], holds: str) -> int:
    """Print what failed, or that the property holds; the exit status."""
    for problem in problems:
        print(f"FAIL: {problem}")
    if not problems:
        print(f"OK: {holds}")
    return 1 if problems else 0
