"""MCP toolsets in a durable Pydantic AI run: the step's key in every call, and reconcile.

Each ``MCPToolset`` leaf of the agent's toolsets is wrapped for the pass
(``keyed_toolset``, by ``visit_and_replace``, as Pydantic AI's Temporal and DBOS
backends wrap theirs) in ``_KeyedMcp``, whose ``call_tool`` sends the step's
idempotency key in the request's ``_meta`` (``asiento/idempotency-key``). The key
comes from the tool step through a contextvar (``_CALL``), so runs sharing one agent
never see each other's; the user's own ``process_tool_call`` hook still runs, and
the key is merged into the metadata it passes on. ``_KeyedMcp`` calls the tool as
``MCPToolset.call_tool`` does (the hook around ``direct_call_tool``), with public API
only, and leaves the agent's toolsets unchanged.

A step submitted with no outcome, on a toolset declared to honour keys (``honours``:
toolset id -> key TTL), is reconciled: the same call, with the same key while the key
is live, answered by the server's record (``reconcile_call``). The rules are
``asiento.mcp``'s and ``asiento.effects.base``'s: the same flags, the same live-key
test.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from fastmcp.exceptions import ToolError
from pydantic_ai import RunContext
from pydantic_ai.exceptions import ModelRetry, ToolFailed
from pydantic_ai.mcp import MCPToolset, ToolResult
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset

from ..effects.base import IdempotencyKeyConflict, Reconcile, distrust_key, reconcile
from ..errors import AsientoError, UsageError
from ..mcp._keys import CONFLICT, IDEMPOTENCY_KEY, REPLAYED, UNKNOWN
from ..mcp._runner import flag, until_settled
from ..telemetry.tracing import step_traceparent

IN_PROGRESS_WAIT = 30.0  # seconds a reconcile waits while the server says the first call runs


@dataclass
class _Call:
    """The MCP call of one tool step: its key, and whether it is a reconcile."""

    key: str
    reconciling: bool = False
    replayed: bool = False  # the server answered from its record (set by a reconcile)


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "asiento_pydantic_ai_mcp_call", default=None
)


class NotReconciled(AsientoError):
    """The step's MCP call could not be settled by calling again: why, for UncertainEffect."""


def mcp_leaf(tool: ToolsetTool[Any] | None) -> MCPToolset[Any] | None:
    """The MCP toolset a tool's calls reach, through the wrappers that list it (prefixed,
    renamed, filtered); None when another kind of toolset stands between."""
    toolset: AbstractToolset[Any] | None = tool.toolset if tool is not None else None
    for _ in range(64):  # a chain of wrappers, never a cycle
        if isinstance(toolset, MCPToolset):
            return toolset
        if not isinstance(toolset, WrapperToolset):
            return None
        toolset = toolset.wrapped
    return None


def keyed_toolset(toolset: AbstractToolset[Any], keyed: set[int]) -> AbstractToolset[Any]:
    """``toolset`` with each of its MCP leaves wrapped in ``_KeyedMcp``; ``keyed`` gets the
    leaves' ids (the ones whose calls carry the key, and so may be reconciled)."""

    def wrap(leaf: AbstractToolset[Any]) -> AbstractToolset[Any]:
        if not isinstance(leaf, MCPToolset):
            return leaf
        keyed.add(id(leaf))
        return _KeyedMcp(leaf, keyed=keyed)

    return toolset.visit_and_replace(wrap)


async def call_keyed(key: str, run: Callable[[], Awaitable[Any]]) -> Any:
    """Run the step's call with ``key`` in the MCP request's ``_meta``."""
    token = _CALL.set(_Call(key))
    try:
        return await run()
    finally:
        _CALL.reset(token)


def may_ask_again(*, toolset_id: str, key_ttl: float | None, age: float | None) -> None:
    """``NotReconciled`` unless the server surely still has the key: nothing is sent."""
    how = reconcile(honours_keys=True, key_ttl=key_ttl, has_lookup=False, age=age)
    if how is not Reconcile.REPUBLISH:
        why = distrust_key(age=age, key_ttl=key_ttl, key_margin=None)
        raise NotReconciled(f"{why} Its MCP toolset {toolset_id!r} cannot be asked again under it.")


async def reconcile_call(
    key: str, run: Callable[[], Awaitable[Any]], *, toolset_id: str
) -> tuple[Any, bool]:
    """The server's answer to the same call under the same key (``may_ask_again`` first):
    (value, replayed).

    ``NotReconciled`` when the server says it cannot know, or the call did not reach
    the server through ``_KeyedMcp``.
    """
    call = _Call(key, reconciling=True)
    token = _CALL.set(call)
    try:
        value = await run()
    finally:
        _CALL.reset(token)
    if call.reconciling:  # never reached _KeyedMcp: cannot happen for a keyed leaf
        raise NotReconciled(f"the call did not reach MCP toolset {toolset_id!r} with its key.")
    return value, call.replayed


