"""Bad inputs: damaged files, tampered journals, results that are not JSON, huge payloads,
odd ids, and model answers that do not fit the provider's format.

What the other suites already cover is not repeated here: a journal file overwritten
with garbage, a damaged record, a newer schema (tests/journal/test_sqlite.py and
test_postgres.py), a changed task, instructions or tool set (tests/test_agent_replay.py),
NaN, sets, bad bytes and self-referencing lists as tool results (tests/test_agent.py),
odd ids at the journal level (asiento.testing.conformance), a 10 MB result and
one over the limit (tests/test_limits.py), and three unparseable chat answers at the
first model step (tests/providers/test_openai.py).

This file is also the child of the payload tests: ``python test_bad_inputs.py MODE DB SIZE``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import resource
import sqlite3
import struct
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from asiento import (
    Agent,
    ApprovalError,
    ApprovalStep,
    Checkpointer,
    FinalStep,
    JournalCorrupt,
    ModelResponse,
    NotAJournal,
    Phase,
    RecordTooLarge,
    ReplayDivergence,
    RunStatus,
    Session,
    SqliteCheckpointer,
    StepEvent,
    ToolCall,
    ToolStep,
    UsageError,
    approve,
    require_approval_for,
    tool,
)
from asiento.gateways import ModelResponseInvalid, OpenAIGateway
from asiento.journal.base import MAX_RECORD_BYTES
from asiento.testing import ScriptedGateway

RUN = "run-1"
CHILD_TIMEOUT = 120
MiB = 1024 * 1024


# -- 1. a damaged WAL file next to a good database -----------------------------------------

WAL_WRITER = """
import asyncio, os, sys
from asiento import Phase, SqliteCheckpointer, StepEvent

async def main(path, first, last):
    store = SqliteCheckpointer(path)
    for i in range(first, last):
        await store.append(*[
            StepEvent(run_id="run-1", step_id=f"s{i}", phase=p, payload={"i": i, "t": "x" * 300})
            for p in (Phase.INTENT, Phase.RESULT)
        ])
    os._exit(0)  # no close, as after a crash: the WAL keeps its frames

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""
IN_MAIN, IN_WAL = 5, 20  # batches checkpointed into the main file, then left in the WAL
WAL_HEADER, FRAME_HEADER = 32, 24


async def batches(store: SqliteCheckpointer, first: int, last: int) -> None:
    for i in range(first, last):
        await store.append(
            *[
                StepEvent(run_id=RUN, step_id=f"s{i}", phase=p, payload={"i": i, "t": "x" * 300})
                for p in (Phase.INTENT, Phase.RESULT)
            ]
        )


@pytest.fixture
async def wal_journal(tmp_path: Path) -> Path:
    """A journal with 5 batches in its main file and 20 more only in its -wal file."""
    db = tmp_path / "runs.db"
    store = SqliteCheckpointer(db)
    await batches(store, 0, IN_MAIN)
    await store.close()
    last = str(IN_MAIN + IN_WAL)
    subprocess.run(
        [sys.executable, "-c", WAL_WRITER, str(db), str(IN_MAIN), last],
        check=True,
        timeout=CHILD_TIMEOUT,
    )
    assert Path(f"{db}-wal").stat().st_size > 20 * 4096
    return db


def wal_frames(wal: bytes) -> tuple[int, list[int]]:
    """The page size and the offset of every whole frame of a WAL file."""
    page = struct.unpack(">I", wal[8:12])[0]
    count = (len(wal) - WAL_HEADER) // (FRAME_HEADER + page)
    return page, [WAL_HEADER + k * (FRAME_HEADER + page) for k in range(count)]


