"""How an MCP tool's step is carried out: the key frozen in the intent, one call, reconcile.

- prepare: the step's idempotency key (``idem_key(run_id, step_id, arguments)``, as
  ``StepContext.idempotency_key`` gives it) is frozen in the intent; every attempt and
  every resume sends the same one in the call's ``_meta``.
- execute: one ``tools/call``. The server's answer (text, structured content, or
  ``isError``) is the step's outcome; a session that ended with the call in flight
  leaves the step submitted (``McpCallLost``).
- reconcile (submitted, no outcome, not idempotent): a key-honouring tool whose key
  is still live is called again with the same key, and the server's answer (the
  first call's result) is the outcome; an expired key, a server that says it cannot
  know, or a tool whose server does not deduplicate: ``UncertainEffect``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT, CallToolResult

from .. import outcomes
from .._canonical import idem_key
from .._described import described
from ..effects.base import IdempotencyKeyConflict, Reconcile, distrust_key, reconcile
from ..errors import AsientoError, McpCallLost, ToolAnswerLost, UsageError
from ..payloads import Intent, Outcome
from ..tools import Found, Reconciled, Tool, Unknown
from ._connection import LinkGone
from ._keys import CONFLICT, IN_PROGRESS, OUTCOME, UNKNOWN
from ._tool import McpTool

if TYPE_CHECKING:
    from ._source import McpServer

_POLL_FIRST, _POLL_MAX = 0.05, 1.0
R = TypeVar("R", bound="Answer | Outcome")


class McpRunner:
    """The runner of every tool of one ``McpServer``."""

    prepares: bool = False  # the key is a function of the step: intent and call share a commit

    def __init__(self, server: McpServer) -> None:
        self.server = server

    def prepare(self, tool: Tool, run_id: str, step_id: str, intent: Intent) -> Intent:
        return replace(intent, idem_key=idem_key(run_id, step_id, intent.args))

    async def execute(
        self,
        tool: Tool,
        intent: Intent,
        kwargs: Mapping[str, Any] | None,
        *,
        via: str,
        attempts: int,
    ) -> Outcome:
        """Call the tool once with the frozen key; only the server's answer is an outcome."""
        mcp_tool = _mcp(tool)
        answer = await self._answer(mcp_tool, intent)
        if isinstance(answer, Outcome):
            return answer
        _refuse_conflict(mcp_tool, answer, intent)
        if flag(answer) == UNKNOWN:
            if mcp_tool.idempotent:
                return Outcome.failed(_unknown_why(mcp_tool), attempts=attempts)
            raise McpCallLost(_unknown_why(mcp_tool))
        return _recorded(answer, via, attempts)

    async def reconcile(
        self, tool: Tool, intent: Intent, *, age: float | None, attempts: int
    ) -> Reconciled:
        """Submitted, no outcome: the same key again while it is live, else a person."""
        mcp_tool = _mcp(tool)
        treated = mcp_tool.treatment
        how = reconcile(
            honours_keys=treated.honours_keys,
            key_ttl=treated.key_ttl,
            has_lookup=False,
            age=age,
            key_margin=treated.key_margin,
        )
        if how is not Reconcile.REPUBLISH:
            return Unknown(_why_uncertain(mcp_tool, age))
        answer = await self._answer(mcp_tool, intent)
        if isinstance(answer, Outcome):
            return Found(replace(answer, attempts=attempts + 1))
        _refuse_conflict(mcp_tool, answer, intent)
        if flag(answer) == UNKNOWN:
            return Unknown(_unknown_why(mcp_tool))
        return Found(_recorded(answer, "republish", attempts + 1))

    async def _answer(self, tool: McpTool, intent: Intent) -> CallToolResult | Outcome:
        """The server's result for the frozen key, waiting while it says the first call
        still runs; a JSON-RPC error is the server's refusal, recorded as the outcome."""

        async def ask() -> CallToolResult | Outcome:
            try:
                result: CallToolResult = await self.server.call(
                    tool.remote_name, intent.args, str(intent.idem_key)
                )
            except LinkGone as exc:
                raise McpCallLost(_lost_why(tool, str(exc))) from None
            except MCPError as exc:
                if exc.code in (CONNECTION_CLOSED, REQUEST_TIMEOUT):
                    raise McpCallLost(_lost_why(tool, str(exc))) from None
                return Outcome.failed(f"the MCP server refused the call ({exc.code}): {exc}")
            except AsientoError:
                raise
            except Exception as exc:  # the client could not read the answer: a hostile server
                raise ToolAnswerLost(_unreadable_why(tool, exc)) from exc
            return result

        wait = self.server.in_progress_wait
        late = (
            f"MCP server {tool.server!r}: the first call of tool {tool.remote_name!r} "
            f"under key {intent.idem_key!r} was still running after {wait:g}s; resume the "
            "run later"
        )
        return await until_settled(ask, wait=wait, late=late)


