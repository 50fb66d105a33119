"""``asiento demo``: the seed's durability table, measured with real processes.

Each pass runs in its own child process, on the same SQLite file and run id:

1. a model call asks for ``read("/x")``, the tool runs and its result is
   recorded; the process is then killed with SIGKILL inside the second model
   call (``ASIENTO_CRASH_AT=inside_model_call@2``);
2. a new process with a new gateway resumes: only the missing model answer is
   asked for, the tool is not run again, the run closes;
3. a new process resumes the closed run: nothing is called, the recorded
   ``FinalStep`` comes back.

The children append every model answer they receive and every tool execution
to fsynced count files; the parent only reads those files, so the table shows
what happened, not what was meant to happen.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .._crash import ENV_VAR
from ..agent import Agent
from ..events import FinalStep
from ..gateways.scripted import ScriptedGateway
from ..journal import SqliteCheckpointer
from ..model import ModelRequest, ModelResponse, ToolCall
from ..session import Session
from ..tools import tool

if TYPE_CHECKING:
    from rich.console import Console

RUN_ID = "run-1"
TASK = "lee /x"
CRASH_AT = "inside_model_call@2"
KILLED = "killed by SIGKILL"
EXPECTED = ((1, 1, KILLED), (1, 0, "closed"), (0, 0, "already closed"))
NOTES = (
    "← el proceso muere aquí",
    "← solo ocurre lo que no llegó a ocurrir",
    "← un run cerrado no se reabre",
)
GUARANTEE = (
    "Guarantee: a model answer already recorded is not asked for (nor paid) again, "
    "a tool effect already recorded is not applied again, and a closed run is not reopened."
)
RESPONSES = (
    ModelResponse(tool_calls=[ToolCall(name="read", arguments={"path": "/x"})]),
    ModelResponse(text="/x dice: hola"),
)


@dataclass(frozen=True, slots=True)
class PassResult:
    """What one child process did, as read back from its count files and exit status."""

    number: int
    model_calls: int
    tool_calls: int
    ended: str
    keys_sent: tuple[str, ...]


def append_line(path: Path, text: str) -> None:
    """Append one line and fsync it, so the count survives the SIGKILL that follows."""
    with path.open("a", encoding="utf-8") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_lines(path: Path) -> tuple[str, ...]:
    """The lines a child appended to ``path`` (none if it never wrote)."""
    if not path.exists():
        return ()
    return tuple(path.read_text(encoding="utf-8").splitlines())


class CountingGateway:
    """Wraps a ``ScriptedGateway``: logs each key sent, and each answer received."""

    def __init__(self, counts: Path, number: int) -> None:
        self.inner = ScriptedGateway(RESPONSES)
        self.sent = counts / f"pass{number}.sent"
        self.answered = counts / f"pass{number}.model"

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        append_line(self.sent, idempotency_key)
        response = await self.inner.complete(request, idempotency_key=idempotency_key)
        append_line(self.answered, idempotency_key)
        return response


def build_agent(tool_log: Path) -> Agent:
    """The demo agent: one tool, ``read``, that logs every execution to ``tool_log``."""

    @tool(idempotent=True)
    def read(path: str) -> str:
        """Read a file and return its text."""
        append_line(tool_log, path)
        return "hola"

    return Agent(instructions="Answer with what the file says.", tools=[read])


async def drive_pass(store_path: Path, counts: Path, number: int) -> str:
    """Drive the run once, in this process; how it ended: closed or already closed."""
    agent = build_agent(counts / f"pass{number}.tool")
    store = SqliteCheckpointer(store_path)
    ended = "not closed"
    try:
        session = Session(RUN_ID, CountingGateway(counts, number), store)
        async for step in agent.run(TASK, session=session):
            if isinstance(step, FinalStep):
                ended = "already closed" if step.replayed else "closed"
    finally:
        await store.close()
    return ended


def child_main(store_path: Path, counts: Path, number: int) -> None:
    """Entry point of a pass's child process: prints how the pass ended, as JSON."""
    ended = asyncio.run(drive_pass(store_path, counts, number))
    print(json.dumps({"ended": ended}), flush=True)


