"""The harness's ledgers: JSON lines that outlive any SIGKILL.

Every line is one ``write(2)`` on a file opened with ``O_APPEND``, followed by
``fsync`` before the writer goes on: a process killed at any instant leaves
either the whole line or none of it, and processes sharing a ledger never
interleave their lines.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import AsientoError

Line = dict[str, Any]


def append_line(path: str | os.PathLike[str], record: Line) -> None:
    """Append one JSON line with a single write, then fsync."""
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(f"short write to {path}")
        os.fsync(fd)
    finally:
        os.close(fd)


class TornLedger(AsientoError):
    """A ledger ends in half a line: something wrote it without the single-write rule."""


def read_lines(path: str | os.PathLike[str]) -> list[Line]:
    """Every line of a ledger (none if it does not exist); a torn last line is an error."""
    target = Path(path)
    if not target.exists():
        return []
    text = target.read_text()
    if text and not text.endswith("\n"):
        raise TornLedger(f"{target}: torn last line {text.splitlines()[-1]!r}")
    return [json.loads(line) for line in text.splitlines()]


def ledger_paths(workdir: str | os.PathLike[str], run_id: str) -> tuple[Path, Path]:
    """Where a run's effect ledger and model ledger live under the harness's workdir."""
    folder = Path(workdir) / "ledgers"
    return folder / f"{run_id}.effects.jsonl", folder / f"{run_id}.models.jsonl"
