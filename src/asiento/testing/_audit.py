"""The fsync audit: watch the system calls of a clean run under strace.

A SIGKILL cannot lose a rename that is not yet on disk: the kernel keeps it.
Only a power cut (or a kernel crash) can, and a test cannot pull the plug. So
this audit checks the order of the system calls instead: every rename (what
``write_atomic``'s ``os.replace`` becomes) must be followed by an ``fsync`` of
the directory it happened in before the next commit of the journal (the
``fsync`` of the SQLite file or its WAL), i.e. before the step's result is
recorded. What it proves: on this code path, the durability order a power cut
needs is requested from the kernel. What it does not prove: that the file
system and the disk honour it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ._drive import drive
from ._server import HarnessError, run_once
from ._stores import sqlite_path
from .invariants import ToolInfo, Violation, check_run
from .report import Report

if TYPE_CHECKING:
    from .harness import CrashHarness

SYSCALLS = "trace=rename,renameat,renameat2,fsync,fdatasync"
_CALL = re.compile(r"^\d+\s+(rename|renameat2?|fsync|fdatasync)\((.*)$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_FD_PATH = re.compile(r"^\d+<([^>]*)>")
_CWD = re.compile(r"AT_FDCWD<([^>]*)>")


@dataclass(frozen=True, slots=True)
class Call:
    """One system call of interest: a rename (its target) or an fsync (its file)."""

    kind: str  # "rename" or "fsync"
    path: str


def parse(trace: str) -> list[Call]:
    """The renames and fsyncs of an ``strace -f -y`` log, in order."""
    calls = []
    for line in trace.splitlines():
        match = _CALL.match(line)
        if match is None or "resumed>" in line:
            continue
        name, rest = match.groups()
        if name.startswith("rename"):
            target = _rename_target(rest)
            if target is not None and (" = 0" in rest or "<unfinished" in rest):
                calls.append(Call("rename", target))
        else:
            fd = _FD_PATH.match(rest)
            if fd is not None:
                calls.append(Call("fsync", fd.group(1)))
    return calls


def _rename_target(args: str) -> str | None:
    quoted: list[str] = _QUOTED.findall(args)
    if len(quoted) < 2:
        return None
    target = quoted[-1]
    if not target.startswith("/"):
        cwd: list[str] = _CWD.findall(args)
        if not cwd:
            return None
        target = os.path.join(cwd[-1], target)
    return os.path.normpath(target)


def unsynced_renames(calls: list[Call], journal: Path) -> tuple[int, list[str]]:
    """How many renames were seen; those not followed by a directory fsync in time."""
    journal_files = {str(journal), f"{journal}-wal", f"{journal}-journal"}
    renames, found = 0, []
    for i, call in enumerate(calls):
        if call.kind != "rename":
            continue
        renames += 1
        directory = os.path.dirname(call.path)
        for later in calls[i + 1 :]:
            if later.kind == "fsync" and later.path == directory:
                break
            if later.kind == "fsync" and later.path in journal_files:
                found.append(f"{call.path} renamed, journal committed before {directory} fsynced")
                break
        else:
            found.append(f"{call.path} renamed, {directory} never fsynced")
    return renames, found


def fsync_audit(harness: CrashHarness) -> Report:
    if harness.backend != "sqlite":
        raise UsageError("the fsync audit reads the journal's commits from the trace: use SQLite")
    strace = shutil.which("strace")
    if strace is None:
        raise HarnessError("the fsync audit needs strace (apt-get install strace)")
    started = time.monotonic()
    report = Report("directory fsync audit", harness.backend)
    journal = sqlite_path(harness.store).resolve()
    driver = harness.driver("audit")
    traces: list[Path] = []

    def runner(cmd: Any) -> dict[str, Any]:
        trace = harness.workdir / f"{driver.run_id}.op{len(traces)}.strace"
        traces.append(trace)
        prefix = (strace, "-f", "-qq", "-y", "-e", SYSCALLS, "-o", str(trace))
        return run_once(harness.config(0), cmd, harness.env, harness.timeout, prefix)

    tools = _describe(harness)
    ended = drive(driver, runner, max_ops=harness.max_ops)
    report.violations += check_run(driver.history(ended=ended), tools)
    for trace in traces:
        renames, found = unsynced_renames(parse(trace.read_text()), journal)
        report.trials += renames
        report.violations += [Violation("dir_fsync", driver.run_id, m) for m in found]
    if not report.trials:
        report.notes.append("no rename happened: the app never wrote a file atomically")
    else:
        report.notes.append(f"{report.trials} renames audited in {len(traces)} traced processes")
    report.operations = len(driver.ops)
    report.seconds = time.monotonic() - started
    return report


def _describe(harness: CrashHarness) -> dict[str, ToolInfo]:
    reply = run_once(harness.config(0), {"op": "describe", "run": "describe"}, harness.env, 60)
    out = reply.get("out") or {}
    return {name: ToolInfo(**info) for name, info in out.get("tools", {}).items()}
