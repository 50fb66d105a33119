"""One live client session with an MCP server, owned by a task of its own.

The SDK's client runs its transport in task groups bound to the task that entered
it; a server that dies cancels that task. So the session lives in a task of its own
(``_Link``) and callers hand it jobs: a dead server ends the link, never the
caller's task, and the next call opens a new one (the server's command started
again, or a new HTTP session).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from ..errors import AsientoError, McpServerUnavailable

log = logging.getLogger("asiento.mcp")

T = TypeVar("T")
Job = Callable[[Client], Awaitable[Any]]


class LinkGone(AsientoError):
    """The session ended (the server died, or the link was closed) before a job's answer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """Where a server is: a command to start (stdio) or a URL (Streamable HTTP)."""

    command: Sequence[str] = ()
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout: float | None = None

    def describe(self) -> str:
        return self.url if self.url is not None else " ".join(self.command)

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[Client]:
        """A connected client (its transport and handshake done), closed on exit."""
        if self.url is None:
            params = StdioServerParameters(
                command=self.command[0],
                args=list(self.command[1:]),
                env=dict(self.env) if self.env is not None else None,
                cwd=self.cwd,
            )
            async with Client(params, cache=None, read_timeout_seconds=self.timeout) as client:
                yield client
            return
        timeout = httpx2.Timeout(30.0, read=self.timeout or 300.0)
        async with httpx2.AsyncClient(headers=dict(self.headers), timeout=timeout) as http:
            transport = streamable_http_client(self.url, http_client=http)
            async with Client(transport, cache=None, read_timeout_seconds=self.timeout) as client:
                yield client


class Link:
    """A client session in its own task; ``run(job)`` hands it a job and waits for its answer."""

    def __init__(self, endpoint: Endpoint, label: str) -> None:
        self.endpoint, self.label = endpoint, label
        self._inbox: asyncio.Queue[tuple[Job, asyncio.Future[Any]] | None] = asyncio.Queue()
        self._waiting: set[asyncio.Future[Any]] = set()
        self._task: asyncio.Task[None] | None = None
        self.loop = asyncio.get_running_loop()

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def open(self, timeout: float) -> None:
        """Start the session; ``McpServerUnavailable`` when it cannot be started in time."""
        ready: asyncio.Future[None] = self.loop.create_future()
        self._task = self.loop.create_task(self._own(ready), name=f"asiento-mcp:{self.label}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), timeout)
        except Exception as exc:
            await self.close()
            raise McpServerUnavailable(
                f"MCP server {self.label!r} ({self.endpoint.describe()}) cannot be reached: "
                f"{describe(exc)}. Nothing was sent to it; start it (or fix its command, URL "
                "or headers) and try again"
            ) from None

    async def run(self, job: Job) -> Any:
        """The job's answer; ``LinkGone`` when the session ended first."""
        if not self.alive:
            raise LinkGone("the session has ended")
        answer: asyncio.Future[Any] = self.loop.create_future()
        self._waiting.add(answer)
        self._inbox.put_nowait((job, answer))
        try:
            return await answer
        finally:
            self._waiting.discard(answer)

    async def close(self) -> None:
        """End the session (a stdio server is stopped); jobs still waiting get ``LinkGone``."""
        task = self._task
        if task is None or task.done():
            return
        self._inbox.put_nowait(None)
        try:
            await asyncio.wait_for(asyncio.shield(task), 10.0)
        except (TimeoutError, asyncio.CancelledError):
            task.cancel()

    async def _own(self, ready: asyncio.Future[None]) -> None:
        try:
            async with self.endpoint.client() as client:
                ready.set_result(None)
                async with anyio.create_task_group() as jobs:
                    while (item := await self._inbox.get()) is not None:
                        jobs.start_soon(_serve, client, *item)
                    jobs.cancel_scope.cancel()
        except BaseException as exc:  # the session ended: say so to whoever waits
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else LinkGone(repr(exc)))
            log.info("MCP server %r: session ended: %s", self.label, describe(exc))
        finally:
            for answer in self._waiting:
                if not answer.done():
                    answer.set_exception(LinkGone("the session ended with the call in flight"))


async def _serve(client: Client, job: Job, answer: asyncio.Future[Any]) -> None:
    try:
        result = await job(client)
    except Exception as exc:  # the server's answer (an error), for the caller to judge
        if not answer.done():
            answer.set_exception(exc)
    except BaseException:  # the session is being torn down around the job
        if not answer.done():
            answer.set_exception(LinkGone("the session ended with the call in flight"))
        raise
    else:
        if not answer.done():
            answer.set_result(result)


def describe(exc: BaseException) -> str:
    """An error in words, the leaves of an exception group named one by one."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(e) for e in exc.exceptions)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
