"""Disk full: a typed error, nothing recorded that did not happen, a clean resume later.

A child process drives a run whose journal cannot grow past a limit: either
``RLIMIT_FSIZE`` (writes past the limit fail with ``EFBIG``; ``SIGXFSZ`` is
ignored so that the process is not killed by it) or a 2 MB tmpfs mounted for
the test (``ENOSPC``). Two fsynced ledgers outside the journal say what really
happened: one line per tool execution, one per model request. Once space is
back, new processes resume the run to its end; a step whose tool ran but whose
result could not be written is uncertain, and a person resolves it from the
ledger, as the contract says.

This file is also the child: ``python test_disk_full.py DB EFFECTS MODELS ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asiento import (
    Agent,
    FinalStep,
    ModelRequest,
    ModelResponse,
    Phase,
    RunStatus,
    Session,
    SqliteCheckpointer,
    StepEvent,
    ToolCall,
    UncertainEffect,
    resolve,
    tool,
)
from asiento.testing import ScriptedGateway

RUN = "disk-full-run"
TASK = "send one message per turn"
CHILD_TIMEOUT = 60
MAX_PASSES = 4
UNCERTAIN_EXIT = 3
FAILED_EXIT = 4


# -- the child -----------------------------------------------------------------------------


def append_line(path: str, record: dict[str, Any]) -> None:
    """One JSON line in one write(2), then fsync: what is in the ledger happened."""
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def tool_value(n: int, size: int) -> str:
    """What ``send`` returns for turn ``n``; a person resolving the step records the same."""
    return f"sent-{n}:" + "r" * size


def make_agent(effects: str, size: int) -> Agent:
    """One non-idempotent tool that writes its ledger line, then returns ``size`` bytes."""

    @tool
    def send(n: int, ref: str, pad: str = "") -> str:
        """Send message ``n``; not safe to repeat."""
        append_line(effects, {"step": ref, "n": n})
        return tool_value(n, size)

    return Agent(instructions="disk-full agent", tools=[send], max_turns=200)


def make_gateway(models: str, turns: int, pad: int, label: str) -> ScriptedGateway:
    """Turn t asks ``send(n=t)`` (with ``pad`` bytes in the arguments); the last one closes."""

    def answer(request: ModelRequest) -> ModelResponse:
        turn = sum(1 for m in request.messages if m.role == "assistant")
        step = f"m{turn + 1}"
        append_line(models, {"step": step, "pass": label})
        if turn >= turns:
            return ModelResponse(text=f"sent {turns} messages")
        args = {"n": turn, "ref": f"{step}.t1", "pad": "p" * pad}
        return ModelResponse(tool_calls=[ToolCall(name="send", arguments=args)])

    return ScriptedGateway(answer)


def limit_file_size(limit: int) -> None:
    """Writes past ``limit`` bytes fail with EFBIG instead of killing the process."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))


async def child_pass(cmd: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """One pass of the run; the outcome as (exit code, JSON)."""
    store = SqliteCheckpointer(cmd.db)
    if cmd.limit:
        limit_file_size(cmd.limit)
    agent = make_agent(cmd.effects, cmd.size)
    gateway = make_gateway(cmd.models, cmd.turns, cmd.pad, cmd.label)
    last = None
    try:
        async for step in agent.run(TASK, session=Session(RUN, gateway, store)):
            last = step
    except UncertainEffect as exc:
        return UNCERTAIN_EXIT, {"outcome": "uncertain", "step": exc.step_id}
    except Exception as exc:
        mro = [c.__name__ for c in type(exc).__mro__]
        return FAILED_EXIT, {"outcome": "failed", "mro": mro, "message": str(exc)}
    finally:
        await store.close()
    assert isinstance(last, FinalStep), last
    return 0, {"outcome": "closed", "replayed": last.replayed}


def child_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="test_disk_full.py")
    for name in ("db", "effects", "models"):
        parser.add_argument(name)
    for name in ("limit", "size", "pad", "turns"):
        parser.add_argument(f"--{name}", type=int, default=0)
    parser.add_argument("--label", default="")
    cmd = parser.parse_args(argv)
    code, out = asyncio.run(child_pass(cmd))
    print(json.dumps(out), flush=True)
    return code


