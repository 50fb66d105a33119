"""An exception from a library, in one line a person can act on (for asiento's own errors)."""

from __future__ import annotations

from pydantic_core import ValidationError

_MAX = 300


def described(exc: BaseException) -> str:
    """``Type: first line``; a pydantic validation error as its count and its first error."""
    if isinstance(exc, ValidationError) and exc.error_count():
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "the value"
        count = exc.error_count()
        text = f"{count} validation error{'s' if count > 1 else ''} in {exc.title}; first: "
        text += f"{where}: {first.get('msg', '')}"
    else:
        lines = str(exc).strip().splitlines()
        text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= _MAX else text[: _MAX - 1] + "…"
