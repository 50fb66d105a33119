"""Journals: the protocol and its backends."""

from .base import Checkpointer, Journal, Leases, Queue, RunIndex
from .memory import MemoryCheckpointer
from .sqlite import SqliteCheckpointer

__all__ = [
    "Checkpointer",
    "Journal",
    "Leases",
    "MemoryCheckpointer",
    "Queue",
    "RunIndex",
    "SqliteCheckpointer",
]
