"""What holds a concurrent worker's event loop: renewal delays, loop stalls, fsyncs per step.

    python bench/worker_loop.py                      # K=256, this checkout only
    python bench/worker_loop.py --before HEAD~3      # the same, before and after, in one run
    python bench/worker_loop.py --quick              # K=64, fewer steps (under a minute)

One ``asiento.Worker(concurrency=K)`` on one SQLite journal (durability "full") drives
K runs of S model+tool steps (a model that takes 100 ms an answer, a no-op async tool)
and one CPU-heavy neighbour: a run whose sync tool spends seconds in pure-Python work
on its thread. Leases last 3 s, so each is renewed every second. Measured:

- the worst renewal delay: the longest time between two renewals of one lease, less
  the 1 s they are due apart (a lease lapses when it reaches 2 s);
- the worst loop stall: how late a 10 ms ticker on the loop woke, at worst;
- throughput of the K runs against the ideal (each run's S+1 answers back to back:
  (S+1) x 100 ms, the time until the last of them closed);
- fsync-class calls per step, counted by ``strace -f -c`` as a slope: (calls with S=3
  - calls with S=1) / (K x 2), so opening, claiming and closing cancel out.

``--before REV`` measures the package as it was at REV too (``git archive`` of its
``src`` on PYTHONPATH), in the same run, and prints the ratios. Figures, never verdicts.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_overhead import FSYNC_CLASS, parse_strace_summary

from asiento import (
    Agent,
    App,
    ModelRequest,
    ModelResponse,
    ToolCall,
    Worker,
    open_store,
    submit,
    tool,
)
from asiento.step_ids import FINAL
from asiento.testing import ScriptedGateway

LATENCY = 0.1  # seconds a model answer takes
TTL = 3.0  # lease seconds: renewed every TTL / 3
NEIGHBOUR_SECONDS = 4.0  # the CPU-heavy tool's pure-Python work (--neighbour-seconds)
TICK = 0.01
ROOT = Path(__file__).resolve().parents[1]


@tool
async def note(n: int) -> str:
    """Note a number."""
    return f"noted {n}"


@tool(idempotent=True)
def crunch(n: int) -> str:
    """Pure-Python CPU work on the tool's thread (it takes the GIL in turns with the loop)."""
    end, total = time.monotonic() + float(os.environ.get("NEIGHBOUR_SECONDS", NEIGHBOUR_SECONDS)), 0
    while time.monotonic() < end:
        total += sum(i * i for i in range(1000))
    return f"crunched {n}: {total % 97}"


def answer(steps: int) -> Any:
    def reply(request: ModelRequest) -> ModelResponse:
        done = sum(1 for m in request.messages if m.role == "assistant")
        name = "crunch" if request.instructions == "neighbour" else "note"
        if done < (1 if name == "crunch" else steps):
            return ModelResponse(tool_calls=[ToolCall(name=name, arguments={"n": done + 1})])
        return ModelResponse(text="done")

    return reply


class Slow(ScriptedGateway):
    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        await asyncio.sleep(LATENCY)
        return await super().complete(request, idempotency_key=idempotency_key)


