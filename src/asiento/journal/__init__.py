"""Journals: the protocol and its backends."""

from .base import Checkpointer
from .memory import MemoryCheckpointer
from .sqlite import SqliteCheckpointer

__all__ = ["Checkpointer", "MemoryCheckpointer", "SqliteCheckpointer"]
