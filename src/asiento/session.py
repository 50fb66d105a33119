"""``Session``: one attempt at driving one run, in one process."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError
from .journal.base import Checkpointer, check_id
from .model import Gateway


@dataclass(slots=True)
class RunStats:
    """What this session paid for and what the journal saved it from paying again."""

    model_calls: int = 0
    model_calls_replayed: int = 0
    tool_calls: int = 0
    tool_calls_replayed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    input_tokens_saved: int = 0
    output_tokens_saved: int = 0


class Session:
    """Binds a run id to the model gateway and the journal for one pass."""

    def __init__(self, run_id: str, gateway: Gateway, store: Checkpointer) -> None:
        self.run_id = check_id("run_id", run_id)
        if not callable(getattr(gateway, "complete", None)):
            raise UsageError(
                f"gateway {gateway!r} has no complete(request, *, idempotency_key) coroutine"
            )
        if not isinstance(store, Checkpointer):
            raise UsageError(f"store {store!r} does not implement the Checkpointer protocol")
        self.gateway = gateway
        self.store = store
        self.stats = RunStats()

    def __repr__(self) -> str:
        return f"Session(run_id={self.run_id!r})"
