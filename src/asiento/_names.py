"""The names a user declares (tools that need approval or are idempotent, MCP toolsets
that are trusted), checked in one place: ``idempotent="lookup"`` is a string, which
Python would happily read as the tools ``l``, ``o``, ``k``... and a tool named by one
letter would then run again after a crash."""

from __future__ import annotations

from collections.abc import Iterable

from .errors import UsageError


def names(value: Iterable[str], *, where: str) -> frozenset[str]:
    """``value`` as a set of names, or a ``UsageError`` naming ``where`` (the call and
    its parameter as the user wrote them: ``durable_run(idempotent=...)``)."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise UsageError(
            f"{where} takes names (a list or set of str), got {type(value).__name__} {value!r:.80}"
        )
    found = list(value)
    wrong = [n for n in found if not isinstance(n, str) or not n]
    if wrong:
        raise UsageError(f"{where} takes non-empty str names, got {wrong[0]!r:.80}")
    return frozenset(found)
