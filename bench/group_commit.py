"""fsync-class syscalls per model+tool step with many runs on one SQLite journal.

    python bench/group_commit.py                 # 1, 16 and 256 concurrent runs
    python bench/group_commit.py --runs 1 16     # only these

Each configuration is a child process under ``strace -f -c``: N runs driven by
``asyncio.gather`` of ``agent.run`` on one ``SqliteCheckpointer`` (durability
"full"), each an ``Agent`` with one trivial async tool and a ``ScriptedGateway``
doing S model+tool steps and a final answer. The figure is
(calls with S steps - calls with 0 steps) / (N * S), so opening the file, the
final answers and the closing commit cancel out. Group commit (docs/journal.md)
is what makes it fall below 2 as N grows; it prints figures, not verdicts.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from contextlib import aclosing
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_overhead import FSYNC_CLASS, TASK, TOOLS, parse_strace_summary, scripted

from asiento import Agent, Session, SqliteCheckpointer

RUNS = (1, 16, 256)
STEPS = 8


async def drive_many(path: Path, runs: int, steps: int) -> None:
    """``runs`` runs of ``steps`` model+tool steps each, all at once on one store."""
    store = SqliteCheckpointer(path)
    agent = Agent(instructions="You note numbers.", tools=[TOOLS["async"]], max_turns=steps + 1)

    async def one(i: int) -> None:
        session = Session(f"run-{i}", scripted(steps), store)
        async with aclosing(agent.run(TASK, session=session)) as run:  # type: ignore[type-var]
            async for _ in run:
                pass

    try:
        await asyncio.gather(*(one(i) for i in range(runs)))
    finally:
        await store.close()


def traced(directory: Path, runs: int, steps: int) -> int:
    """fsync-class calls of one child driving ``runs`` runs of ``steps`` steps."""
    out = directory / f"strace-{runs}-{steps}.txt"
    command = [
        "strace", "-f", "-c", "-o", str(out), "-e", "trace=" + ",".join(FSYNC_CLASS),
        sys.executable, str(Path(__file__).resolve()), "--child", str(runs),
        "--steps", str(steps), "--dir", str(directory),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{runs} runs under strace exited {done.returncode}: {' | '.join(tail)}")
    return sum(parse_strace_summary(out.read_text()).values())


def per_step(directory: Path, runs: int, steps: int) -> float:
    base = traced(directory, runs, 0)
    return (traced(directory, runs, steps) - base) / (runs * steps)


def child(args: argparse.Namespace) -> None:
    runs, steps = int(args.child), args.steps
    path = Path(args.dir) / f"child-{runs}-{steps}.db"
    for stale in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        stale.unlink(missing_ok=True)
    asyncio.run(drive_many(path, runs, steps))


def main(args: argparse.Namespace) -> None:
    if shutil.which("strace") is None:
        print("skipped: strace is not installed")
        return
    directory = Path(tempfile.mkdtemp(prefix="asiento-group-", dir=args.dir))
    try:
        title = "fsync-class syscalls per model+tool step, one SqliteCheckpointer"
        print(f"== {title}, S={args.steps}")
        print(f"   {'runs':>6}  {'fsyncs/step':>11}")
        for runs in args.runs:
            print(f"   {runs:>6}  {per_step(directory, runs, args.steps):>11.3f}", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def parse_args(argv: Any = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, nargs="+", default=list(RUNS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--dir", help="where to put the SQLite files (default: a temp dir)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.child:
        child(parsed)
    else:
        main(parsed)