async def until_settled(ask: Callable[[], Awaitable[R]], *, wait: float, late: str) -> R:
    """``ask()``'s first answer that is not the server's "the key's first call still
    runs", asking again with a growing pause; after ``wait`` seconds ``McpCallLost(late)``.
    An ``Outcome`` (a refusal the caller recorded) is an answer too."""
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + wait, _POLL_FIRST
    while True:
        answer = await ask()
        if isinstance(answer, Outcome) or flag(answer) != IN_PROGRESS:
            return answer
        if loop.time() + pause > deadline:
            raise McpCallLost(late)
        await asyncio.sleep(pause)
        pause = min(pause * 2, _POLL_MAX)


def _mcp(tool: Tool) -> McpTool:
    if not isinstance(tool, McpTool):
        raise UsageError(f"tool {tool.name!r} is not an MCP server's tool; its runner is its own")
    return tool


class Answer(Protocol):
    """A ``tools/call`` result as any MCP client gives it (the mcp SDK's, FastMCP's)."""

    @property
    def is_error(self) -> bool: ...
    @property
    def meta(self) -> Any: ...


def flag(result: Answer) -> Any:
    """What a deduplicating server says of the key's first call (``_meta``), if anything."""
    if not result.is_error or not isinstance(result.meta, Mapping):
        return None
    return result.meta.get(OUTCOME)


def _refuse_conflict(tool: McpTool, result: CallToolResult, intent: Intent) -> None:
    """A key the server saw with other arguments is never an outcome: a person looks."""
    if flag(result) == CONFLICT:
        raise IdempotencyKeyConflict(
            f"MCP server {tool.server!r} refused key {intent.idem_key!r} for tool "
            f"{tool.remote_name!r}: it was first used with other arguments ({_text(result)[:200]})"
        )


def _recorded(result: CallToolResult, via: str, attempts: int) -> Outcome:
    """The server's answer as the outcome the journal keeps."""
    if result.is_error:
        return Outcome.failed(_text(result) or "the tool reported an error", attempts=attempts)
    value = result.structured_content
    if value is None:
        value = _content(result)
    checked = outcomes.of_value(value)
    if checked.status != "ok":
        return checked
    return Outcome.published(checked.value, remote_id=None, via=via, attempts=attempts)


def _content(result: CallToolResult) -> Any:
    """The result's content: one string when it is all text, else the blocks as JSON."""
    blocks = result.content
    if all(getattr(b, "type", None) == "text" for b in blocks):
        return "\n".join(str(getattr(b, "text", "")) for b in blocks)
    return [b.model_dump(by_alias=True, exclude_none=True, mode="json") for b in blocks]


def _text(result: CallToolResult) -> str:
    return "\n".join(str(getattr(b, "text", "")) for b in result.content if hasattr(b, "text"))


def _lost_why(tool: McpTool, detail: str) -> str:
    return (
        f"MCP server {tool.server!r} went away with a call of tool {tool.remote_name!r} in "
        f"flight ({detail}); whether it happened is settled when the run is resumed"
    )


def _unreadable_why(tool: McpTool, exc: Exception) -> str:
    return (
        f"MCP server {tool.server!r} answered a call of tool {tool.remote_name!r} with a "
        f"result its client cannot read ({described(exc)}); the server may have applied it: "
        "the step stays submitted and is settled when the run is resumed"
    )


def _unknown_why(tool: McpTool) -> str:
    return (
        f"MCP server {tool.server!r} says it cannot know the outcome of the first call of "
        f"{tool.remote_name!r} under this step's key (it stopped during that call)."
    )


def _why_uncertain(tool: McpTool, age: float | None) -> str:
    treated = tool.treatment
    if treated.honours_keys:
        why = distrust_key(age=age, key_ttl=treated.key_ttl, key_margin=treated.key_margin)
        return f"{why} Its MCP server {tool.server!r} cannot be asked again under it."
    return (
        f"Its MCP server {tool.server!r} is not declared to deduplicate by key "
        "(McpServer(honours_keys=True, key_ttl=...) or a Treatment for the tool)."
    )
