"""``McpServer``: an MCP server as a source of asiento tools, over stdio or Streamable HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import mcp_types
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from ..errors import McpServerUnavailable, UsageError
from ..telemetry.tracing import step_traceparent
from ..tools import Tool
from ._annotations import Treatment, treatment
from ._connection import Endpoint, Job, Link, LinkGone
from ._keys import IDEMPOTENCY_KEY
from ._tool import McpTool, arguments_model

_MAX_PAGES = 100


class McpServer:
    """An MCP server whose tools an ``Agent`` may call, with asiento's guarantees.

    Give a ``command`` (started and spoken to over stdio) or a ``url`` (Streamable
    HTTP, with ``headers`` for auth). ``name`` labels it in errors and in the run's
    fingerprint. A server is untrusted unless ``trusted=True``: its annotations are
    then ignored and every tool is non-idempotent and destructive. ``treatments``
    sets a tool's treatment explicitly (by the server's name for it);
    ``honours_keys`` / ``key_ttl`` / ``key_margin`` declare that the server
    deduplicates every tool by the key in ``_meta`` (``asiento.mcp.server`` does).
    ``prefix`` goes before every tool's name, so two servers' tools cannot clash.

    Use it as ``async with McpServer(...) as server: tools = await server.tools()``;
    the session is opened on first use and again after the server died.
    """

    def __init__(
        self,
        name: str,
        *,
        command: Sequence[str] | None = None,
        url: str | None = None,
        headers: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        trusted: bool = False,
        treatments: Mapping[str, Treatment] | None = None,
        honours_keys: bool = False,
        key_ttl: float | None = None,
        key_margin: float | None = None,
        prefix: str = "",
        connect_timeout: float = 30.0,
        call_timeout: float | None = None,
        in_progress_wait: float = 30.0,
    ) -> None:
        if (command is None) == (url is None):
            raise UsageError(f"McpServer({name!r}) takes a command or a url, exactly one")
        if command is not None and (isinstance(command, str) or not command):
            raise UsageError(f"McpServer({name!r}, command=...) takes a list: [program, *args]")
        self.name, self.trusted, self.prefix = name, trusted, prefix
        self.endpoint = Endpoint(
            command=tuple(command or ()),
            env=env,
            cwd=cwd,
            url=url,
            headers=dict(headers or {}),
            timeout=call_timeout,
        )
        self.treatments = dict(treatments or {})
        self.keys = Treatment(honours_keys=honours_keys, key_ttl=key_ttl, key_margin=key_margin)
        self.connect_timeout, self.in_progress_wait = connect_timeout, in_progress_wait
        self._link: Link | None = None
        self._opening: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    async def __aenter__(self) -> McpServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """End the session (a stdio server is stopped). Using the server again reopens it."""
        link, self._link = self._link, None
        if link is not None:
            await link.close()

    async def tools(self) -> list[Tool]:
        """The server's tools as asiento tools; ``McpServerUnavailable`` if it is down."""
        listed = await self._list()
        known = {t.name for t in listed}
        unknown = sorted(set(self.treatments) - known)
        if unknown:
            raise UsageError(
                f"McpServer({self.name!r}, treatments=...) names tools the server does not "
                f"list: {unknown}; it lists {sorted(known)}"
            )
        return [self._as_tool(t) for t in listed]

    async def call(self, remote_name: str, arguments: Mapping[str, Any], key: str) -> Any:
        """``tools/call`` with ``key`` in its ``_meta`` (and, in a traced run, the
        ``execute_tool`` span's ``traceparent`` / ``tracestate``), on a session checked
        alive first.

        The probe before the call (``_probe``) finds a server that died since the last
        call while nothing is sent yet: the session is opened again, or
        ``McpServerUnavailable``.
        """
        link = await self._live()
        try:
            await link.run(_probe)
        except (LinkGone, MCPError):
            await self.aclose()
            link = await self._live()
        # The step's trace context beside its key, as the MCP tracing convention has it.
        traced = step_traceparent()
        meta: Any = {IDEMPOTENCY_KEY: key, **traced}

        def job(client: Client) -> Awaitable[Any]:
            return client.call_tool(remote_name, dict(arguments), meta=meta)

        return await link.run(_under(traced, job) if traced else job)

    async def _live(self) -> Link:
        """The session, opened (again) when there is none, it ended, or it is another loop's."""
        loop = asyncio.get_running_loop()
        if self._opening is None or self._opening[0] is not loop:
            self._opening = (loop, asyncio.Lock())
        async with self._opening[1]:
            link = self._link
            if link is None or not link.alive or link.loop is not loop:
                link = Link(self.endpoint, self.name)
                self._link = None
                await link.open(self.connect_timeout)
                self._link = link
            return link

    async def _list(self) -> list[mcp_types.Tool]:
        link = await self._live()
        listed: list[mcp_types.Tool] = []
        cursor: str | None = None
        try:
            for _ in range(_MAX_PAGES):
                page: mcp_types.ListToolsResult = await link.run(_lister(cursor))
                listed.extend(page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    return listed
        except (LinkGone, MCPError) as exc:
            raise McpServerUnavailable(
                f"MCP server {self.name!r} ({self.endpoint.describe()}) did not list its tools: "
                f"{exc}; nothing was sent to it"
            ) from None
        raise McpServerUnavailable(
            f"MCP server {self.name!r} lists tools over more than {_MAX_PAGES} pages"
        )

    def _as_tool(self, listed: mcp_types.Tool) -> McpTool:
        from ._runner import McpRunner

        annotations = (
            None
            if listed.annotations is None
            else listed.annotations.model_dump(by_alias=True, exclude_none=True, mode="json")
        )
        treated = self.treatments.get(listed.name)
        if treated is None:
            mapped = treatment(annotations, trusted=self.trusted)
            keys = self.keys
            treated = dataclasses.replace(
                mapped,
                honours_keys=keys.honours_keys,
                key_ttl=keys.key_ttl,
                key_margin=keys.key_margin,
            )
        return McpTool(
            name=self._model_name(listed.name),
            description=listed.description or listed.title or "",
            idempotent=treated.idempotent,
            fn=_outside_a_run,
            arguments_model=arguments_model(),
            runner=McpRunner(self),
            input_schema=listed.input_schema,
            server=self.name,
            remote_name=listed.name,
            treatment=treated,
            listed={"annotations": annotations, "outputSchema": listed.output_schema},
        )

    def _model_name(self, remote: str) -> str:
        """The name the model calls it by: the prefix, then the server's name made fit."""
        name = self.prefix + re.sub(r"[^A-Za-z0-9_-]", "_", remote)
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise UsageError(
                f"MCP server {self.name!r}: tool {remote!r} gives the name {name!r}, which a "
                "model cannot call (1-64 letters, digits, _ or -); use a shorter prefix"
            )
        return name


def _under(carrier: Mapping[str, str], job: Job) -> Job:
    """``job`` run under the step's trace context as OpenTelemetry's current one.

    The MCP SDK writes the current context into ``_meta`` itself (its own span's, when an
    SDK is set up); the job runs in the session's task, where none would be current and
    the call would start a trace of its own. Under the step's, it stays in the run's.
    """

    async def traced(client: Client) -> Any:
        from opentelemetry import context as otel_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        token = otel_context.attach(TraceContextTextMapPropagator().extract(carrier))
        try:
            return await job(client)
        finally:
            otel_context.detach(token)

    return traced


async def _probe(client: Client) -> object:
    """One request that changes nothing: ``server/discover`` (``ping`` before 2026-07-28)."""
    version = client.protocol_version
    if version in MODERN_PROTOCOL_VERSIONS:  # ``discover()`` answers from its cache
        return await client.session.send_discover(version)
    return await client.session.send_ping()


def _lister(cursor: str | None) -> Callable[[Client], Awaitable[mcp_types.ListToolsResult]]:
    """The job that lists one page of tools (from ``cursor``)."""

    def job(client: Client) -> Awaitable[mcp_types.ListToolsResult]:
        return client.list_tools(cursor=cursor)

    return job


def _outside_a_run(**kwargs: Any) -> Any:
    raise UsageError("an MCP tool is called by an Agent's run, through its runner")