def wal_checksum(data: bytes, s0: int, s1: int, big_endian: bool) -> tuple[int, int]:
    """SQLite's WAL checksum (fileformat2.html#walformat), continued from (s0, s1)."""
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    for k in range(0, len(words), 2):
        s0 = (s0 + words[k] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[k + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def garble_pages_keep_checksums(wal: bytearray) -> None:
    """Random bytes in every frame but page 1's, with checksums SQLite will accept."""
    big = bool(struct.unpack(">I", wal[0:4])[0] & 1)
    page, frames = wal_frames(bytes(wal))
    rng = random.Random(7)
    s0, s1 = struct.unpack(">II", wal[24:32])
    for at in frames:
        if struct.unpack(">I", wal[at : at + 4])[0] != 1:
            body = at + FRAME_HEADER
            wal[body + 200 : body + page - 200] = rng.randbytes(page - 400)
        s0, s1 = wal_checksum(bytes(wal[at : at + 8]), s0, s1, big)
        s0, s1 = wal_checksum(bytes(wal[at + FRAME_HEADER : at + FRAME_HEADER + page]), s0, s1, big)
        wal[at + 16 : at + 24] = struct.pack(">II", s0, s1)


def flip_middle_frame(wal: bytearray) -> None:
    _, frames = wal_frames(bytes(wal))
    wal[frames[len(frames) // 2] + FRAME_HEADER + 100] ^= 0xFF


WAL_DAMAGE: dict[str, tuple[str, Callable[[bytearray], None], range]] = {
    # name: (file, damage, how many batches the journal may then hold)
    "wal-header": ("-wal", lambda b: b.__setitem__(slice(0, 32), bytes(32)), range(5, 6)),
    "wal-all-garbage": (
        "-wal",
        lambda b: b.__setitem__(slice(0, len(b)), random.Random(3).randbytes(len(b))),
        range(5, 6),
    ),
    "wal-frame-flipped": ("-wal", flip_middle_frame, range(5, 25)),
    "wal-truncated": ("-wal", lambda b: b.__delitem__(slice(len(b) // 2 + 7, None)), range(5, 25)),
    "shm-garbage": (
        "-shm",
        lambda b: b.__setitem__(slice(0, len(b)), random.Random(5).randbytes(len(b))),
        range(25, 26),
    ),
}


def damage(db: Path, suffix: str, how: Callable[[bytearray], None]) -> None:
    target = Path(f"{db}{suffix}")
    data = bytearray(target.read_bytes())
    how(data)
    target.write_bytes(bytes(data))


async def open_and_load(db: Path) -> list[StepEvent]:
    """What a resumed run does first: open the journal and read the run; then close it."""
    store = SqliteCheckpointer(db)
    try:
        return await store.load(RUN)
    finally:
        await store.close()


@pytest.mark.parametrize("name", list(WAL_DAMAGE))
async def test_damaged_wal_leaves_a_consistent_prefix(wal_journal: Path, name: str) -> None:
    """A damaged -wal/-shm: SQLite keeps a prefix of whole commits; never half a batch."""
    suffix, how, allowed = WAL_DAMAGE[name]
    inode = wal_journal.stat().st_ino
    damage(wal_journal, suffix, how)
    store = SqliteCheckpointer(wal_journal)
    try:
        events = await store.load(RUN)
        kept = len(events) // 2
        assert [(e.step_id, e.phase) for e in events] == [
            (f"s{i}", p) for i in range(kept) for p in (Phase.INTENT, Phase.RESULT)
        ], "whole batches, in order, from the first one"
        assert kept in allowed, f"{kept} batches kept"
        [info] = await store.runs()
        assert info.events == len(events), "the run index and the journal agree"
        assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        await batches(store, 100, 101)
        assert [e.step_id for e in await store.load(RUN)][-1] == "s100"
    finally:
        await store.close()
    assert wal_journal.stat().st_ino == inode, "the journal file was never replaced"


async def test_wal_with_garbage_pages_is_corrupt_and_nothing_is_overwritten(
    wal_journal: Path,
) -> None:
    """Garbage pages with valid WAL checksums: JournalCorrupt; main file and WAL left as found."""
    wal = Path(f"{wal_journal}-wal")
    damage(wal_journal, "-wal", garble_pages_keep_checksums)
    main_before, wal_before = wal_journal.read_bytes(), wal.read_bytes()
    with pytest.raises((JournalCorrupt, NotAJournal)):
        await open_and_load(wal_journal)
    assert wal.exists(), "the WAL holding the damaged frames was deleted"
    assert wal.read_bytes() == wal_before, "the WAL was rewritten"
    assert wal_journal.read_bytes() == main_before, (
        "the main file was overwritten: closing the store checkpointed the damaged WAL into it"
    )


# -- 2. a journal whose fingerprints do not match the agent --------------------------------


def divergence_agent(calls: Counter[str]) -> Agent:
    @tool(idempotent=True)
    def lookup(key: str) -> str:
        """Look a key up."""
        calls["lookup"] += 1
        return f"value of {key}"

    @tool
    def pay(amount: int) -> str:
        """Pay; needs a person's approval."""
        calls["pay"] += 1
        return f"paid {amount}"

    return Agent(tools=[lookup, pay], policy=require_approval_for("pay"))


DIVERGENCE_SCRIPT = [
    ModelResponse(tool_calls=[ToolCall(name="lookup", arguments={"key": "k"})]),
    ModelResponse(tool_calls=[ToolCall(name="pay", arguments={"amount": 5})]),
    ModelResponse(text="paid"),
]

TAMPERING = {
    # name: (SQL run on the file, the step the resumed run must name)
    "recorded-fingerprint": (
        "UPDATE journal SET payload = json_set(payload, '$.fp', 'f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0')"
        " WHERE step_id = 'm1' AND phase = 'result'",
        "m1",
    ),
    "recorded-tool-result": (
        "UPDATE journal SET payload = json_set(payload, '$.value', 'forged')"
        " WHERE step_id = 'm1.t1' AND phase = 'result'",
        "m2",
    ),
}


@pytest.mark.parametrize("tampering", list(TAMPERING))
async def test_journal_edited_behind_the_agent_diverges(tmp_path: Path, tampering: str) -> None:
    """A journal edited after the fact: ReplayDivergence at the step, no call, no write."""
    db, calls = tmp_path / "runs.db", Counter[str]()
    store = SqliteCheckpointer(db)
    session = Session(RUN, ScriptedGateway(DIVERGENCE_SCRIPT), store)
    steps = [s async for s in divergence_agent(calls).run("pay 5", session=session)]
    assert isinstance(steps[-1], ApprovalStep)
    await approve(store, RUN, "m2.t1", by="ana")
    await store.close()
    sql, step = TAMPERING[tampering]
    with closing(sqlite3.connect(db)) as raw, raw:
        assert raw.execute(sql).rowcount == 1
    store = SqliteCheckpointer(db)
    before = await store.load(RUN)
    gateway = ScriptedGateway(DIVERGENCE_SCRIPT)
    with pytest.raises(ReplayDivergence) as caught:
        async for _ in divergence_agent(calls).run("pay 5", session=Session(RUN, gateway, store)):
            pass
    assert (caught.value.run_id, caught.value.step_id) == (RUN, step)
    assert gateway.calls == []
    assert calls == Counter(lookup=1), "the approved payment did not run on a diverged journal"
    assert await store.load(RUN) == before
    await store.close()


# -- 3. tool results that are not JSON -----------------------------------------------------


def nested_lists(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def nested_dicts(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def dict_cycle() -> dict[str, Any]:
    value: dict[str, Any] = {"name": "loop"}
    value["self"] = {"parent": value}
    return value


NOT_JSON: dict[str, Callable[[], Any]] = {
    "inf": lambda: float("inf"),
    "minus-inf-in-a-list": lambda: [1.0, float("-inf")],
    "nan-deep-in-a-dict": lambda: {"a": {"b": [0.5, float("nan")]}},
    "lone-surrogate": lambda: "ok \ud800",
    "lone-surrogate-in-a-value": lambda: {"text": "x\udfff"},
    "lone-surrogate-in-a-key": lambda: {"\udc80": 1},
    "100k-nested-lists": lambda: nested_lists(100_000),
    "100k-nested-dicts": lambda: nested_dicts(100_000),
    "dict-cycle": dict_cycle,
    "non-utf8-bytes-in-a-dict": lambda: {"raw": b"\xc3\x28\xff"},
}


def odd_result_agent(kind: str, ran: list[str]) -> Agent:
    @tool
    def odd() -> Any:
        """Return something that is not JSON."""
        ran.append(kind)
        return NOT_JSON[kind]()

    return Agent(tools=[odd])


ODD_SCRIPT = [
    ModelResponse(tool_calls=[ToolCall(name="odd", arguments={})]),
    ModelResponse(text="ok"),
]


@pytest.mark.parametrize("kind", list(NOT_JSON))
async def test_result_that_is_not_json_is_a_recorded_failure(tmp_path: Path, kind: str) -> None:
    """A non-JSON result is the step's recorded failure, in valid text; ran once; run goes on."""
    db, ran = tmp_path / "runs.db", list[str]()
    store = SqliteCheckpointer(db)
    gateway = ScriptedGateway(ODD_SCRIPT)
    session = Session(RUN, gateway, store)
    steps = [s async for s in odd_result_agent(kind, ran).run("t", session=session)]
    tool_step = next(s for s in steps if isinstance(s, ToolStep))
    assert tool_step.status == "error", f"recorded as {tool_step.status}: {tool_step.result!r}"
    assert isinstance(steps[-1], FinalStep)
    [told] = [m.content for m in gateway.calls[1][0].messages if m.role == "tool"]
    assert told.startswith("error: the tool's result cannot be recorded")
    told.encode()  # what a provider receives must be valid Unicode
    await store.close()
    store = SqliteCheckpointer(db)
    again = ScriptedGateway(ODD_SCRIPT)
    replay = [
        s async for s in odd_result_agent(kind, ran).run("t", session=Session(RUN, again, store))
    ]
    await store.close()
    assert replay == [FinalStep(run_id=RUN, step_id="m2", text="ok", replayed=True)]
    assert (ran, again.calls) == ([kind], [])


@dataclasses.dataclass
class Node:
    """A tree node that points back to its parent (a cycle once linked)."""

    name: str
    children: list[Any] = dataclasses.field(default_factory=list)
    parent: Any = None


def list_cycle() -> list[Any]:
    value: list[Any] = [1, {"rows": []}]
    value[1]["rows"].append(value)
    return value


def dataclass_cycle() -> Node:
    root = Node("root")
    root.children.append(Node("leaf", parent=root))
    return root


CYCLES: dict[str, tuple[Callable[[], Any], str]] = {
    # name: (the tool's result, where the recorded error must say it refers to itself)
    "dict": (dict_cycle, "result['self']['parent'] is result itself"),
    "list": (list_cycle, "result[1]['rows'][0] is result itself"),
    "dataclass": (dataclass_cycle, "result.children[0].parent is result itself"),
}


@pytest.mark.parametrize("kind", list(CYCLES))
async def test_a_cyclic_result_is_recorded_naming_the_cycle(tmp_path: Path, kind: str) -> None:
    """A tool result that contains itself is the step's recorded failure, and the model is
    told where the cycle is, not "RecursionError: maximum recursion depth exceeded"."""
    make, where = CYCLES[kind]

    @tool
    def tree() -> Any:
        """Return a structure that refers to itself."""
        return make()

    store = SqliteCheckpointer(tmp_path / "runs.db")
    gateway = ScriptedGateway(
        [ModelResponse(tool_calls=[ToolCall(name="tree", arguments={})]), ModelResponse(text="ok")]
    )
    try:
        session = Session(RUN, gateway, store)
        steps = [s async for s in Agent(tools=[tree]).run("t", session=session)]
        [result] = [e for e in await store.load_step(RUN, "m1.t1") if e.phase == Phase.RESULT]
    finally:
        await store.close()
    assert isinstance(steps[-1], FinalStep)
    assert result.payload["status"] == "error"
    assert f"{where}: a reference cycle" in result.payload["error"]
    [told] = [m.content for m in gateway.calls[1][0].messages if m.role == "tool"]
    assert where in told
    assert "RecursionError" not in told


async def test_lone_surrogate_result_does_not_wedge_a_real_gateway(
    tmp_path: Path, tiny: TinyProvider
) -> None:
    """A result with a lone surrogate cannot wedge the run: the next request encodes; it closes."""
    ran: list[int] = []

    @tool
    def send(n: int) -> str:
        """Send message n."""
        ran.append(n)
        return f"sent {n} \ud800"

    store = SqliteCheckpointer(tmp_path / "runs.db")
    gateway = OpenAIGateway("tiny", base_url=tiny.url, api_key="k", max_retries=0)
    try:
        session = Session(RUN, gateway, store)
        steps = [s async for s in Agent(tools=[send]).run("send two", session=session)]
    finally:
        await gateway.aclose()
        await store.close()
    assert isinstance(steps[-1], FinalStep)
    assert ran == [0, 1]


# -- 4. payloads from 10 MB to the limit: bounded memory, typed errors above ---------------

# The tool result limit: the canonical JSON of the value may take MAX_RECORD_BYTES - 1024.
RESULT_LIMIT = MAX_RECORD_BYTES - 1024
PAYLOADS = {
    # name: (mode, size of the string, what the step must record)
    "10MiB": ("result", 10 * MiB, "ok"),
    "20MiB": ("result", 20 * MiB, "ok"),
    "just-under-the-limit": ("result", RESULT_LIMIT - 2, "ok"),
    "just-over-the-limit": ("result", RESULT_LIMIT - 1, "error"),
    "model-answer-over-the-limit": ("answer", MAX_RECORD_BYTES, "RecordTooLarge"),
}


async def payload_child(mode: str, db: str, size: int) -> dict[str, Any]:
    """First pass stops after the big step; a second pass on a new store replays it and closes."""
    ran: list[int] = []

    @tool
    def big() -> str:
        """Return a large text."""
        ran.append(size)
        return "x" * size

    script = [
        ModelResponse(tool_calls=[ToolCall(name="big", arguments={})]),
        ModelResponse(text="ok"),
    ]
    if mode == "answer":
        script[0] = ModelResponse(text="y" * size)
    out: dict[str, Any] = {}
    for attempt in range(2):
        store = SqliteCheckpointer(db)
        gen = Agent(tools=[big]).run("t", session=Session(RUN, ScriptedGateway(script), store))
        try:
            async for step in gen:
                if isinstance(step, ToolStep):
                    out["status"] = step.status
                    break
        except RecordTooLarge:
            out["status"] = "RecordTooLarge"
            out["events"] = len(await store.load(RUN))
        finally:
            await gen.aclose()  # type: ignore[attr-defined]
            await store.close()
        del gen
        out[f"pass{attempt}"] = True
    out["ran"] = len(ran)
    return out


def spawn_payload_child(mode: str, db: Path, size: int) -> tuple[dict[str, Any], float]:
    """Run the child; its outcome and its own peak RSS in MB (``_own_peak_kib``)."""
    with open(db.with_suffix(".stderr"), "w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, __file__, mode, str(db), str(size)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        killer = threading.Timer(CHILD_TIMEOUT, proc.kill)
        killer.start()
        try:
            assert proc.stdout is not None
            stdout = proc.stdout.read()
            proc.stdout.close()
            _, status, _ = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        finally:
            killer.cancel()
        stderr.seek(0)
        assert proc.returncode == 0, stderr.read()[-2000:]
    out: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return out, out.pop("peak_kib") / 1024


def baseline_rss_mb(tmp_path: Path) -> float:
    _, peak = spawn_payload_child("result", tmp_path / "baseline.db", 10)
    return peak


@pytest.fixture(scope="module")
def baseline_mb(tmp_path_factory: pytest.TempPathFactory) -> float:
    """Peak RSS of the same child with a 10-byte result: the interpreter and imports."""
    return baseline_rss_mb(tmp_path_factory.mktemp("baseline"))


def test_the_childs_peak_is_its_own_not_its_parents(tmp_path: Path) -> None:
    """A parent holding 400 MB forks the 10-byte child: its peak is still its own. Read
    from wait4(), it was the parent's, and the 10 MiB case failed late in CI's session."""
    ballast = bytearray(400 * MiB)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touched: resident, not just reserved
    try:
        peak = baseline_rss_mb(tmp_path)
    finally:
        del ballast
    assert peak < 200, f"the 10-byte child measured {peak:.0f} MB"


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_large_payload_memory_stays_bounded(tmp_path: Path, baseline_mb: float, name: str) -> None:
    """10 MB up to the limit: recorded and replayed in bounded memory; above it, typed."""
    mode, size, expected = PAYLOADS[name]
    out, peak_mb = spawn_payload_child(mode, tmp_path / "runs.db", size)
    payload_mb = size / MiB
    bound = 12 * payload_mb + 200
    print(
        f"{name}: payload {payload_mb:.1f} MiB, peak RSS {peak_mb:.0f} MB "
        f"(baseline {baseline_mb:.0f} MB, bound {bound:.0f} MB)"
    )
    assert out["status"] == expected, out
    assert peak_mb < bound, f"peak RSS {peak_mb:.0f} MB for a {payload_mb:.1f} MiB payload"
    if mode == "result":
        assert out["ran"] == 1, "the tool ran once; the resumed pass replayed its outcome"
    else:
        assert out["events"] == 0, "nothing of the oversized step was written"


# -- 5. run ids and step ids with odd characters --------------------------------------------

ODD_RUN_IDS = {
    "unicode": "ñandú-日本-مرحبا-🧾-👩‍💻",
    "quotes": 'it\'s "quoted" `back`',
    "percent-underscore": "100%_done_%s%n",
    "slashes-colons": "a/b\\c:d::e",
    "newlines": "line\nbreak\r\ttab",
    "sql": "'); DROP TABLE journal; --",
    "512-chars": "ü" * 511 + "x",
}


@pytest.fixture(params=["sqlite", "postgres"])
async def open_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Callable[[], Checkpointer]]:
    """A factory of new store objects on one journal (SQLite file or PostgreSQL schema)."""
    opened: list[Checkpointer] = []

    def make() -> Checkpointer:
        if request.param == "sqlite":
            store: Checkpointer = SqliteCheckpointer(tmp_path / "runs.db")
        else:
            from asiento.journal.postgres import PostgresCheckpointer

            store = PostgresCheckpointer(request.getfixturevalue("pg_dsn"), max_size=2)
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()


def odd_agent(sent: list[str]) -> Agent:
    @tool
    def send(to: str) -> str:
        """Send a message; needs approval."""
        sent.append(to)
        return f"sent to {to}"

    @tool(idempotent=True)
    def echo(text: str) -> str:
        """Echo."""
        return text

    return Agent(tools=[send, echo], policy=require_approval_for("send"))


def odd_script(odd: str) -> list[ModelResponse]:
    calls = [
        ToolCall(name="echo", arguments={"text": odd}, id=f"call:{odd}"),
        ToolCall(name="send", arguments={"to": odd}, id=f"call/2 {odd}"),
    ]
    return [ModelResponse(tool_calls=calls), ModelResponse(text=f"done {odd}")]


async def odd_pass(make: Callable[[], Checkpointer], run_id: str, sent: list[str]) -> list[Any]:
    store = make()
    session = Session(run_id, ScriptedGateway(odd_script(run_id)), store)
    return [s async for s in odd_agent(sent).run(f"task {run_id}", session=session)]


@pytest.mark.parametrize("name", list(ODD_RUN_IDS))
async def test_odd_run_id_through_a_whole_run_and_resume(
    open_store: Callable[[], Checkpointer], name: str
) -> None:
    """An odd run id (and odd call ids) through suspend, approve, resume, replay, listing."""
    odd = ODD_RUN_IDS[name]
    sibling = odd[:-1] + ("_" if odd[-1] != "_" else "%")
    sent: list[str] = []
    for run_id in (sibling, odd):
        [*_, waiting] = await odd_pass(open_store, run_id, sent)
        assert isinstance(waiting, ApprovalStep)
        assert (waiting.run_id, waiting.step_id) == (run_id, "m1.t2")
    await approve(open_store(), odd, "m1.t2", by=odd, fingerprint=waiting.fingerprint)
    [*_, final] = await odd_pass(open_store, odd, sent)
    assert final == FinalStep(run_id=odd, step_id="m2", text=f"done {odd}")
    again = await odd_pass(open_store, odd, sent)
    assert again == [FinalStep(run_id=odd, step_id="m2", text=f"done {odd}", replayed=True)]
    assert sent == [odd]
    store = open_store()
    events = await store.load(odd)
    assert {e.run_id for e in events} == {odd}
    approval = next(e for e in events if e.phase == Phase.APPROVAL)
    assert approval.payload["by"] == odd
    closed = await store.runs(status=RunStatus.CLOSED)
    assert [r.run_id for r in closed] == [odd]
    suspended = await store.runs(status=RunStatus.SUSPENDED)
    assert [r.run_id for r in suspended] == [sibling]


ODD_STEP_IDS = ["m1.t2 ", "M1.T2", "m1.t2/1", "m1.t2\n", "m1%t2", "m1_t2", "🧾", "x" * 512]


@pytest.mark.parametrize("step_id", ODD_STEP_IDS)
async def test_odd_step_id_never_matches_another_step(tmp_path: Path, step_id: str) -> None:
    """Approving an odd step id near a real one is refused and writes nothing."""
    store = SqliteCheckpointer(tmp_path / "runs.db")
    [*_, waiting] = await odd_pass(lambda: store, RUN, [])
    assert isinstance(waiting, ApprovalStep)
    before = await store.load(RUN)
    with pytest.raises(ApprovalError, match=r"not awaiting approval|has no step"):
        await approve(store, RUN, step_id, by="ana")
    assert await store.load(RUN) == before
    await store.close()


BAD_IDS = {"empty": "", "nul": "a\x00b", "513-chars": "x" * 513, "lone-surrogate": "a\ud800"}


@pytest.mark.parametrize("name", list(BAD_IDS))
async def test_bad_ids_are_refused_before_anything_is_written(tmp_path: Path, name: str) -> None:
    """Session and the harness refuse unusable run and step ids with UsageError, writing nothing."""
    bad, store = BAD_IDS[name], SqliteCheckpointer(tmp_path / "runs.db")
    with pytest.raises(UsageError, match="run_id"):
        Session(bad, ScriptedGateway([]), store)
    with pytest.raises(UsageError, match="step_id"):
        await approve(store, RUN, bad, by="ana")
    assert await store.runs() == []
    await store.close()


# -- 6. model answers that are not valid for the provider's format -------------------------


class TinyProvider:
    """Chat Completions and Responses on 127.0.0.1 (stdlib http.server in a thread).

    Turn t asks ``send(n=t)`` for t < 2, then answers "done". ``bad[turn]`` is served
    once instead of the good answer for that turn. ``asked`` counts requests per turn,
    with the Idempotency-Key each carried.
    """

    def __init__(self) -> None:
        self.bad: dict[int, bytes] = {}
        self.asked: list[tuple[int, str]] = []
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                reply = provider.answer(self.path, body, self.headers.get("idempotency-key", ""))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def answer(self, path: str, body: dict[str, Any], key: str) -> bytes:
        chat = path.endswith("/chat/completions")
        items = body["messages"] if chat else body["input"]
        turn = sum(
            1 for m in items if m.get("role") == "assistant" or m.get("type") == "function_call"
        )
        self.asked.append((turn, key))
        if turn in self.bad:
            return self.bad.pop(turn)
        reply = chat_answer(turn) if chat else responses_answer(turn)
        return json.dumps(reply).encode()

    def __enter__(self) -> TinyProvider:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def chat_answer(turn: int, **message: Any) -> dict[str, Any]:
    """A well-formed chat completion for ``turn``, with ``message`` fields overridden."""
    good: dict[str, Any] = {"role": "assistant", "content": "done"}
    if turn < 2:
        call = {
            "id": f"c{turn}",
            "type": "function",
            "function": {"name": "send", "arguments": json.dumps({"n": turn})},
        }
        good = {"role": "assistant", "content": None, "tool_calls": [call]}
    return {
        "id": f"chatcmpl-{turn}",
        "object": "chat.completion",
        "model": "tiny",
        "choices": [{"index": 0, "message": good | message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5},
    }


def responses_answer(turn: int) -> dict[str, Any]:
    output: list[dict[str, Any]] = [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "done"}],
        }
    ]
    if turn < 2:
        output = [
            {
                "type": "function_call",
                "call_id": f"c{turn}",
                "name": "send",
                "arguments": json.dumps({"n": turn}),
            }
        ]
    return {"id": f"resp-{turn}", "object": "response", "model": "tiny", "output": output}


def tool_call(function: Any) -> dict[str, Any]:
    return {"tool_calls": [{"id": "c1", "type": "function", "function": function}]}


def raw(value: Any) -> bytes:
    return value if isinstance(value, bytes) else json.dumps(value).encode()


MALFORMED: dict[str, tuple[str, bytes]] = {
    # name: (api, body served for the model step m2, after a non-idempotent tool ran)
    "chat-not-json": ("chat", b"<html>502 bad gateway</html>"),
    "chat-body-is-a-list": ("chat", raw([chat_answer(1)])),
    "chat-missing-choices": ("chat", raw({"id": "x", "object": "chat.completion"})),
    "chat-empty-choices": ("chat", raw({"id": "x", "choices": []})),
    "chat-choices-not-a-list": ("chat", raw({"id": "x", "choices": {"0": {}}})),
    "chat-choice-without-message": ("chat", raw({"choices": [{"index": 0}]})),
    "chat-content-is-a-number": ("chat", raw(chat_answer(2, content=42))),
    "chat-arguments-cut-short": (
        "chat",
        raw(chat_answer(1, **tool_call({"name": "send", "arguments": '{"n": 1'}))),
    ),
    "chat-arguments-a-json-list": (
        "chat",
        raw(chat_answer(1, **tool_call({"name": "send", "arguments": "[1]"}))),
    ),
    "chat-arguments-a-number": (
        "chat",
        raw(chat_answer(1, **tool_call({"name": "send", "arguments": 7}))),
    ),
    "chat-function-without-name": ("chat", raw(chat_answer(1, **tool_call({"arguments": "{}"})))),
    "chat-function-name-a-number": (
        "chat",
        raw(chat_answer(1, **tool_call({"name": 3, "arguments": "{}"}))),
    ),
    "chat-tool-calls-a-string": ("chat", raw(chat_answer(1, tool_calls="send"))),
    "responses-missing-output": ("responses", raw({"id": "r", "object": "response"})),
    "responses-message-content-not-a-list": (
        "responses",
        raw({"output": [{"type": "message", "content": "done"}]}),
    ),
    "responses-call-without-name": (
        "responses",
        raw({"output": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}),
    ),
    "responses-arguments-not-json": (
        "responses",
        raw(
            {
                "output": [
                    {"type": "function_call", "call_id": "c", "name": "send", "arguments": "{n:"}
                ]
            }
        ),
    ),
}


def sending_agent(sent: list[int]) -> Agent:
    @tool
    def send(n: int) -> str:
        """Send message n; not safe to repeat."""
        sent.append(n)
        return f"sent {n}"

    return Agent(tools=[send])


@pytest.fixture
def tiny() -> Iterator[TinyProvider]:
    """The tiny provider, shut down after the test."""
    with TinyProvider() as provider:
        yield provider


@pytest.mark.parametrize("name", list(MALFORMED))
async def test_malformed_model_answer_is_typed_and_never_recorded(
    tmp_path: Path, tiny: TinyProvider, name: str
) -> None:
    """A malformed answer at m2: ModelResponseInvalid, nothing of m2 recorded; resume closes."""
    api, body = MALFORMED[name]
    tiny.bad[1] = body
    db, sent = tmp_path / "runs.db", list[int]()

    async def one_pass() -> list[Any]:
        store = SqliteCheckpointer(db)
        gateway = OpenAIGateway("tiny", api=api, base_url=tiny.url, api_key="k", max_retries=0)  # type: ignore[arg-type]
        try:
            session = Session(RUN, gateway, store)
            return [s async for s in sending_agent(sent).run("send two", session=session)]
        finally:
            await gateway.aclose()
            await store.close()

    with pytest.raises(ModelResponseInvalid) as caught:
        await one_pass()
    assert (caught.value.run_id, caught.value.step_id) == (RUN, "m2")
    store = SqliteCheckpointer(db)
    recorded = {e.step_id for e in await store.load(RUN)}
    await store.close()
    assert recorded == {"m1", "m1.t1"}, "nothing of m2 was recorded"
    assert sent == [0]
    steps = await one_pass()
    assert isinstance(steps[-1], FinalStep)
    assert steps[-1].text == "done"
    assert sent == [0, 1], "the tool of m1 did not run again"
    turns = [turn for turn, _ in tiny.asked]
    assert turns == [0, 1, 1, 2], "m1 was not asked again; m2 was asked again"
    assert tiny.asked[1][1] == tiny.asked[2][1], "the retried m2 carried the same key"


# -- the payload child --------------------------------------------------------------------


def child_main(argv: list[str]) -> int:
    mode, db, size = argv[0], argv[1], int(argv[2])
    out = asyncio.run(payload_child(mode, db, size))
    out["peak_kib"] = _own_peak_kib()
    print(json.dumps(out), flush=True)
    return 0


def _own_peak_kib() -> int:
    """This process's own peak RSS (``VmHWM``, reset at exec). Not wait4()'s ru_maxrss:
    Linux carries the forking parent's peak into the child's, so late in a long pytest
    session a 10-byte payload measured as big as pytest itself (321 MB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # not Linux: KiB, or bytes


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