# -- the tests -----------------------------------------------------------------------------


class Campaign:
    """One run on one journal, driven by child processes, with its two ledgers."""

    def __init__(self, db: Path, ledgers: Path, *, size: int, pad: int, turns: int) -> None:
        self.db, self.size, self.pad, self.turns = db, size, pad, turns
        self.effects, self.models = ledgers / "effects.jsonl", ledgers / "models.jsonl"
        self.passes = 0
        self.outcomes: list[dict[str, Any]] = []  # how each resumed pass ended

    def drive(self, *, limit: int = 0) -> dict[str, Any]:
        """One pass in a new process, optionally with a file-size limit."""
        self.passes += 1
        argv = [str(self.db), str(self.effects), str(self.models), "--label", str(self.passes)]
        argv += ["--size", str(self.size), "--pad", str(self.pad), "--turns", str(self.turns)]
        argv += ["--limit", str(limit)]
        done = subprocess.run(
            [sys.executable, __file__, *argv],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
            check=False,
        )
        assert done.stdout.strip(), f"child printed nothing (rc {done.returncode}): {done.stderr}"
        out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        out["rc"] = done.returncode
        return out

    def ledger(self, which: Path) -> list[dict[str, Any]]:
        if not which.exists():
            return []
        return [json.loads(line) for line in which.read_text().splitlines()]

    def effects_by_step(self) -> Counter[str]:
        return Counter(r["step"] for r in self.ledger(self.effects))

    async def journal(self) -> list[StepEvent]:
        store = SqliteCheckpointer(self.db)
        try:
            return await store.load(RUN)
        finally:
            await store.close()

    async def status(self) -> RunStatus:
        store = SqliteCheckpointer(self.db)
        try:
            [info] = await store.runs()
        finally:
            await store.close()
        return info.status

    async def resume(self) -> None:
        """Passes without a limit until the run closes; uncertain steps resolved from the ledger."""
        for _ in range(MAX_PASSES):
            out = self.drive()
            self.outcomes.append(out)
            if out["outcome"] != "uncertain":
                return
            await self.resolve_from_ledger(out["step"])

    async def resolve_from_ledger(self, step: str) -> None:
        """What a person does: look at the destination (the ledger), record what happened."""
        ran = self.effects_by_step()[step]
        assert ran == 1, f"uncertain step {step} ran {ran} times"
        n = int(step.split(".", maxsplit=1)[0][1:]) - 1
        store = SqliteCheckpointer(self.db)
        try:
            await resolve(store, RUN, step, happened=True, result=tool_value(n, self.size))
        finally:
            await store.close()


def phases(events: list[StepEvent]) -> dict[str, dict[Phase, StepEvent]]:
    out: dict[str, dict[Phase, StepEvent]] = {}
    for e in events:
        out.setdefault(e.step_id, {})[e.phase] = e
    return out


def check_nothing_recorded_that_did_not_happen(campaign: Campaign, events: list[StepEvent]) -> None:
    """Every recorded tool outcome ran (ledger); every execution was submitted first."""
    journal, ran = phases(events), campaign.effects_by_step()
    modelled = {r["step"] for r in campaign.ledger(campaign.models)}
    for step_id, records in journal.items():
        if "." in step_id and Phase.RESULT in records:
            assert records[Phase.RESULT].payload["status"] == "ok", records[Phase.RESULT]
            assert ran[step_id] == 1, f"{step_id} recorded as done but ran {ran[step_id]} times"
        if "." not in step_id and step_id != "final":
            assert step_id in modelled, f"model answer {step_id} recorded but never requested"
    for step_id, times in ran.items():
        assert times == 1, f"{step_id} ran {times} times"
        assert Phase.SUBMITTED in journal.get(step_id, {}), f"{step_id} ran without submitted"
    assert "final" not in journal


