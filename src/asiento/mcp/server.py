"""Deduplicate MCP tool calls by the idempotency key asiento sends, for servers on the ``mcp`` SDK.

An asiento client puts its step's key in the ``tools/call`` request's ``_meta``
under ``"asiento/idempotency-key"``; the same key comes back on every retry and
resume of that step. ``IdempotencyKeys`` is a server middleware: the first call
under a key is recorded ``started`` in a SQLite file before the tool runs, and
its result after; a repeated key is answered from the file without running the
tool again. The answers a call can get (see docs/mcp-servers.md):

- the tool's own result, the first time;
- the recorded result, marked ``_meta["asiento/replayed"] = true``;
- an error result with ``_meta["asiento/outcome"]``: ``"in-progress"`` (the
  first call still runs), ``"unknown"`` (it started and never recorded a result:
  its process died or it was cancelled), ``"conflict"`` (the key was first used
  with other arguments: the client's fault) or ``"bad-key"`` (not a usable key).

A call without the key runs as if the middleware were not there.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping
from datetime import timedelta
from typing import Any

import anyio
import anyio.to_thread
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.shared.exceptions import MCPError, UrlElicitationRequiredError
from mcp_types import INTERNAL_ERROR, CallToolResult, TextContent

from asiento._canonical import fingerprint
from asiento._names import names
from asiento.errors import UsageError
from asiento.mcp._calls import CallKey, CallTable, Seen
from asiento.mcp._keys import (
    BAD_KEY,
    CONFLICT,
    IDEMPOTENCY_KEY,
    IN_PROGRESS,
    OUTCOME,
    REPLAYED,
    UNKNOWN,
)

# The names in ``_meta`` that both ends of the protocol read: one home.
# The names both ends agree on live in ``_keys``; these are the server's names for them.
KEY_META = IDEMPOTENCY_KEY
REPLAYED_META = REPLAYED
OUTCOME_META = OUTCOME

MAX_KEY_LENGTH = 1024
_log = logging.getLogger(__name__)


class IdempotencyKeys:
    """A server middleware that runs a keyed tool call at most once per key.

    ``IdempotencyKeys(path, ttl=...)`` keeps its records in the SQLite file at
    ``path`` (created if missing; several server processes may share it). ``ttl``
    (seconds or a timedelta) is how long a key is remembered: it must be at least
    the TTL the client declares for the tool. ``tools`` limits deduplication to
    those tool names (default: every tool). ``lease`` is how long a running call
    counts as running after its process stops renewing it, where the process
    cannot be seen to be dead (another host or PID namespace). ``scope``, given
    the request's context, names whose keys these are (a tenant, an OAuth client
    id): keys are compared only within one scope. Without it every client shares
    one space of keys.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        ttl: float | timedelta,
        tools: Collection[str] | None = None,
        lease: float | timedelta = 30.0,
        scope: Callable[[ServerRequestContext[Any, Any]], str] | None = None,
    ) -> None:
        self._tools = None if tools is None else names(tools, where="IdempotencyKeys(tools=...)")
        self._calls = CallTable(path, ttl=_seconds("ttl", ttl), lease=_seconds("lease", lease))
        self._renewer = _Renewer(self._calls)
        self._scope = scope

    async def __call__(
        self, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        """Answer a keyed ``tools/call`` at most once; pass everything else through."""
        call = _keyed_call(ctx.method, ctx.params)
        if call is None or (self._tools is not None and call.tool not in self._tools):
            return await call_next(ctx)
        if not isinstance(call.key, str) or not 0 < len(call.key) <= MAX_KEY_LENGTH:
            return _refusal(BAD_KEY, _bad_key(call.key))
        name = CallKey(self._scope_of(ctx), call.key)
        seen = await self._claim(name, call)
        if seen.verdict == "run":
            return await self._run(name, ctx, call_next)
        return _answer(seen, call)

    def close(self) -> None:
        """Stop renewing leases (calls still running count as running until theirs expire)."""
        self._renewer.stop()

    def _scope_of(self, ctx: ServerRequestContext[Any, Any]) -> str:
        if self._scope is None:
            return ""
        scope = self._scope(ctx)
        if not isinstance(scope, str):
            raise UsageError(
                f"IdempotencyKeys(scope=...) must return a str, got {type(scope).__name__}: "
                "the server's to fix; the tool did not run"
            )
        return scope

    async def _claim(self, name: CallKey, call: _Call) -> Seen:
        """Claim the key, shielded: a claim made must reach ``_run``, which closes it."""
        try:
            with anyio.CancelScope(shield=True):
                seen = await anyio.to_thread.run_sync(
                    self._calls.claim, name, call.tool, call.fingerprint
                )
        except Exception as exc:
            raise MCPError(
                code=INTERNAL_ERROR,
                message=f"asiento could not record the call in {str(self._calls.path)!r} ({exc}); "
                "the tool did not run: retry with the same key",
            ) from exc
        return seen

    async def _run(
        self, name: CallKey, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        """Run the tool once under a renewed lease and record how it ended."""
        self._renewer.start()
        try:
            result = _wire(await call_next(ctx))
        except (MCPError, UrlElicitationRequiredError):
            # A protocol answer (an unknown tool, input to ask for): the tool did not act.
            await _shielded(self._calls.release, name)
            raise
        except BaseException:
            await _shielded(self._calls.interrupt, name)
            raise
        if result.get("resultType") == "input_required":
            await _shielded(self._calls.release, name)  # it asks for input: no outcome yet
            return result
        await self._record(name, result)
        return result

    async def _record(self, name: CallKey, result: dict[str, Any]) -> None:
        try:
            await _shielded(self._calls.finish, name, result)
        except Exception:
            # The client still gets the result; a retry under the key hears "unknown".
            _log.exception("asiento could not record the result of key %r", name.key)


class _Call:
    """The parts of a ``tools/call`` request deduplication needs."""

    __slots__ = ("arguments", "fingerprint", "key", "tool")

    def __init__(self, tool: str, arguments: Mapping[str, Any], key: object) -> None:
        self.tool = tool
        self.arguments = arguments
        self.key: Any = key
        self.fingerprint = fingerprint({"tool": tool, "arguments": dict(arguments)})


def _keyed_call(method: str, params: Mapping[str, Any] | None) -> _Call | None:
    """The call, when it is a well-formed ``tools/call`` carrying the key; else None."""
    if method != "tools/call" or params is None:
        return None
    meta, tool, arguments = params.get("_meta"), params.get("name"), params.get("arguments")
    if not isinstance(meta, Mapping) or KEY_META not in meta or not isinstance(tool, str):
        return None
    if arguments is not None and not isinstance(arguments, Mapping):
        return None  # malformed: the SDK rejects it before any tool runs
    return _Call(tool, arguments or {}, meta[KEY_META])


def _answer(seen: Seen, call: _Call) -> HandlerResult:
    if seen.verdict == "replay" and seen.result is not None:
        meta = {**seen.result.get("_meta", {}), REPLAYED_META: True}
        return {**seen.result, "_meta": meta}
    if seen.verdict == "in-progress":
        return _refusal(
            IN_PROGRESS,
            f"the call under idempotency key {call.key!r} is still running; "
            "retry later with the same key",
        )
    if seen.verdict == "conflict":
        return _refusal(
            CONFLICT,
            f"idempotency key {call.key!r} was first used for tool {seen.tool!r} with other "
            "arguments; a key names one call: the client must send a new key for a new call",
        )
    return _refusal(
        UNKNOWN,
        f"the call under idempotency key {call.key!r} started and never recorded a result "
        "(its server process died or it was interrupted): whether its effect happened is "
        "unknown, and it is not run again",
    )


def _refusal(outcome: str, message: str) -> HandlerResult:
    """An error result: the tool did not run for this request, and why."""
    return CallToolResult(
        content=[TextContent(type="text", text=message)],
        is_error=True,
        _meta={OUTCOME_META: outcome},
    )


def _bad_key(key: object) -> str:
    return (
        f"_meta[{KEY_META!r}] must be a string of 1 to {MAX_KEY_LENGTH} characters, "
        f"got {type(key).__name__} of {len(key) if isinstance(key, str) else 'no'} length; "
        "the client's fault: the tool did not run"
    )


def _wire(result: HandlerResult) -> dict[str, Any]:
    """The result as the client receives it (a dict of wire names)."""
    if result is None:
        return {}
    if isinstance(result, dict):
        return dict(result)
    return result.model_dump(by_alias=True, mode="json", exclude_none=True)


async def _shielded(write: Any, *args: Any) -> None:
    """A record that must be written even while the request is being cancelled."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(write, *args)


def _seconds(name: str, value: float | timedelta) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds > 0:
        raise UsageError(f"IdempotencyKeys({name}=...) must be a positive duration, got {value!r}")
    return seconds


class _Renewer:
    """A thread that extends the leases of the calls this process runs, while it lives.

    A thread, not a task: a lease must not lapse because the event loop is busy,
    and it lapses when the process dies, which is what it is for.
    """

    def __init__(self, calls: CallTable) -> None:
        self._calls = calls
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stopped.clear()
                self._thread = threading.Thread(
                    target=self._loop, name="asiento-mcp-leases", daemon=True
                )
                self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _loop(self) -> None:
        while not self._stopped.wait(self._calls.lease / 3):
            try:
                self._calls.renew()
            except Exception:
                _log.exception("asiento could not renew MCP call leases in %s", self._calls.path)
