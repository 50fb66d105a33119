"""Effects that survive any crash: prepare, publish, confirm, reconcile."""

from .base import (
    Effect,
    EffectRejected,
    IdempotencyKeyConflict,
    Published,
    Reconcile,
    reconcile,
)
from .files import WriteFile, write_atomic
from .http import HttpEffect
from .records import EffectRecord, effect_records, effect_records_of

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
