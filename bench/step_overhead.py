"""What a durable model+tool step costs: asiento against the raw SQLite floor.

    python bench/step_overhead.py            # the fuller run (under 3 minutes)
    python bench/step_overhead.py --quick    # small N, few repetitions (under 20 s)
    python bench/step_overhead.py --telemetry [--quick] [--before REV]   # traces off vs on

Everything is measured in one run, on real SQLite files in a temporary
directory (``--dir`` to choose it; fsync costs nothing on tmpfs):

1. asiento: an ``Agent`` with one trivial non-idempotent tool (``async def``),
   driven by ``ScriptedGateway`` through N model+tool steps and a final answer. Durable
   commits are counted twice, independently: by a delegating ``Checkpointer``
   that counts ``append()`` calls, and from the commit frames in the WAL file.
   Bytes per record and per step come from the journal table and the file size.
2. The floor: a raw ``sqlite3`` loop with the same PRAGMAs (WAL, synchronous
   FULL / NORMAL) doing as many commits, each one INSERT of a payload of the
   same size in ``BEGIN IMMEDIATE ... COMMIT``. Beside it, two more floors: asiento's
   own statements run raw on the same records (``same_sql``), and the least Python a
   durable step needs, written by hand on those statements (``least_python``).
3. fsync-class syscalls per step, counted by ``strace -c`` in child processes.
4. Scaling with the length of the run, resuming a long run, answering a closed one.

Section 2 also times the same tool written as a plain ``def``: asiento runs a
sync tool on a thread (it may block, and the event loop must stay free to renew
the run's lease), and the hand-off between threads costs what the OS makes it cost.

``--telemetry`` measures only what tracing costs a step (issue 24), in child processes
taking turns: the same run with ``telemetry`` off, on (the SDK's ``TracerProvider``, a
``BatchSpanProcessor`` to an exporter that discards), and "before", this bench on the
package as it was at REV (``git archive REV src`` on PYTHONPATH; 6769d5a, the commit
before tracing, unless ``--before`` says otherwise, ``--before none`` for no such row).

It prints figures and ratios, never pass/fail on time. The targets (DESIGN.md,
"Cost"): at most 2 commits per model+tool step, and time per step within 1.5x
the raw floor.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import itertools
import json
import os
import shutil
import sqlite3
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asiento import (
    Agent,
    FinalStep,
    Gateway,
    ModelRequest,
    ModelResponse,
    RunStats,
    Session,
    SqliteCheckpointer,
    ToolCall,
    ToolStep,
    Usage,
    tool,
)
from asiento._canonical import FingerprintChain, compact_encoder, fingerprint
from asiento.journal import sqlite as sqlite_store
from asiento.testing import ScriptedGateway

RUN_ID = "bench"
TASK = "note every number you are given"
TARGET_COMMITS = 2
TARGET_RATIO = 1.5
SYNC = {"full": "FULL", "process": "NORMAL"}
WRITES = ("append", "set_status", "acquire", "renew", "release")
CLOSED_REPS = 21
FSYNC_CLASS = ("fsync", "fdatasync", "sync_file_range", "msync")
RECORD_BYTES = (
    "length(CAST(payload AS BLOB)) + length(CAST(run_id AS BLOB))"
    " + length(CAST(step_id AS BLOB)) + length(CAST(phase AS BLOB))"
    " + coalesce(length(CAST(decision AS BLOB)), 0)"
)


@dataclass(frozen=True)
class Config:
    """How much to measure."""

    steps: int  # N for the per-step tables and the strace children
    reps: int  # repetitions of the per-step measurement (median)
    scale: tuple[int, ...]  # run lengths for the scaling table
    scale_reps: int
    resume_steps: int
    resume_reps: int
    wal_steps: int  # small enough that no WAL checkpoint resets the file mid-run


QUICK = Config(
    steps=40, reps=3, scale=(10, 100, 300), scale_reps=1, resume_steps=1000, resume_reps=2,
    wal_steps=20,
)  # fmt: skip
FULL = Config(
    steps=300, reps=7, scale=(10, 100, 1000), scale_reps=5, resume_steps=1000, resume_reps=5,
    wal_steps=40,
)  # fmt: skip


# -- the workload ------------------------------------------------------------------


@tool(idempotent=False)
async def note(n: int) -> str:
    """Record a number: a trivial effect that must not be repeated."""
    return f"noted {n}"


@tool(idempotent=False, name="note")
def note_sync(n: int) -> str:
    """Record a number: the same tool as a plain function (asiento runs it on a thread)."""
    return f"noted {n}"


TOOLS = {"async": note, "sync": note_sync}


def script(steps: int) -> Callable[[ModelRequest], ModelResponse]:
    """One tool call per turn until ``steps`` turns are done, then a text answer."""

    def answer(request: ModelRequest) -> ModelResponse:
        done = (len(request.messages) - 1) // 2  # the task, then (assistant, tool) per step
        usage = Usage(input_tokens=120 + 30 * done, output_tokens=18)
        if done < steps:
            call = ToolCall(name="note", arguments={"n": done + 1})
            return ModelResponse(tool_calls=[call], usage=usage, model="scripted")
        return ModelResponse(text=f"noted {steps} numbers", usage=usage, model="scripted")

    return answer


class ForgetfulGateway:
    """The same script as ``ScriptedGateway`` but no call log: a control for what the log costs."""

    def __init__(self, answer: Callable[[ModelRequest], ModelResponse]) -> None:
        self.answer, self.count = answer, 0

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        self.count += 1
        return self.answer(request)


def scripted(steps: int) -> Gateway:
    return ScriptedGateway(script(steps))


def forgetful(steps: int) -> Gateway:
    return ForgetfulGateway(script(steps))


@contextmanager
def gc_timer() -> Iterator[list[float]]:
    """Time spent in the cyclic garbage collector while the block runs (one-item list)."""
    spent, started = [0.0], [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - started[0]

    gc.callbacks.append(callback)
    try:
        yield spent
    finally:
        gc.callbacks.remove(callback)


class CountingStore:
    """A real ``Checkpointer`` behind a wrapper that counts every call and the commits.

    It delegates whatever the protocol holds (so it follows the protocol as it
    grows); the methods in ``WRITES`` are write transactions, each one commit.
    """

    def __init__(self, inner: SqliteCheckpointer) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self.commit_seconds = 0.0

    @property
    def commits(self) -> int:
        return sum(self.calls[name] for name in WRITES)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if not inspect.iscoroutinefunction(method):
            return method

        async def counted(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await method(*args, **kwargs)
            finally:
                self.calls[name] += 1
                if name in WRITES:
                    self.commit_seconds += time.perf_counter() - start

        setattr(self, name, counted)
        return counted


@dataclass
class Trace:
    """What was true each time a tool step was yielded (so: durable)."""

    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # process_time: CPU, not waiting for fsync
    commits: list[int] = field(default_factory=list)
    commit_seconds: list[float] = field(default_factory=list)
    wal: list[tuple[int, int]] = field(default_factory=list)  # (commit frames, frames)
    wal_base: tuple[int, int] = (0, 0)
    total_commits: int = 0
    calls: Counter[str] = field(default_factory=Counter)
    gc_seconds: float = 0.0

    def per_step(self) -> float:
        """Seconds per step, from the first yielded tool step to the last."""
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1)

    def cpu_per_step(self) -> float:
        return (self.cpu[-1] - self.cpu[0]) / (len(self.cpu) - 1)

    def commit_per_step(self) -> float:
        return (self.commit_seconds[-1] - self.commit_seconds[0]) / (len(self.times) - 1)

    def commit_counts(self) -> list[int]:
        """Commits between one durable tool step and the next (steps 2..N)."""
        return _deltas(self.commits)

    def window(self, first: bool, width: int, *, cpu: bool = False) -> float:
        """Seconds per step over the first (or last) ``width`` steps of the run."""
        t = self.cpu if cpu else self.times
        return (t[width] - t[0]) / width if first else (t[-1] - t[-1 - width]) / width


async def drive(
    path: Path,
    durability: str,
    steps: int,
    *,
    stop_after: int = 0,
    watch_wal: bool = False,
    gateway: Callable[[int], Gateway] = scripted,
    tool_kind: str = "async",
    telemetry: Any = None,
) -> Trace:
    """One run of ``steps`` model+tool steps and a final answer (or stop after some).

    ``telemetry``: the ``Agent(telemetry=...)`` of a traced run; None passes nothing
    (a package from before tracing has no such argument)."""
    store = CountingStore(SqliteCheckpointer(path, durability=durability))  # type: ignore[arg-type]
    trace = Trace(wal_base=wal_frames(path) if watch_wal else (0, 0))
    tools = [TOOLS[tool_kind]]
    traced = {} if telemetry is None else {"telemetry": telemetry}
    agent = Agent(instructions="You note numbers.", tools=tools, max_turns=steps + 1, **traced)
    session = Session(RUN_ID, gateway(steps), store)
    try:
        with gc_timer() as spent:
            async with aclosing(agent.run(TASK, session=session)) as run:  # type: ignore[type-var]
                async for step in run:
                    if isinstance(step, ToolStep):
                        trace.times.append(time.perf_counter())
                        trace.cpu.append(time.process_time())
                        trace.commits.append(store.commits)
                        trace.commit_seconds.append(store.commit_seconds)
                        if watch_wal:
                            trace.wal.append(wal_frames(path))
                        if stop_after and len(trace.times) >= stop_after:
                            break
    finally:
        await store.close()
    trace.total_commits, trace.gc_seconds = store.commits, spent[0]
    trace.calls = store.calls
    return trace


SCALE_RUNS = (("full", "full", scripted), ("process", "process", scripted),
              ("forgetful", "process", forgetful))  # fmt: skip
WITHIN_RUN = (
    ("full", "wall, full durability", False),
    ("process", "wall, process durability", False),
    ("process", "cpu, process durability", True),
    ("forgetful", "cpu, process, no call log", True),
)


# -- the floor ---------------------------------------------------------------------


def raw_loop(
    path: Path, synchronous: str, commits: int, payload_bytes: int, *, wal: list[int] | None = None
) -> float:
    """Seconds per commit of a bare loop: one INSERT per BEGIN IMMEDIATE ... COMMIT.

    With ``wal``, the WAL's (commit frames, frames) added by the loop are put in it.
    """
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={synchronous}")
        db.execute("CREATE TABLE IF NOT EXISTS floor (id INTEGER PRIMARY KEY, payload TEXT)")
        payload = '{"v":"' + "x" * max(payload_bytes - 8, 0) + '"}'
        base = wal_frames(path)
        start = time.perf_counter()
        for _ in range(commits):
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO floor (payload) VALUES (?)", (payload,))
            db.execute("COMMIT")
        elapsed = time.perf_counter() - start
        if wal is not None:
            wal.extend(a - b for a, b in zip(wal_frames(path), base, strict=True))
    finally:
        db.close()
    return elapsed / max(commits, 1)


# The statements SqliteCheckpointer.append runs for a leased run whose status stays
# (the lease checked and extended with the run index's counters, then the records),
# taken from the store itself so that the two cannot drift apart.
SAME_SQL_UPDATE = sqlite_store._APPEND_LEASED_SAME_STATUS
SAME_SQL_INSERT = sqlite_store._INSERT_RECORD


async def empty_journal(path: Path) -> Path:
    """A new asiento journal with no run in it (the current schema, made by asiento)."""
    await SqliteCheckpointer(path).close()
    return path


def same_sql_loop(source: Path, target: Path, synchronous: str, steps: int) -> float:
    """Seconds per step of a bare loop running asiento's own statements, raw.

    The records of the first ``steps`` tool steps of the run in ``source`` are
    written again into ``target`` (an ``empty_journal``), batched as the agent
    batches them (model result + intent + submitted, then the tool result), each
    batch in BEGIN IMMEDIATE ... COMMIT with the lease check that updates the run
    index. What asiento adds on top of this is Python: the loop, encoding, checks.
    """
    db = sqlite3.connect(target, isolation_level=None)
    try:
        db.execute(f"PRAGMA synchronous={synchronous}")
        recorded = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
        try:
            sql = (
                "SELECT run_id, step_id, phase, decision, payload, created_at FROM journal"
                " WHERE run_id = ? AND step_id != 'final' ORDER BY rowid"
            )
            rows = recorded.execute(sql, (RUN_ID,)).fetchall()
        finally:
            recorded.close()
        batches, batch = [], []
        for row in rows:
            batch.append(row)
            if row[2] == "submitted" or (row[2] == "result" and "." in row[1]):
                batches.append(batch)
                batch = []
        batches = batches[: 2 * steps]
        _leased_run(db)
        start = time.perf_counter()
        for batch in batches:
            db.execute("BEGIN IMMEDIATE")
            args = (len(batch), time.time(), 1, 1, 150, 18, 0.0, 0, 0, RUN_ID, 1, "me")
            if db.execute(SAME_SQL_UPDATE, args).rowcount != 1:
                raise RuntimeError("the same-SQL loop lost its own lease")
            db.executemany(SAME_SQL_INSERT, batch)
            db.execute("COMMIT")
        elapsed = time.perf_counter() - start
    finally:
        db.close()
    return elapsed / max(len(batches) // 2, 1)


def _leased_run(db: sqlite3.Connection) -> None:
    """The run's row in the run index, leased to "me" with fence 1, as the loops expect."""
    now = time.time()
    db.execute(
        "INSERT INTO runs (run_id, status, events, created_at, updated_at, lease_owner,"
        " lease_expires, lease_ttl, fence) VALUES (?, 'running', 0, ?, ?, 'me', ?, 30, 1)",
        (RUN_ID, now, now, now + 3600),
    )


