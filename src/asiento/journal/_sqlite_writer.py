"""Group commit: the appends that are ready in one turn of the event loop share one commit.

Many runs driven on one event loop (a concurrent worker, or ``asyncio.gather`` of
``agent.run``) each reach their next append in the same turn of the loop. Instead
of one transaction (one fsync) each, the first append of a turn yields once, so
that every task ready in that turn can queue its append, then commits them all. The
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

    def __init__(
        self, commit: Callable[[list[T]], list[Outcome]], commit_one: Callable[[T], None]
    ) -> None:
        self._commit, self._commit_one = commit, commit_one
        self._pending: list[tuple[T, asyncio.Future[None]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # Whether other runs are writing now: the last batch's size, the last writer.
        self._last_size = 1
        self._last_run: str | None = None

    async def submit(self, item: T, *, run_id: str) -> None:
        """Return once ``item`` is durable, or raise exactly the error of its own write.

        The first append of a turn leads: while other runs write on this store (the
        last batch held several appends, or the last append was another run's), it
        yields once, so that every task ready in this turn can queue its append, then
        commits the batch itself; a run writing alone commits at once, as before. A
        caller cancelled while it waits sees ``CancelledError``; its append still
        commits (or fails) with its batch, as an append cut by a crash may or may not
        have been recorded.
        """
        if not self._pending and self._last_size == 1 and self._last_run == run_id:
            self._commit_one(item)  # alone, as the last time: at once, raising its own error
            return
        loop = asyncio.get_running_loop()
        if self._pending and self._loop is not loop:
            # Appends left by a loop that stopped before its flush ran: none of them
            # returned, so nothing was promised for them; their loop will not resume.
            self._pending = []
        done: asyncio.Future[None] = loop.create_future()
        if self._pending:
            self._pending.append((item, done))
            await done
            return
        self._loop = loop
        self._pending.append((item, done))
        try:
            await asyncio.sleep(0)
        except BaseException:  # cancelled: the batch it leads is committed all the same
            done.cancel()
            self._flush()
            raise
        self._last_run = run_id
        self._flush()
        done.result()

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        self._last_size = len(batch)
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