def run_pass(store_path: Path, counts: Path, number: int, crash_at: str | None) -> PassResult:
    """Run one pass in a new child process and read what it did."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if crash_at:
        env[ENV_VAR] = crash_at
    argv = [sys.executable, "-m", "asiento", "demo-pass", str(store_path), str(counts), str(number)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    return PassResult(
        number=number,
        model_calls=len(read_lines(counts / f"pass{number}.model")),
        tool_calls=len(read_lines(counts / f"pass{number}.tool")),
        ended=_ending(proc),
        keys_sent=read_lines(counts / f"pass{number}.sent"),
    )


def _ending(proc: subprocess.CompletedProcess[str]) -> str:
    if proc.returncode == -signal.SIGKILL:
        return KILLED
    if proc.returncode == 0:
        try:
            return str(json.loads(proc.stdout.strip().splitlines()[-1])["ended"])
        except (ValueError, IndexError, KeyError):
            return "exit 0 without a report"
    last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
    return f"exit {proc.returncode}: {last}"


def run_passes(store_path: Path, counts: Path) -> list[PassResult]:
    """The three passes of the seed, each in its own process."""
    return [
        run_pass(store_path, counts, 1, CRASH_AT),
        run_pass(store_path, counts, 2, None),
        run_pass(store_path, counts, 3, None),
    ]


def check(results: list[PassResult]) -> list[str]:
    """Every way the measured passes differ from the guarantee (empty when it holds)."""
    problems = []
    for result, (model, tools, ended) in zip(results, EXPECTED, strict=True):
        got = (result.model_calls, result.tool_calls, result.ended)
        if got != (model, tools, ended):
            problems.append(
                f"pass {result.number}: measured model ×{got[0]} · tool ×{got[1]} · {got[2]}; "
                f"expected model ×{model} · tool ×{tools} · {ended}"
            )
    killed, resumed = results[0].keys_sent[-1:], results[1].keys_sent[:1]
    if not killed or killed != resumed:
        problems.append(
            f"pass 2 asked with key {resumed}, the request killed in pass 1 had key {killed}"
        )
    return problems


def render(results: list[PassResult], problems: list[str], store: Path, console: Console) -> None:
    """Print the seed's table with the measured figures, then the verdict."""
    from rich import box
    from rich.table import Table

    table = Table(
        title=f"run {RUN_ID!r} · task {TASK!r}",
        caption="model calls: answers received; tool calls: executions (counted by each process)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1, 0, 0),  # narrow enough that no note wraps at 80 columns
    )
    for heading in ("pass", "model\ncalls", "tool\ncalls", "how it ended", "note"):
        table.add_column(heading, no_wrap=heading != "note")
    for result, note in zip(results, NOTES, strict=True):
        table.add_row(
            str(result.number),
            str(result.model_calls),
            str(result.tool_calls),
            result.ended,
            note,
        )
    console.print(table)
    console.print(_keys_line(results), highlight=False)
    for problem in problems:
        console.print(f"[bold red]MISMATCH[/] {problem}", highlight=False)
    if not problems:
        console.print(GUARANTEE, highlight=False)


def _keys_line(results: list[PassResult]) -> str:
    killed, resumed = results[0].keys_sent[-1:], results[1].keys_sent[:1]
    if not killed or not resumed:
        return "No model request to compare between pass 1 and pass 2."
    same = "the same key" if killed == resumed else f"a DIFFERENT key, {resumed[0]}"
    return (
        f"Pass 1 was killed inside the model request with key {killed[0]}; "
        f"pass 2 asked again with {same}, so a provider that honours keys bills it once."
    )


def run_demo(store: Path | None, keep: bool, console: Console) -> int:
    """Run the demo on ``store`` (a fresh temporary file by default); the exit status."""
    workdir = Path(tempfile.mkdtemp(prefix="asiento-demo-"))
    store_path = store if store is not None else workdir / "runs.db"
    counts = workdir / "counts"
    counts.mkdir()
    try:
        results = run_passes(store_path, counts)
        problems = check(results)
        render(results, problems, store_path, console)
    finally:
        kept = store is None and keep
        shutil.rmtree(counts if kept else workdir, ignore_errors=True)
    if keep or store is not None:
        console.print(f"The journal is kept at {store_path}", highlight=False)
    return 1 if problems else 0
