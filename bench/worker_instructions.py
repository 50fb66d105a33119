"""The worker's own work a run, counted in instructions (callgrind), not in seconds.

    python bench/worker_instructions.py                     # this checkout's src
    python bench/worker_instructions.py --before 407302c    # and another revision's, beside it

On a shared machine the fleet bench's throughput moves by a tenth from one run to the
next, so a cut of a few per cent of the worker's Python cannot be seen there. Here
``bench/fleet.py``'s worker drives its runs (two model steps and one tool step each,
SQLite, answers at once, a lease long enough that no renewal falls due under
valgrind's slowness) inside ``valgrind --tool=callgrind``, with ``PYTHONHASHSEED=0``;
the instructions of the larger number of runs less those of the smaller, divided by
the difference, are one run's, start-up and imports cancelled out. The same count
comes back to within a quarter of a percent. ``--before REV`` measures ``git archive
REV src`` on ``PYTHONPATH`` in the same run and prints the ratio. Figures, never
pass/fail. Needs valgrind (Debian's package).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def child(runs: int, concurrency: int) -> None:
    """Inside valgrind: ``runs`` runs through one worker at ``concurrency``."""
    sys.path.insert(0, str(HERE))
    import fleet

    fleet.App = functools.partial(fleet.App, lease_ttl=3600.0)  # type: ignore[misc]
    with tempfile.TemporaryDirectory() as folder:
        row = asyncio.run(
            fleet._one_sqlite_worker(Path(folder) / "runs.db", runs, concurrency, 1e-9)
        )
    assert row["closed"] == runs, row


def instructions(src: Path, runs: int, concurrency: int) -> int:
    """What callgrind counts for one child process over ``runs`` runs."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "callgrind.out"
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                os.path.realpath(sys.executable),
                str(Path(__file__).resolve()),
                "--child",
                str(runs),
                str(concurrency),
            ],
            env={**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(src)},
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"the child failed under valgrind:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def per_run(src: Path, small: int, large: int, concurrency: int) -> float:
    return (instructions(src, large, concurrency) - instructions(src, small, concurrency)) / (
        large - small
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="a git revision to measure beside this checkout")
    parser.add_argument("--concurrency", type=int, default=64, help="the worker's (64)")
    parser.add_argument("--runs", default="64,320", help="the two run counts (64,320)")
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    small, large = (int(n) for n in args.runs.split(","))
    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory() as folder:
        if args.before:
            archive = subprocess.run(
                ["git", "-C", str(HERE.parent), "archive", args.before, "src"],
                capture_output=True,
                check=True,
            )
            subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
            before = per_run(Path(folder) / "src", small, large, args.concurrency)
            rows.append((args.before, before))
        rows.append(("this checkout", per_run(SRC, small, large, args.concurrency)))
    print(
        f"\nthe worker's instructions a run (callgrind, concurrency {args.concurrency},"
        f" {large} runs less {small})"
    )
    base = rows[0][1]
    for name, count in rows:
        print(f"{name:>16} {count / 1e6:8.3f} M   {count / base:5.2f}x")


if __name__ == "__main__":
    main()
