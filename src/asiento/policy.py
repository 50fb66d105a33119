"""Policies: who may run what. A policy is any callable from ``ToolCall`` to a decision."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from ._names import names as tool_names
from .errors import UsageError
from .events import Decision
from .model import ToolCall

if TYPE_CHECKING:
    from .tools import Tool

Policy = Callable[[ToolCall], "Decision | str | Awaitable[Decision | str]"]

_POLICY_DECISIONS = (Decision.ALLOW, Decision.DENY, Decision.REQUIRE_APPROVAL)


def allow_all(call: ToolCall) -> Decision:
    """The default: every tool call is allowed."""
    return Decision.ALLOW


def require_approval_for(*names: str) -> Policy:
    """A policy that asks a person before any of ``names`` runs, and allows the rest.

    Each name is a tool's name (a str): anything else (a tool object, a list) would
    match no call, and the tool would run without anyone's approval, so it is refused.
    """
    if len(names) == 1 and not isinstance(names[0], str) and isinstance(names[0], Iterable):
        raise UsageError(
            "require_approval_for(...) takes each tool's name as an argument: "
            "require_approval_for('refund', 'transfer'), not a list of them"
        )
    wanted = tool_names(names, where="require_approval_for(...)")

    def policy(call: ToolCall) -> Decision:
        return Decision.REQUIRE_APPROVAL if call.name in wanted else Decision.ALLOW

    return policy


def require_approval_for_destructive(tools: Iterable[Tool]) -> Policy:
    """A policy that asks a person before any of ``tools`` that is destructive runs.

    A tool is destructive when its treatment says so (``Tool.destructive``): an MCP
    tool by its annotations (``destructiveHint`` true or absent, not read-only), every
    tool of an untrusted server. Local tools and the rest are allowed.
    """
    from .tools import Tool

    given = [tools] if isinstance(tools, str) else list(tools)
    wrong = [t for t in given if not isinstance(t, Tool)]
    if wrong:
        raise UsageError(
            "require_approval_for_destructive(tools) takes the agent's tools (@tool "
            f"functions, MCP tools), got {wrong[0]!r:.80}"
        )
    return require_approval_for(*(t.name for t in given if t.destructive))


async def ask_policy(policy: Policy, call: ToolCall) -> Decision:
    """Ask the policy (sync or async) and refuse an answer that is not a decision."""
    answer = policy(call)
    if not isinstance(answer, str) and inspect.isawaitable(answer):  # an async policy
        answer = await answer
    try:
        decision = Decision(answer)
    except ValueError:
        decision = None
    if decision not in _POLICY_DECISIONS:
        raise UsageError(
            f"policy returned {answer!r} for tool {call.name!r}; "
            "expected 'allow', 'deny' or 'require_approval'"
        )
    return decision