async def _least_gateway(messages: list[dict[str, Any]], key: str) -> dict[str, Any]:
    done = (len(messages) - 1) // 2
    call = {"id": "", "name": "note", "arguments": {"n": done + 1}}
    return {"text": "", "tool_calls": [call], "usage": [120 + 30 * done, 18], "model": "scripted"}


async def _least_tool(n: int) -> str:
    return f"noted {n}"


async def least_python_loop(target: Path, synchronous: str, steps: int) -> float:
    """Seconds per step of the least Python a durable model+tool step needs, by hand.

    What asiento's design requires and nothing else: the conversation as plain
    dicts with its chained fingerprint (asiento's own JSON and hash helpers), the
    idempotency key, an awaited model call, the three records of the first commit
    (model result, intent with the arguments' fingerprint, submitted) encoded as
    JSON, asiento's statements, the awaited tool, its result in the second
    commit. No validation, no typed events, no replay table, no policy: a bound
    for any Python implementation of the design, not something asiento could ship.
    """
    encode = compact_encoder(sort_keys=False)
    db = sqlite3.connect(target, isolation_level=None)
    try:
        db.execute(f"PRAGMA synchronous={synchronous}")
        _leased_run(db)
        messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
        chain = FingerprintChain(messages[0])
        start = time.perf_counter()
        for turn in range(1, steps + 1):
            step, fp = f"m{turn}", chain.value[:32]
            answer = await _least_gateway(messages, f"{RUN_ID}:{step}:{fp}")
            call = answer["tool_calls"][0]
            call["id"] = tool_step = f"{step}.t1"
            args = call["arguments"]
            now = time.time()
            first = [
                (RUN_ID, step, "result", None, encode({"fp": fp, "response": answer}), now),
                (RUN_ID, tool_step, "intent", "allow",
                 encode({"tool": "note", "args": args, "fp": fingerprint(args)[:32]}), now),
                (RUN_ID, tool_step, "submitted", None, "{}", now),
            ]  # fmt: skip
            _least_commit(db, first, (3, now, 1, 1, answer["usage"][0], 18))
            said = {"role": "assistant", "content": "", "tool_calls": answer["tool_calls"]}
            messages.append(said)
            chain.add(said)
            value = await _least_tool(**args)
            now = time.time()
            result = [
                (RUN_ID, tool_step, "result", None, encode({"status": "ok", "value": value}), now)
            ]
            _least_commit(db, result, (1, now, 0, 0, 0, 0))
            told = {"role": "tool", "content": value, "tool_call_id": tool_step, "name": "note"}
            messages.append(told)
            chain.add(told)
        elapsed = time.perf_counter() - start
    finally:
        db.close()
    return elapsed / max(steps, 1)