def check_resumed_cleanly(campaign: Campaign, before: list[StepEvent]) -> None:
    """Each effect once, in order; no model answer recorded before the resume asked again."""
    expected = {f"m{n + 1}.t1": 1 for n in range(campaign.turns)}
    assert dict(campaign.effects_by_step()) == expected
    recorded = {e.step_id for e in before if e.phase == Phase.RESULT and "response" in e.payload}
    asked_again = {
        r["step"] for r in campaign.ledger(campaign.models) if r["pass"] != "1"
    } & recorded
    assert asked_again == set(), f"recorded model answers asked again: {sorted(asked_again)}"


async def full_then_resume(campaign: Campaign, first: dict[str, Any]) -> list[StepEvent]:
    """The pass that hit the limit failed typed and recorded only what happened; resume."""
    assert first["outcome"] == "failed", first
    assert "JournalFull" in first["mro"], first
    print(f"disk full: {first['mro'][0]}: {first['message'][:160]}")
    before = await campaign.journal()
    check_nothing_recorded_that_did_not_happen(campaign, before)
    assert await campaign.status() is not RunStatus.CLOSED
    await campaign.resume()
    assert campaign.outcomes[-1]["outcome"] == "closed", campaign.outcomes
    check_resumed_cleanly(campaign, before)
    again = campaign.drive()
    assert again["outcome"] == "closed", again
    assert again["replayed"], again
    assert await campaign.status() is RunStatus.CLOSED
    return before


async def new_journal(db: Path) -> None:
    """Create the journal (schema and WAL mode) before any limit applies."""
    await SqliteCheckpointer(db).close()


# Where the large bytes are decides which append meets the limit: large tool results
# fill the journal at a result (the tool already ran: the resume finds the step
# uncertain, a person resolves it from the ledger), large arguments at the model answer
# + intent (the tool has not run: the resume runs it, once). Each shape is (result
# bytes, argument bytes, how the first resumed pass ends).
SHAPES = {
    "large-results": (192 * 1024, 0, "uncertain"),
    "large-arguments": (0, 96 * 1024, "closed"),
}


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_file_size_limit_mid_run_then_resume(tmp_path: Path, shape: str) -> None:
    """RLIMIT_FSIZE mid-run: a JournalError, nothing recorded that did not happen, resume."""
    size, pad, resumed = SHAPES[shape]
    db = tmp_path / "runs.db"
    await new_journal(db)
    campaign = Campaign(db, tmp_path, size=size, pad=pad, turns=12)
    first = campaign.drive(limit=db.stat().st_size + 1024 * 1024)
    before = await full_then_resume(campaign, first)
    assert campaign.outcomes[0]["outcome"] == resumed, campaign.outcomes
    tool_steps = {e.step_id for e in before if "." in e.step_id}
    assert 2 <= len(tool_steps) < campaign.turns, "the limit must cut the run in its middle"


def test_file_size_limit_stops_writes_in_the_child(tmp_path: Path) -> None:
    """Negative control: the limit really makes writes fail with EFBIG in a child."""
    code = (
        "import resource, signal, os, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n"
        "os.write(fd, b'x' * 4096)\n"
        "try:\n    os.write(fd, b'x')\n"
        "except OSError as e:\n    print(e.errno)\n"
    )
    target = tmp_path / "efbig"
    done = subprocess.run(
        [sys.executable, "-c", code, str(target)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        check=True,
    )
    assert done.stdout.strip() == str(errno.EFBIG)
    assert target.stat().st_size == 4096


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MB tmpfs mounted for the test; skipped where mounting is not allowed."""
    mount = tmp_path / "small"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("a 2 MB tmpfs needs mount(8) as root; the RLIMIT_FSIZE variant still runs")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}); RLIMIT variant runs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], timeout=30, check=True)


async def test_small_filesystem_full_mid_run_then_resume(small_fs: Path, tmp_path: Path) -> None:
    """A full 2 MB filesystem: a JournalError, nothing false recorded; resume once it grows."""
    db = small_fs / "runs.db"
    await new_journal(db)
    campaign = Campaign(db, tmp_path, size=64 * 1024, pad=0, turns=48)
    first = campaign.drive()
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_fs)], timeout=30, check=True)
    await full_then_resume(campaign, first)


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
