"""Deliberate bugs for the negative controls, planted in the harness's child only.

A campaign that cannot fail proves nothing. Each plant breaks one promise the
way a plausible regression would, by monkeypatching the child process at
start-up (never the library a user imports):

- ``no_write_ahead``: the loop never writes a tool's ``submitted`` record, so
  nothing on disk says an effect may have started before it starts.
- ``no_fencing``: the journal's ``append`` ignores the lease it is given, so a
  holder whose lease was taken over still writes.
- ``no_dir_fsync``: ``write_atomic`` renames without fsyncing the directory,
  so the rename itself would not survive a power cut.
- ``stale_status``: the loop writes its status (suspended, uncertain) as it saw
  it when it read the journal, unfenced, over a decision a person made since.
- ``unfenced_abandon``: abandoning writes the final record without taking the
  run's fence, so a session still driving the run goes on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

PLANTS = ("no_write_ahead", "no_fencing", "no_dir_fsync", "stale_status", "unfenced_abandon")


def plant(name: str, *, postgres: bool = False) -> None:
    """Apply one planted bug to this process."""
    if name not in PLANTS:
        raise ValueError(f"unknown plant {name!r}; known: {', '.join(PLANTS)}")
    planted: dict[str, Callable[[bool], None]] = {
        "no_write_ahead": _no_write_ahead,
        "no_fencing": _no_fencing,
        "no_dir_fsync": _no_dir_fsync,
        "stale_status": _stale_status,
        "unfenced_abandon": _unfenced_abandon,
    }
    planted[name](postgres)


def _no_write_ahead(postgres: bool) -> None:
    from .. import agent
    from ..events import Phase

    original: Callable[..., Any] = agent._Pass.record

    @functools.wraps(original)
    def record(self: Any, step_id: str, phase: Phase, payload: Any, decision: Any = None) -> Any:
        event = original(self, step_id, phase, payload, decision)
        if phase is Phase.SUBMITTED:
            self.pending.remove(event)  # the bug: the effect starts with no write-ahead
        return event

    agent._Pass.record = record  # type: ignore[method-assign,assignment]


def _no_fencing(postgres: bool) -> None:
    from ..journal.sqlite import SqliteCheckpointer

    classes: list[type[Any]] = [SqliteCheckpointer]
    if postgres:
        from ..journal.postgres import PostgresCheckpointer

        classes.append(PostgresCheckpointer)
    for cls in classes:
        original = cls.append

        async def append(self: Any, *events: Any, _original: Any = original, **kw: Any) -> None:
            lease, release = kw.pop("lease", None), kw.pop("release", None)
            await _original(self, *events, **kw)  # the bug: the fencing token is never checked
            if lease is not None and release is not None:  # the closing append's release
                await self.release(lease, savings=release)

        cls.append = append


def _no_dir_fsync(postgres: bool) -> None:
    from ..effects import files

    def skip(directory: Any) -> None:
        """The bug: the rename is left in the page cache."""

    files._fsync_directory = skip


def _stale_status(postgres: bool) -> None:
    from .. import agent
    from ..events import Phase, RunStatus

    async def wait_for(
        self: Any, status: RunStatus, step_id: str, phase: Phase, reason: str | None = None
    ) -> None:
        await self.store.set_status(self.run_id, status)  # the bug: no fence, no condition

    agent._Pass.wait_for = wait_for  # type: ignore[method-assign]


def _unfenced_abandon(postgres: bool) -> None:
    from .. import decisions, step_ids
    from ..events import Phase, RunStatus, StepEvent

    async def abandon(store: Any, run_id: str, *, by: str, reason: str) -> StepEvent:
        text = f"abandoned by {by}: {reason}"
        payload = {"step": "abandoned", "text": text, "abandoned": True, "by": by}
        event = StepEvent(
            run_id=run_id, step_id=step_ids.FINAL, phase=Phase.RESULT, payload=payload
        )
        await store.append(event, status=RunStatus.CLOSED)  # the bug: the fence stays
        return event

    from .. import cli

    decisions.abandon = abandon
    cli.abandon_run = abandon  # type: ignore[attr-defined]  # bound when cli was imported