def _least_commit(db: sqlite3.Connection, rows: list[Any], counts: tuple[Any, ...]) -> None:
    db.execute("BEGIN IMMEDIATE")
    if db.execute(SAME_SQL_UPDATE, (*counts, 0.0, 0, 0, RUN_ID, 1, "me")).rowcount != 1:
        raise RuntimeError("the least-Python loop lost its own lease")
    db.executemany(SAME_SQL_INSERT, rows)
    db.execute("COMMIT")


# -- reading the files -------------------------------------------------------------


def wal_frames(db_path: Path) -> tuple[int, int]:
    """(commit frames, frames) of the WAL's current generation, read from the file itself."""
    wal = db_path.with_name(db_path.name + "-wal")
    try:
        data = wal.read_bytes()
    except FileNotFoundError:
        return 0, 0
    if len(data) < 32:
        return 0, 0
    page_size, salts = struct.unpack(">I", data[8:12])[0], data[16:24]
    size = 24 + page_size
    commits = committed_frames = 0
    for frames, offset in enumerate(range(32, len(data) - size + 1, size), 1):
        if data[offset + 8 : offset + 16] != salts:
            break  # a frame of an older generation: the current one ends here
        if struct.unpack(">I", data[offset + 4 : offset + 8])[0]:  # db size: a commit frame
            commits, committed_frames = commits + 1, frames
    return commits, committed_frames


