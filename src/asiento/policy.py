"""Policies: who may run what. A policy is any callable from ``ToolCall`` to a decision."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

from .errors import UsageError
from .events import Decision
from .model import ToolCall

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