@dataclass
class _KeyedMcp(WrapperToolset[Any]):
    """An MCP toolset whose calls inside an asiento tool step carry the step's key."""

    keyed: set[int] = field(default_factory=set, kw_only=True, repr=False)

    async def for_run(self, ctx: RunContext[Any]) -> AbstractToolset[Any]:
        """A toolset that connects per run (``auth``/``headers`` functions) is a copy
        for the run: its calls carry the key too."""
        new = await super().for_run(ctx)
        if isinstance(new, _KeyedMcp):
            self.keyed.add(id(new.wrapped))
        return new

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        call = _CALL.get()
        leaf = self.wrapped
        if call is None or not isinstance(leaf, MCPToolset):
            return await leaf.call_tool(name, tool_args, ctx, tool)
        if _app_tool(tool) or type(leaf).call_tool is not MCPToolset.call_tool:
            # An MCP Apps tool, or a subclass's own call_tool: called as Pydantic AI does,
            # without the key (docs/integrations/pydantic-ai.md), and never reconciled.
            if call.reconciling:
                raise NotReconciled(
                    f"MCP tool {name!r} is called by its toolset's own call_tool (an MCP Apps "
                    "tool or a subclass), which asiento cannot give the key."
                )
            return await leaf.call_tool(name, tool_args, ctx, tool)
        use_task = bool((tool.tool_def.metadata or {}).get("task"))
        step_tool = name

        async def keyed(
            name: str, args: dict[str, Any], *, metadata: dict[str, Any] | None = None
        ) -> ToolResult:
            if name != step_tool:  # the hook calls another tool: not this step's call
                sent = await leaf.direct_call_tool(name, args, metadata=metadata, use_task=use_task)
            elif call.reconciling:
                sent = await _answer(leaf, call, name, args, _merged(metadata, call.key))
            else:
                merged = _merged(metadata, call.key)
                sent = await leaf.direct_call_tool(name, args, metadata=merged, use_task=use_task)
            return cast("ToolResult", sent)

        hook = leaf.process_tool_call
        if hook is None:
            return await keyed(name, tool_args)
        return await hook(ctx, keyed, name, tool_args)


def _merged(metadata: dict[str, Any] | None, key: str) -> dict[str, Any]:
    """The hook's metadata with the step's key in it (and a traced step's trace context);
    another key there is the hook's bug."""
    merged = dict(metadata or {})
    theirs = merged.get(IDEMPOTENCY_KEY, key)
    if theirs != key:
        raise UsageError(
            f"a process_tool_call hook set _meta[{IDEMPOTENCY_KEY!r}] to {theirs!r}; in a durable "
            f"run asiento sends the step's own key {key!r}: remove it from the hook"
        )
    merged[IDEMPOTENCY_KEY] = key
    for name, value in step_traceparent().items():  # a traced step's context, beside its key
        merged.setdefault(name, value)
    return merged


async def _answer(
    leaf: MCPToolset[Any], call: _Call, name: str, args: dict[str, Any], meta: dict[str, Any]
) -> Any:
    """The reconcile's call, on the FastMCP client, so the server's flags can be read
    (Pydantic AI maps an error result to ``ModelRetry`` and drops its ``_meta``)."""
    where = f"MCP toolset {leaf.id!r}, tool {name!r}, key {meta[IDEMPOTENCY_KEY]!r}"

    async def ask() -> Any:
        return await leaf.client.call_tool(
            name=name, arguments=args, meta=meta, raise_on_error=False
        )

    late = (
        f"{where}: the first call was still running after {IN_PROGRESS_WAIT:g}s; "
        "resume the run later"
    )
    async with leaf:
        result = await until_settled(ask, wait=IN_PROGRESS_WAIT, late=late)
    said = flag(result)
    if said == CONFLICT:
        raise IdempotencyKeyConflict(
            f"{where}: the server says the key was first used with other arguments "
            f"({_text(result)[:200]}); a person must look"
        )
    if said == UNKNOWN:
        raise NotReconciled(
            f"Its MCP server says it cannot know the outcome of the first call under this "
            f"step's key (it stopped during that call): {where}."
        )
    call.reconciling = False
    call.replayed = isinstance(result.meta, Mapping) and result.meta.get(REPLAYED) is True
    if result.is_error:  # the tool's own error, recorded by the server: as Pydantic AI raises it
        message = _text(result) or f"Tool {name!r} returned an error"
        if leaf.tool_error_behavior == "failed":
            raise ToolFailed(message=message)
        if leaf.tool_error_behavior == "error":
            raise ToolError(message)
        raise ModelRetry(message)
    return _value(result)


def _value(result: Any) -> Any:
    """The answer as the agent gets it: structured content when the text only repeats
    it, else the text (one block: a str), other blocks as their JSON."""
    structured = result.structured_content
    blocks = list(result.content)
    if structured is not None and all(getattr(b, "type", None) == "text" for b in blocks):
        if isinstance(structured, dict) and list(structured) == ["result"]:
            return structured["result"]
        return structured
    mapped = [
        b.text
        if getattr(b, "type", None) == "text"
        else b.model_dump(mode="json", by_alias=True, exclude_none=True)
        for b in blocks
    ]
    return mapped[0] if len(mapped) == 1 else mapped


def _text(result: Any) -> str:
    return "\n".join(str(b.text) for b in result.content if getattr(b, "type", None) == "text")


def _app_tool(tool: ToolsetTool[Any]) -> bool:
    """An MCP Apps tool (a UI resource in its ``_meta``): Pydantic AI calls it its own way."""
    meta = (tool.tool_def.metadata or {}).get("meta")
    if not isinstance(meta, Mapping):
        return False
    ui = meta.get("ui")
    return (isinstance(ui, Mapping) and "resourceUri" in ui) or "ui/resourceUri" in meta