@dataclass(frozen=True)
class Bytes:
    records: int
    record_bytes: int
    step_records: int  # records of m1..mN and their tool steps
    step_bytes: int
    file_bytes: int


def journal_bytes(path: Path, steps: int) -> Bytes:
    """Record counts and bytes (payload + ids) from the journal table, and the file size."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        total = db.execute(f"SELECT count(*), sum({RECORD_BYTES}) FROM journal").fetchone()
        closing = ("final", f"m{steps + 1}")
        sql = f"SELECT count(*), sum({RECORD_BYTES}) FROM journal WHERE step_id NOT IN (?, ?)"
        step = db.execute(sql, closing).fetchone()
    finally:
        db.close()
    files = [path, path.with_name(path.name + "-wal")]
    size = sum(f.stat().st_size for f in files if f.exists())
    return Bytes(total[0], total[1] or 0, step[0], step[1] or 0, size)


def filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` lives on (from /proc/mounts), or '?'."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "?"
    where, best, kind = str(path.resolve()), "", "?"
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1]
        inside = where == mount or where.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, kind = mount, parts[2]
    return kind


# -- strace ------------------------------------------------------------------------


def traced_syncs(directory: Path, kind: str, steps: int, extra: Sequence[str]) -> dict[str, int]:
    """fsync-class syscalls made by a child process doing ``kind`` for ``steps`` steps."""
    out = directory / f"strace-{kind}-{steps}.txt"
    command = [
        "strace", "-f", "-c", "-o", str(out), "-e", "trace=" + ",".join(FSYNC_CLASS),
        sys.executable, str(Path(__file__).resolve()), "--child", kind,
        "--steps", str(steps), "--dir", str(directory), *extra,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{kind} under strace exited {done.returncode}: {' | '.join(tail)}")
    return parse_strace_summary(out.read_text())


def parse_strace_summary(text: str) -> dict[str, int]:
    """Calls per syscall from ``strace -c`` output (columns: ... calls [errors] syscall)."""
    calls: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[-1] in FSYNC_CLASS and parts[3].isdigit():
            calls[parts[-1]] = calls.get(parts[-1], 0) + int(parts[3])
    return calls


def fsyncs_per_step(directory: Path, kind: str, steps: int, extra: Sequence[str]) -> str:
    """(calls at N - calls at 0) / N, so opening the file and the closing commit cancel out."""
    base = traced_syncs(directory, kind, 0, extra)
    run = traced_syncs(directory, kind, steps, extra)
    names = sorted(set(base) | set(run))
    per = {n: (run.get(n, 0) - base.get(n, 0)) / steps for n in names}
    total = sum(per.values())
    detail = "+".join(f"{n}:{v:.2f}" for n, v in per.items() if v) or "none"
    return f"{total:.2f} {detail}"


# -- formatting --------------------------------------------------------------------


def us(seconds: float) -> str:
    value = seconds * 1e6
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def count_text(counts: Sequence[int]) -> str:
    """A per-step count: the number if every step had the same, else mean and range."""
    if not counts:
        return "-"
    if min(counts) == max(counts):
        return str(counts[0])
    return f"{statistics.mean(counts):.2f}[{min(counts)}..{max(counts)}]"


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print an aligned table: first column left, the others right; cells have no spaces."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n== {title}")
    for row in [header, *rows]:
        cells = [
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())


def _deltas(values: Sequence[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(values)]


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


# -- the sections ------------------------------------------------------------------


class Bench:
    """One run of the whole benchmark in one temporary directory."""

    def __init__(self, cfg: Config, directory: Path) -> None:
        self.cfg, self.dir = cfg, directory
        self.serial = 0
        self.per_commit_payload = 0
        self.commits_per_step = TARGET_COMMITS
        self.full_calls: Counter[str] = Counter()

    def fresh(self, stem: str) -> Path:
        self.serial += 1
        return self.dir / f"{stem}-{self.serial}.db"

    # 1 --------------------------------------------------------------------------

    async def commits_and_bytes(self) -> None:
        """Section 1: commits counted by the wrapper and by the WAL, bytes per record/step."""
        n, rows = self.cfg.steps, []
        for durability in ("full", "process"):
            path = self.fresh(f"count-{durability}")
            trace = await drive(path, durability, n)
            size = journal_bytes(path, n)
            wal_path = self.fresh(f"wal-{durability}")
            probe = await drive(wal_path, durability, self.cfg.wal_steps, watch_wal=True)
            rows.append(self._bytes_row(durability, n, trace, probe, size))
            if durability == "full":
                self.full_calls = trace.calls
                counts = trace.commit_counts()
                self.commits_per_step = max(round(statistics.mean(counts)), 1)
                self.per_commit_payload = round(size.step_bytes / (self.commits_per_step * n))
        rows += [self._raw_bytes_row(durability) for durability in ("full", "process")]
        header = [
            "row", "commits/step", "wal_commits/step", "wal_frames/commit", "records/step",
            "B/record", "B/step", "file_B/step", "commits_total", "commits_per_run",
        ]  # fmt: skip
        title = (
            f"Commits and bytes per model+tool step (N={n}; WAL columns read from the -wal file"
            f" of a {self.cfg.wal_steps}-step run; B = payload+ids)"
        )
        table(title, header, rows)
        calls = " ".join(f"{k}:{v}" for k, v in sorted(self.full_calls.items()))
        print(
            "   commits/step: commits between one durable tool step and the next, counted by a"
            " delegating Checkpointer;\n   wal_*: the same read from the commit frames of the"
            " -wal file (wal_frames/commit = pages written per commit);\n"
            "   commits_per_run = commits_total - N x commits/step (lease, closing commit, ...);"
            f" store calls of the full run: {calls}.\n"
            f"   target: <= {TARGET_COMMITS} commits per model+tool step."
        )

    def _bytes_row(
        self, durability: str, n: int, trace: Trace, probe: Trace, size: Bytes
    ) -> list[str]:
        wal_counts = _deltas([c for c, _ in probe.wal])
        wal_text = count_text(wal_counts) if min(wal_counts, default=0) >= 0 else "reset"
        commits = probe.wal[-1][0] - probe.wal[0][0]
        frames = (probe.wal[-1][1] - probe.wal[0][1]) / max(commits, 1)
        per_step = statistics.mean(trace.commit_counts())
        return [
            f"asiento-{durability}",
            count_text(trace.commit_counts()),
            wal_text,
            f"{frames:.1f}",
            f"{size.step_records / n:.1f}",
            f"{size.record_bytes / size.records:.0f}",
            f"{size.step_bytes / n:.0f}",
            f"{size.file_bytes / n:.0f}",
            str(trace.total_commits),
            f"{trace.total_commits - per_step * n:g}",
        ]

    def _raw_bytes_row(self, durability: str) -> list[str]:
        k, n = self.commits_per_step, self.cfg.wal_steps
        wal: list[int] = []
        raw_loop(self.fresh("raw-wal"), SYNC[durability], n * k, self.per_commit_payload, wal=wal)
        per_step = f"{wal[0] / n:.0f}" if wal[0] % n == 0 else f"{wal[0] / n:.2f}"
        payload = str(self.per_commit_payload)
        return [f"raw-{durability}", str(k), per_step, f"{wal[1] / max(wal[0], 1):.1f}",
                str(k), payload, str(k * self.per_commit_payload), "-", "-", "-"]  # fmt: skip

    # 2 --------------------------------------------------------------------------

    async def time_vs_floor(self) -> None:
        """Section 2: median time per step against the raw loop, interleaved run by run."""
        n, k = self.cfg.steps, self.commits_per_step
        samples: dict[str, list[float]] = {}
        for _ in range(self.cfg.reps):
            for durability in ("full", "process"):
                for kind in TOOLS:
                    path = self.fresh(f"time-{durability}-{kind}")
                    trace = await drive(path, durability, n, tool_kind=kind)
                    if kind == "async":
                        same = same_sql_loop(
                            path, await empty_journal(self.fresh("same")), SYNC[durability], n
                        )
                        samples.setdefault(f"s-{durability}", []).append(same)
                        least = await least_python_loop(
                            await empty_journal(self.fresh("least")), SYNC[durability], n
                        )
                        samples.setdefault(f"l-{durability}", []).append(least)
                    samples.setdefault(f"a-{durability}-{kind}", []).append(trace.per_step())
                    samples.setdefault(f"c-{durability}-{kind}", []).append(trace.commit_per_step())
                raw = raw_loop(self.fresh("raw"), SYNC[durability], n * k, self.per_commit_payload)
                samples.setdefault(f"r-{durability}", []).append(raw * k)
        rows = [
            self._time_row(durability, kind, samples)
            for kind in TOOLS
            for durability in ("full", "process")
        ]
        for durability in ("full", "process"):
            same, floor = _median(samples[f"s-{durability}"]), _median(samples[f"r-{durability}"])
            least = _median(samples[f"l-{durability}"])
            rows.append([f"same_sql-{durability}", us(same), "-", "-", us(floor),
                         f"{same / floor:.2f}x", "1.00x", f"{same / least:.2f}x"])  # fmt: skip
            rows.append([f"least_python-{durability}", us(least), "-", "-", us(floor),
                         f"{least / floor:.2f}x", f"{least / same:.2f}x", "1.00x"])  # fmt: skip
        header = ["row", "µs/step", "µs_in_append", "µs_rest", "raw_floor_µs/step", "ratio",
                  "vs_same_sql", "vs_least_python"]  # fmt: skip
        title = (
            f"Time per model+tool step vs the raw SQLite floor (N={n}, median of {self.cfg.reps};"
            f" floor = {k} commits of one {self.per_commit_payload}-byte INSERT per step)"
        )
        table(title, header, rows)
        hand_off = {
            d: _median(samples[f"a-{d}-sync"]) - _median(samples[f"a-{d}-async"])
            for d in ("full", "process")
        }
        print(
            "   raw floor: a bare sqlite3 loop, WAL, synchronous FULL (full) / NORMAL (process).\n"
            "   µs_in_append: inside Checkpointer.append (SQLite, the fsync, encoding the rows);"
            " µs_rest: the agent loop.\n"
            "   asiento-*: the tool is `async def note`; sync_tool-*: the same tool as a plain"
            " `def`, run on a thread.\n"
            "   same_sql-*: a bare loop running asiento's own statements on the same records"
            " (lease check + run index UPDATE,\n   then the batch's INSERTs, per commit): what"
            " SQLite costs for what asiento writes; vs_same_sql is what Python adds.\n"
            "   least_python-*: the least Python a durable step needs, by hand (plain dicts, the"
            " chained fingerprint, the\n   JSON records, awaited model and tool, the same"
            " statements; no checks, events or replay): a bound for any\n   Python implementation"
            " of the design on this disk; vs_least_python is what asiento adds beyond it.\n"
            f"   the thread hand-off of a sync tool, sync_tool - asiento: {us(hand_off['full'])}"
            f" µs/step (full), {us(hand_off['process'])} µs/step (process).\n"
            f"   target: ratio < {TARGET_RATIO}x the raw floor (a figure, not a verdict)."
        )

    @staticmethod
    def _time_row(durability: str, kind: str, samples: dict[str, list[float]]) -> list[str]:
        mine = _median(samples[f"a-{durability}-{kind}"])
        floor = _median(samples[f"r-{durability}"])
        in_append = _median(samples[f"c-{durability}-{kind}"])
        same = _median(samples[f"s-{durability}"])
        least = _median(samples[f"l-{durability}"])
        name = "asiento" if kind == "async" else "sync_tool"
        return [f"{name}-{durability}", us(mine), us(in_append), us(mine - in_append),
                us(floor), f"{mine / floor:.2f}x", f"{mine / same:.2f}x",
                f"{mine / least:.2f}x"]  # fmt: skip

    # 3 --------------------------------------------------------------------------

    async def fsyncs(self) -> None:
        """Section 3: fsync-class syscalls per step, under strace, in child processes."""
        n = self.cfg.steps
        title = (
            f"fsync-class syscalls per step (strace -f -c; (calls at N - calls at 0) / N, N={n})"
        )
        if shutil.which("strace") is None:
            print(f"\n== {title}\n   skipped: strace is not installed")
            return
        extra = [
            "--per-step",
            str(self.commits_per_step),
            "--payload",
            str(self.per_commit_payload),
        ]
        rows = []
        try:
            for kind in ("asiento-full", "raw-full", "asiento-process", "raw-process"):
                total, detail = fsyncs_per_step(self.dir, kind, n, extra).split(" ", 1)
                rows.append([kind, total, detail])
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            print(f"\n== {title}\n   skipped: {exc}")
            return
        table(title, ["row", "calls/step", "by_syscall"], rows)
        print(
            "   raw-process = synchronous NORMAL. Fractions come from WAL checkpoints"
            " (every ~1000 pages written)."
        )

    # 4 --------------------------------------------------------------------------

    async def scaling(self) -> None:
        """Section 4: time and bytes per step at growing run lengths."""
        fixed = await self._fixed_file_bytes()
        rows, longest = [], {}
        for n in self.cfg.scale:
            traces: dict[str, list[Trace]] = {"full": [], "process": [], "forgetful": []}
            for _ in range(self.cfg.scale_reps):
                for kind, durability, gateway in SCALE_RUNS:
                    path = self.fresh(f"scale{n}-{kind}")
                    traces[kind].append(await drive(path, durability, n, gateway=gateway))
                    if kind == "full":
                        size = journal_bytes(path, n)
            longest = {kind: ts[-1] for kind, ts in traces.items()}
            rows.append(self._scale_row(n, traces, size, fixed))
        header = ["N", "commits/step", "µs/step_full", "µs/step_process", "cpu_µs/step",
                  "cpu_µs/step_no_log", "gc_µs/step", "gc_µs/step_no_log", "B/step",
                  "file_B/step"]  # fmt: skip
        title = f"Scaling with the length of the run (median of {self.cfg.scale_reps})"
        table(title, header, rows)
        print(
            "   cpu_µs/step: CPU time per step (process durability), less disturbed by other"
            " load than wall time.\n   _no_log: the same script through a gateway that keeps"
            " no call log (ScriptedGateway.calls keeps every\n   request; each request holds a"
            " view of the conversation, not a copy). gc_µs/step: time in Python's cyclic GC.\n"
            "   file_B/step = (file - an empty run's file) / N."
        )
        self._within_run(longest)

    @staticmethod
    def _scale_row(n: int, traces: dict[str, list[Trace]], size: Bytes, fixed: int) -> list[str]:
        def med(kind: str, what: Callable[[Trace], float]) -> str:
            return us(_median([what(t) for t in traces[kind]]))

        return [
            str(n),
            count_text(traces["full"][-1].commit_counts()),
            med("full", Trace.per_step),
            med("process", Trace.per_step),
            med("process", Trace.cpu_per_step),
            med("forgetful", Trace.cpu_per_step),
            med("process", lambda t: t.gc_seconds / n),
            med("forgetful", lambda t: t.gc_seconds / n),
            f"{size.step_bytes / n:.0f}",
            f"{(size.file_bytes - fixed) / n:.0f}",
        ]

    def _within_run(self, longest: dict[str, Trace]) -> None:
        n = self.cfg.scale[-1]
        width = max(n // 10, 1)
        print(f"   within one {n}-step run, first {width} steps vs last {width}:")
        for kind, label, cpu in WITHIN_RUN:
            trace = longest[kind]
            early, late = trace.window(True, width, cpu=cpu), trace.window(False, width, cpu=cpu)
            print(
                f"     {label:<34} {us(early):>6} -> {us(late):>6} µs/step"
                f"  (late/early {late / early:.2f})"
            )

    async def _fixed_file_bytes(self) -> int:
        path = self.fresh("empty")
        await drive(path, "full", 0)
        return journal_bytes(path, 0).file_bytes

    # 5 --------------------------------------------------------------------------

    async def resume_and_closed(self) -> None:
        """Section 5: resuming a long interrupted run, answering a closed one."""
        n, reps = self.cfg.resume_steps, self.cfg.resume_reps
        source = self.fresh(f"interrupted{n}")
        await drive(source, "process", n, stop_after=n)
        loads, resumes, stats = [], [], RunStats()
        for _ in range(reps):
            loads.append(await self._time_load(self._copy(source)))
            seconds, stats = await self._time_resume(self._copy(source), n)
            resumes.append(seconds)
        load, resume = _median(loads), _median(resumes)
        print(f"\n== Resume an interrupted {n}-step run (median of {reps}; a fresh copy each time)")
        print(f"   load():          {ms(load):>7} ms  ({us(load / n)} µs per step)")
        print(f"   resume to close: {ms(resume):>7} ms  ({us(resume / n)} µs per replayed step)")
        print(
            f"   the resume paid model_calls={stats.model_calls} tool_calls={stats.tool_calls};"
            f" replayed model={stats.model_calls_replayed} tool={stats.tool_calls_replayed}"
        )
        await self._closed_table()

    def _copy(self, source: Path) -> Path:
        target = self.fresh(source.stem.rsplit("-", 1)[0] + "-copy")
        shutil.copyfile(source, target)
        return target

    async def _time_load(self, path: Path) -> float:
        store = SqliteCheckpointer(path)
        try:
            start = time.perf_counter()
            events = await store.load(RUN_ID)
            elapsed = time.perf_counter() - start
        finally:
            await store.close()
        if not events:
            raise RuntimeError(f"{path}: the interrupted run left no journal")
        return elapsed

    async def _time_resume(self, path: Path, n: int) -> tuple[float, RunStats]:
        store = CountingStore(SqliteCheckpointer(path))
        agent = Agent(instructions="You note numbers.", tools=[note], max_turns=n + 1)
        session = Session(RUN_ID, ScriptedGateway(script(n)), store)
        try:
            start = time.perf_counter()
            steps = [s async for s in agent.run(TASK, session=session)]
            elapsed = time.perf_counter() - start
        finally:
            await store.close()
        if not isinstance(steps[-1], FinalStep):
            raise RuntimeError(f"the resumed run ended with {steps[-1]!r}, not a FinalStep")
        return elapsed, session.stats

    async def _closed_table(self) -> None:
        rows = []
        for n in (10, self.cfg.resume_steps):
            path = self.fresh(f"closed{n}")
            await drive(path, "process", n)
            rows.append([str(n), *await self._answer_closed(path, n)])
        header = ["N", "first_µs", "µs_to_answer", "model_calls", "store_calls", "records_in_file"]
        title = (
            f"Answer a closed run (store open; run() timed; first call, then median of"
            f" {CLOSED_REPS})"
        )
        table(title, header, rows)

    async def _answer_closed(self, path: Path, n: int) -> list[str]:
        store = CountingStore(SqliteCheckpointer(path))
        agent = Agent(instructions="You note numbers.", tools=[note], max_turns=n + 1)
        gateway, times = ScriptedGateway(script(n)), []
        try:
            for _ in range(CLOSED_REPS + 1):
                start = time.perf_counter()
                steps = [s async for s in agent.run(TASK, session=Session(RUN_ID, gateway, store))]
                times.append(time.perf_counter() - start)
                if len(steps) != 1 or not isinstance(steps[0], FinalStep) or not steps[0].replayed:
                    raise RuntimeError(f"a closed run answered {steps!r}")
        finally:
            await store.close()
        calls = CLOSED_REPS + 1
        used = sorted((k, v) for k, v in store.calls.items() if k != "close")
        reads = "+".join(f"{k}:{v / calls:g}" for k, v in used) or "none"
        size = journal_bytes(path, n)
        return [us(times[0]), us(_median(times[1:])), str(len(gateway.calls)), reads,
                str(size.records)]  # fmt: skip


# -- 6: what tracing costs (--telemetry) -------------------------------------------

TRACING_BEFORE = "6769d5a"  # the last commit before tracing (issue 24)
TELEMETRY_MODES = ("off", "on")
TELEMETRY_TIMEOUT = 300.0  # seconds one child may take


class DiscardingExporter:
    """A ``SpanExporter`` that drops every span: what the SDK costs, not a backend."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


