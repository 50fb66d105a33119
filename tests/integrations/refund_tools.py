"""The two tools the framework tracing tests give their agents, counting their runs.

``lookup`` reads; ``refund`` is the effect, which each test has wait for a person's
approval in its framework's own way (Pydantic AI's ``requires_approval``, the Agents
SDK's ``needs_approval``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable


def counted_tools(ran: Counter[str]) -> tuple[Callable[[str], str], Callable[[str], str]]:
    """``lookup`` and ``refund`` as plain functions, each run counted in ``ran``."""

    def lookup(order: str) -> str:
        """Look an order up."""
        ran["lookup"] += 1
        return f"{order}: paid 10 EUR"

    def refund(order: str) -> str:
        """Refund an order."""
        ran["refund"] += 1
        return f"refunded {order}"

    return lookup, refund
