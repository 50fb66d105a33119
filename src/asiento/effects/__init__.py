"""Effects that survive any crash: prepare, publish, confirm, reconcile."""

from typing import TYPE_CHECKING, Any

from .base import (
    Effect,
    EffectRejected,
    IdempotencyKeyConflict,
    Published,
    Reconcile,
    reconcile,
)
from .files import WriteFile, write_atomic
from .records import EffectRecord, effect_records, effect_records_of

if TYPE_CHECKING:
    from .http import HttpEffect


def __getattr__(name: str) -> Any:
    """``HttpEffect`` is imported on first use: httpx costs every process ~0.1 s to load."""
    if name == "HttpEffect":
        from .http import HttpEffect

        return HttpEffect
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Effect",
    "EffectRecord",
    "EffectRejected",
    "HttpEffect",
    "IdempotencyKeyConflict",
    "Published",
    "Reconcile",
    "WriteFile",
    "effect_records",
    "effect_records_of",
    "reconcile",
    "write_atomic",
]