async def telemetry_child(mode: str, directory: Path, steps: int, reps: int) -> dict[str, Any]:
    """What one child measures: ``reps`` runs of ``steps`` steps at each durability.

    ``mode`` "off" passes no ``telemetry`` (so it runs on a package from before
    tracing too); "on" an SDK provider whose batch processor feeds a discarding exporter.
    """
    provider, exporter, telemetry = None, None, None
    if mode == "on":
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from asiento.telemetry.tracing import Telemetry

        exporter = DiscardingExporter()
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter))  # type: ignore[arg-type]
        telemetry = Telemetry(tracer_provider=provider)
    out: dict[str, Any] = {"commits": 0, "spans": 0}
    try:
        await drive(directory / f"warm-{mode}-{os.getpid()}.db", "process", 5, telemetry=telemetry)
        for durability in ("full", "process"):
            for rep in range(reps):
                path = directory / f"tel-{mode}-{durability}-{os.getpid()}-{rep}.db"
                exported = exporter.spans if exporter is not None else 0
                trace = await drive(path, durability, steps, telemetry=telemetry)
                if provider is not None and exporter is not None:
                    provider.force_flush()
                    out["spans"] = exporter.spans - exported  # the spans of one run
                out.setdefault(durability, []).append(trace.per_step())
                out.setdefault(f"cpu-{durability}", []).append(trace.cpu_per_step())
                out["commits"] = trace.total_commits
    finally:
        if provider is not None:
            provider.shutdown()
    return out


