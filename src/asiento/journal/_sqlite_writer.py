"""Off the event loop: the SQLite store's connection works on a thread of its own.

Many runs driven on one event loop (a concurrent worker, or ``asyncio.gather`` of
``agent.run``) must not wait for each other's commits: a commit that fsyncs, or
waits for another process's lock, would hold the loop, and with it every run's
steps and lease renewals. So the store's work runs on ``StoreThread``, which owns
the connection while it works; the loop only queues work and awaits its outcome.
When nobody else is using the connection (one run, writing alone), the work runs
at once on the caller's thread instead: the hop between threads would cost more
than the work saves.

Group commit: the appends that are ready in one turn of the loop share one commit
(``GroupCommit``), and the batches that queued while the thread was committing the
previous one are merged into the next transaction, so the more runs write at once,
the fewer commits (fsyncs) a step costs. The commit function decides how a batch is
written (one SAVEPOINT per append); this module only queues, merges, and hands each
caller its own outcome. An append returns only once its batch has committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

# What the commit function returns for each append of a batch: None (durable) or its error.
Outcome = BaseException | None

# At most this many appends in one merged transaction: a bound on one commit's time, and
# so on the wait of a renewal queued behind it.
_MERGE_LIMIT = 256


@dataclass(slots=True)
class _Call:
    """A call to run on the store's thread; its outcome goes to ``future`` on ``loop``."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


@dataclass(slots=True)
class _Batch:
    """Appends to commit together; each outcome goes to its own future."""

    commit: Callable[[list[Any]], list[Outcome]]
    items: list[Any]
    futures: list[asyncio.Future[None]]
    loop: asyncio.AbstractEventLoop
    on_done: Callable[[int], None] = field(default=lambda size: None)


_STOP = object()
_threads: weakref.WeakSet[StoreThread] = weakref.WeakSet()


class StoreThread:
    """The thread a store's connection works on; ``call`` runs one piece of work there.

    ``lock`` is the connection's: whoever uses it holds it, this thread or a caller
    running at once. The thread takes its next work only while holding it, so work
    run at once never overtakes work queued before it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._reset()
        _threads.add(self)

    def _reset(self) -> None:
        self.lock = threading.Lock()
        self._ready = threading.Condition()
        self._jobs: deque[_Call | _Batch | object] = deque()
        self._thread: threading.Thread | None = None

    async def call(self, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)`` on the connection: at once if it is free, else on the thread.

        For work that cannot wait for a lock or the disk for long: reads (WAL readers
        never wait for writers), and the append of a run writing alone.
        """
        if self.lock.acquire(blocking=False):
            try:
                if not self._jobs:
                    return fn(*args)
            finally:
                self.lock.release()
        return await self.send(fn, *args)

    async def send(self, fn: Callable[..., R], *args: Any, urgent: bool = False) -> R:
        """``fn(*args)`` on the thread: a write, which may wait for a lock or an fsync.

        ``urgent`` work (a lease renewal: one small statement that must not wait behind
        a queue of commits) goes ahead of the work queued, behind the work running.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._put(_Call(fn, args, loop, future), urgent=urgent)
        return await future

    def commit(self, batch: _Batch, *, urgent: bool = False) -> None:
        """Queue ``batch``; it is committed (merged with those queued beside it) whatever
        becomes of its callers: once queued, an append's fate is the journal's."""
        self._put(batch, urgent=urgent)

    async def together(
        self, commit: Callable[[list[Any]], list[Outcome]], item: Any, *, urgent: bool = False
    ) -> None:
        """``item`` through ``commit``, with the items of the same kind queued beside it
        (lease renewals: all that are due in one transaction)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self.commit(_Batch(commit, [item], [done], loop), urgent=urgent)
        await done

    def stop(self) -> None:
        """End the thread once the work queued before is done."""
        if self._thread is not None:
            self._put(_STOP)

    def _put(self, job: _Call | _Batch | object, *, urgent: bool = False) -> None:
        with self._ready:
            if urgent:
                self._jobs.appendleft(job)
            else:
                self._jobs.append(job)
            self._ready.notify()
            if self._thread is None and job is not _STOP:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._jobs:
                    self._ready.wait()
            with self.lock:
                with self._ready:
                    job = self._jobs.popleft()
                    if job is _STOP:
                        self._thread = None
                        return
                    if isinstance(job, _Batch):
                        job = self._merged(job)
                if isinstance(job, _Call):
                    self._run(job)
                elif isinstance(job, _Batch):
                    self._commit(job)

    def _merged(self, first: _Batch) -> _Batch:
        """``first`` and the batches queued right behind it, one transaction's worth."""
        while self._jobs and len(first.items) < _MERGE_LIMIT:
            nxt = self._jobs[0]
            if (
                not isinstance(nxt, _Batch)
                or nxt.commit != first.commit
                or nxt.loop is not first.loop
            ):
                break
            self._jobs.popleft()
            first = _Batch(
                first.commit,
                first.items + nxt.items,
                first.futures + nxt.futures,
                first.loop,
                first.on_done,
            )
        return first

    @staticmethod
    def _run(job: _Call) -> None:
        try:
            result = job.fn(*job.args)
        except BaseException as exc:
            _deliver(job.loop, _settle, job.future, None, exc)
        else:
            _deliver(job.loop, _settle, job.future, result, None)

    @staticmethod
    def _commit(job: _Batch) -> None:
        try:
            outcomes: list[Outcome] = job.commit(job.items)
        except BaseException as exc:  # no append of the batch is recorded
            outcomes = [exc] * len(job.items)
        _deliver(job.loop, _settle_all, job, outcomes)


def _deliver(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
        loop.call_soon_threadsafe(fn, *args)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():  # its caller was cancelled
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)


def _settle_all(job: _Batch, outcomes: list[Outcome]) -> None:
    job.on_done(len(job.items))
    for future, outcome in zip(job.futures, outcomes, strict=True):
        _settle(future, None, outcome)


def _after_fork() -> None:
    """A forked child has none of its parent's threads (and maybe a lock one held)."""
    for thread in list(_threads):
        thread._reset()


os.register_at_fork(after_in_child=_after_fork)


class GroupCommit(Generic[T]):
    """Queue appends for the end of the current loop turn, then commit them together."""

    def __init__(
        self,
        thread: StoreThread,
        commit: Callable[[list[T]], list[Outcome]],
        commit_one: Callable[[T], None],
    ) -> None:
        self._thread = thread
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
        hands the batch to the store's thread; a run writing alone commits at once,
        as before. A caller cancelled while it waits sees ``CancelledError``; its
        append still commits (or fails) with its batch, as an append cut by a crash
        may or may not have been recorded.
        """
        if not self._pending and self._last_size == 1 and self._last_run == run_id:
            await self._thread.call(self._commit_one, item)  # alone, as the last time
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
            self._flush(loop)
            raise
        self._last_run = run_id
        self._flush(loop)
        await done

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        self._last_size = len(batch)
        items, futures = [item for item, _ in batch], [done for _, done in batch]
        self._thread.commit(_Batch(self._commit, items, futures, loop, self._merged_size))

    def _merged_size(self, size: int) -> None:
        self._last_size = max(self._last_size, size)
