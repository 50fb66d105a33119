"""Policies: who may run what. A policy is any callable from ``ToolCall`` to a decision."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

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
    """A policy that asks a person before any of ``names`` runs, and allows the rest."""
    wanted = frozenset(names)

    def policy(call: ToolCall) -> Decision:
        return Decision.REQUIRE_APPROVAL if call.name in wanted else Decision.ALLOW

    return policy


def require_approval_for_destructive(tools: Iterable[Tool]) -> Policy:
    """A policy that asks a person before any of ``tools`` that is destructive runs.

    A tool is destructive when its treatment says so (``Tool.destructive``): an MCP
    tool by its annotations (``destructiveHint`` true or absent, not read-only), every
    tool of an untrusted server. Local tools and the rest are allowed.
    """
    return require_approval_for(*(t.name for t in tools if t.destructive))


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