def _telemetry_spawn(
    src: Path | None, mode: str, directory: Path, steps: int, reps: int
) -> dict[str, Any]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    argv = [sys.executable, __file__, "--telemetry-child", mode, "--steps", str(steps)]
    argv += ["--reps", str(reps), "--dir", str(directory)]
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=TELEMETRY_TIMEOUT, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"telemetry child {mode} ({src or 'this checkout'}):\n{done.stderr}")
    out: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return out


def _unpacked(rev: str, folder: Path) -> Path:
    """The package's ``src`` as it was at ``rev`` (``git archive``), under ``folder``."""
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", rev, "src"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder / "src"


def telemetry_table(cfg: Config, directory: Path, before: str | None) -> None:
    """Section 6: ms per step with tracing off, on, and before tracing existed."""
    rounds, reps, steps = max(cfg.reps // 2, 1), 2, cfg.steps
    print(
        f"asiento step overhead, telemetry off vs on: python {sys.version.split()[0]},"
        f" SQLite {sqlite3.sqlite_version}, dir {directory} ({filesystem(directory)}),"
        f" {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}"
    )
    rows: dict[str, tuple[Path | None, str]] = {}
    if before:
        tree = directory / "before"
        tree.mkdir()
        rows[f"before-{before}"] = (_unpacked(before, tree), "off")
    rows |= {f"telemetry-{m}": (None, m) for m in TELEMETRY_MODES}
    got: dict[str, dict[str, list[float]]] = {name: {} for name in rows}
    commits, spans = {}, {}
    for _ in range(rounds):  # the rows take turns, so drifting load hits each alike
        for name, (src, mode) in rows.items():
            out = _telemetry_spawn(src, mode, directory, steps, reps)
            for key in ("full", "process", "cpu-full", "cpu-process"):
                got[name].setdefault(key, []).extend(out[key])
            commits[name], spans[name] = out["commits"], out["spans"]
    med = {name: {k: _median(v) for k, v in cells.items()} for name, cells in got.items()}
    off = med["telemetry-off"]
    header = ["row", "ms/step_full", "ms/step_process", "cpu_ms/step_process", "vs_off_full",
              "vs_off_process", "vs_off_cpu", "commits/run", "spans/run"]  # fmt: skip
    table_rows = []
    for name, cells in med.items():
        table_rows.append([
            name, f"{cells['full'] * 1e3:.3f}", f"{cells['process'] * 1e3:.3f}",
            f"{cells['cpu-process'] * 1e3:.3f}", f"{cells['full'] / off['full']:.2f}x",
            f"{cells['process'] / off['process']:.2f}x",
            f"{cells['cpu-process'] / off['cpu-process']:.2f}x", str(commits[name]),
            str(spans[name]),
        ])  # fmt: skip
    title = (
        f"What tracing costs a model+tool step (N={steps}, median of {rounds * reps} runs in"
        f" {rounds} rounds of child processes taking turns)"
    )
    table(title, header, table_rows)
    on = med["telemetry-on"]
    print(
        "   telemetry-off: Agent() with no telemetry; telemetry-on: Telemetry(tracer_provider=)"
        " an SDK TracerProvider,\n   BatchSpanProcessor to an exporter that discards"
        " (2 spans a step: chat, execute_tool; the pass's and run's spans once).\n"
        "   before-REV: this bench on the package at REV (git archive REV src on PYTHONPATH),"
        " telemetry off.\n"
        f"   on - off: {(on['full'] - off['full']) * 1e3:.3f} ms/step (full),"
        f" {(on['process'] - off['process']) * 1e3:.3f} ms/step (process),"
        f" {(on['cpu-process'] - off['cpu-process']) * 1e3:.3f} ms CPU/step (process).\n"
        "   commits/run: a traced run's first pass commits its trace context and pass mark"
        " before its first step (one more commit a pass)."
    )


async def main(cfg: Config, directory: Path, quick: bool) -> None:
    """Run every section in order and print the tables."""
    started = time.perf_counter()
    print(f"asiento step overhead ({'quick' if quick else 'full'} run)")
    print(
        f"python {sys.version.split()[0]}, SQLite {sqlite3.sqlite_version},"
        f" dir {directory} ({filesystem(directory)}), {os.cpu_count()} cpus,"
        f" load average {os.getloadavg()[0]:.2f}"
    )
    bench = Bench(cfg, directory)
    for section in (
        bench.commits_and_bytes,
        bench.time_vs_floor,
        bench.fsyncs,
        bench.scaling,
        bench.resume_and_closed,
    ):
        begun = time.perf_counter()
        await section()
        print(f"   ({time.perf_counter() - begun:.1f} s)")
    print(
        f"\ntotal bench time {time.perf_counter() - started:.1f} s;"
        f" load average now {os.getloadavg()[0]:.2f} (other processes disturb the times)"
    )


def child(args: argparse.Namespace) -> None:
    """The work one strace child does: an asiento run or the raw loop, on a fresh file."""
    directory, steps = Path(args.dir), args.steps
    path = directory / f"child-{args.child}-{steps}.db"
    for stale in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        stale.unlink(missing_ok=True)
    target, durability = args.child.split("-", 1)
    if target == "asiento":
        asyncio.run(drive(path, durability, steps))
    else:
        raw_loop(path, SYNC[durability], steps * args.per_step, args.payload)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small N, few repetitions (< 20 s)")
    parser.add_argument("--dir", help="where to put the SQLite files (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the files afterwards")
    parser.add_argument(
        "--telemetry", action="store_true", help="only: a step with tracing off vs on (section 6)"
    )
    parser.add_argument(
        "--before",
        default=TRACING_BEFORE,
        help=f"with --telemetry, also this git revision (default {TRACING_BEFORE}; 'none': not)",
    )
    parser.add_argument("--telemetry-child", choices=TELEMETRY_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--per-step", type=int, default=TARGET_COMMITS, help=argparse.SUPPRESS)
    parser.add_argument("--payload", type=int, default=100, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    if args.telemetry_child:
        out = asyncio.run(
            telemetry_child(args.telemetry_child, Path(args.dir), args.steps, args.reps)
        )
        print(json.dumps(out))
        return
    base = Path(args.dir) if args.dir else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="asiento-bench-", dir=base))
    try:
        cfg = QUICK if args.quick else FULL
        if args.telemetry:
            before = None if args.before.lower() in ("", "none") else args.before
            telemetry_table(cfg, directory, before)
        else:
            asyncio.run(main(cfg, directory, args.quick))
    finally:
        if args.keep:
            print(f"files kept in {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    run()