class Renewals:
    """The store, with the time of every lease renewal per run."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.at: dict[str, list[float]] = {}
        self.last_close = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def append(self, *events: Any, **kwargs: Any) -> None:
        await self._store.append(*events, **kwargs)
        if any(e.step_id == FINAL for e in events) and events[0].run_id != "neighbour":
            self.last_close = time.monotonic()

    async def renew(self, lease: Any, *, ttl: float) -> Any:
        self.at.setdefault(lease.run_id, []).append(time.monotonic())
        return await self._store.renew(lease, ttl=ttl)

    def worst_gap(self) -> float:
        gaps = [b - a for times in self.at.values() for a, b in itertools.pairwise(times)]
        return max(gaps, default=0.0)


async def drive(path: Path, runs: int, steps: int, neighbour: bool) -> dict[str, Any]:
    store = await open_store(path)
    counted = Renewals(store)
    agents = {
        "note": Agent(instructions="note", tools=[note], max_turns=steps + 2),
        "neighbour": Agent(instructions="neighbour", tools=[crunch], max_turns=3),
    }
    app = App(agents=agents, gateway=lambda: Slow(answer(steps)), lease_ttl=TTL)
    for n in range(runs):
        await submit(store, f"run-{n:04d}", "note", agent="note")
    if neighbour:
        await submit(store, "neighbour", "crunch", agent="neighbour")
    worker = Worker(counted, app, poll=0.05, concurrency=runs + int(neighbour))  # type: ignore[arg-type]
    late = [0.0]

    async def ticker() -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(TICK)
            late[0] = max(late[0], time.monotonic() - before - TICK)

    ticking = asyncio.create_task(ticker())
    started = time.monotonic()
    await worker.run(until_idle=True, max_seconds=600)
    wall = counted.last_close - started  # the K runs', not the neighbour's
    ticking.cancel()
    await store.close()
    return {
        "runs": runs,
        "closed": worker.stats.closed,
        "wall": wall,
        "ideal": (steps + 1) * LATENCY,
        "renewal_gap": counted.worst_gap(),
        "renewals": sum(len(t) for t in counted.at.values()),
        "loop_stall": late[0],
    }


def child(args: argparse.Namespace) -> None:
    path = Path(args.dir) / f"child-{os.getpid()}.db"
    result = asyncio.run(drive(path, args.runs, args.steps, args.neighbour))
    print(json.dumps(result))


def spawn(src: Path | None, *argv: str, strace_to: Path | None = None) -> str:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", *argv]
    if strace_to is not None:
        trace = ["strace", "-f", "-c", "-o", str(strace_to), "-e", "trace=" + ",".join(FSYNC_CLASS)]
        command = trace + command
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, env=env, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"child {argv} exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def measure(src: Path | None, folder: Path, runs: int, steps: int) -> dict[str, Any]:
    """The neighbour scenario, then the fsync slope (without the neighbour)."""
    common = ["--runs", str(runs), "--dir", str(folder)]
    row = json.loads(spawn(src, *common, "--steps", str(steps), "--neighbour").splitlines()[-1])
    calls = {}
    for s in (1, 3):
        out = folder / f"strace-{s}.txt"
        spawn(src, *common, "--steps", str(s), strace_to=out)
        calls[s] = sum(parse_strace_summary(out.read_text()).values())
    row["fsyncs_per_step"] = (calls[3] - calls[1]) / (runs * 2)
    return row


def unpacked(rev: str, folder: Path) -> Path:
    """The package's ``src`` as it was at ``rev``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder / "src"


def main(args: argparse.Namespace) -> None:
    os.environ["NEIGHBOUR_SECONDS"] = str(args.neighbour_seconds)  # for the children
    if shutil.which("strace") is None:
        print("skipped: strace is not installed")
        return
    runs, steps = (64, 4) if args.quick else (args.runs, args.steps)
    folder = Path(tempfile.mkdtemp(prefix="asiento-loop-", dir=args.dir))
    try:
        rows: dict[str, dict[str, Any]] = {}
        if args.before:
            rows[f"before ({args.before})"] = measure(
                unpacked(args.before, folder), folder, runs, steps
            )
        rows["this checkout"] = measure(None, folder, runs, steps)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"== one Worker(concurrency={runs}) on SQLite (full), {steps} model+tool steps a run,")
    print(f"   a {LATENCY * 1000:.0f} ms model, leases of {TTL:g} s renewed every {TTL / 3:g} s,")
    print(
        f"   and a neighbour whose sync tool does {args.neighbour_seconds:g} s of pure-Python work"
    )
    cells = ("closed", "of ideal", "worst renewal delay", "loop stall", "fsyncs/step")
    print(f"{'':>22} {cells[0]:>7} {cells[1]:>9} {cells[2]:>20} {cells[3]:>11} {cells[4]:>12}")
    for name, row in rows.items():
        delay = row["renewal_gap"] - TTL / 3
        print(
            f"{name:>22} {row['closed']:>7} {row['ideal'] / row['wall']:>9.2f}"
            f" {delay * 1000:>17.0f} ms {row['loop_stall'] * 1000:>8.0f} ms"
            f" {row['fsyncs_per_step']:>12.3f}"
        )
    if len(rows) == 2:
        before, after = rows.values()
        late = [max(1e-9, r["renewal_gap"] - TTL / 3) for r in (before, after)]
        syncs = [max(1e-9, r["fsyncs_per_step"]) for r in (before, after)]
        print(
            f"after / before: throughput {before['wall'] / after['wall']:.2f}x, worst renewal"
            f" delay {late[1] / late[0]:.2f}x, fsyncs per step {syncs[1] / syncs[0]:.2f}x"
        )
    print(
        f"a lease lapses when its renewal is {TTL * 2 / 3:g} s late; target: under {TTL / 10:g} s"
    )


def parse_args(argv: Any = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=256, help="concurrency K (256)")
    parser.add_argument("--steps", type=int, default=8, help="model+tool steps a run (8)")
    parser.add_argument("--quick", action="store_true", help="K=64, 4 steps")
    parser.add_argument("--before", help="a git revision to measure too, in the same run")
    parser.add_argument("--dir", help="where the SQLite files go (a temporary directory)")
    parser.add_argument(
        "--neighbour-seconds", type=float, default=NEIGHBOUR_SECONDS, help="its CPU work (4)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--neighbour", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.child:
        child(parsed)
    else:
        main(parsed)
