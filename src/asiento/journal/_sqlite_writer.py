"""Group commit: the appends that are ready in one turn of the event loop share one commit.

Many runs driven on one event loop (a concurrent worker, or ``asyncio.gather`` of
``agent.run``) each reach their next append in the same turn of the loop. Instead
of one transaction (one fsync) each, the first append of a turn schedules one
flush for the end of that turn; every append queued until then joins it. The
commit function decides how a batch is written (one SAVEPOINT per append); this
module only queues the appends and hands each caller its own outcome, and an
append returns only once its batch has committed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

# What the commit function returns for each append of a batch: None (durable) or its error.
Outcome = BaseException | None


class GroupCommit(Generic[T]):
    """Queue appends for the end of the current loop turn, then commit them together."""

    def __init__(self, commit: Callable[[list[T]], list[Outcome]]) -> None:
        self._commit = commit
        self._pending: list[tuple[T, asyncio.Future[None]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit(self, item: T) -> None:
        """Return once ``item`` is durable, or raise exactly the error of its own write.

        A caller cancelled while it waits sees ``CancelledError``; its append still
        commits (or fails) with its batch, as an append cut by a crash may or may not
        have been recorded.
        """
        loop = asyncio.get_running_loop()
        if self._pending and self._loop is not loop:
            # Appends left by a loop that stopped before its flush ran: none of them
            # returned, so nothing was promised for them; their loop will not resume.
            self._pending = []
        if not self._pending:
            self._loop = loop
            loop.call_soon(self._flush)
        done: asyncio.Future[None] = loop.create_future()
        self._pending.append((item, done))
        await done

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            outcomes = self._commit([item for item, _ in batch])
        except BaseException as exc:  # KeyboardInterrupt and the like: no append returns
            for _, done in batch:
                if not done.done():
                    done.set_exception(exc)
            raise
        for (_, done), outcome in zip(batch, outcomes, strict=True):
            if done.done():  # its caller was cancelled: the outcome is the journal's now
                continue
            if outcome is None:
                done.set_result(None)
            else:
                done.set_exception(outcome)
