"""Effects: steps that change the world, split into prepare, publish and confirm.

- prepare: build the payload where nobody reads it; the loop freezes it in the
  journal and every retry reuses it, never a regenerated one.
- publish: one operation the destination treats as atomic and deduplicable.
- confirm: the loop records the destination's answer (``remote_id``).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import AsientoError, RunError

if TYPE_CHECKING:
    from ..tools import Tool


@dataclass(frozen=True, slots=True, kw_only=True)
class Published:
    """What the destination answered: its id for the effect and a JSON result for the model."""

    remote_id: str | None = None
    result: Any = None

    def outcome(self, via: str, attempts: int) -> dict[str, Any]:
        value = self.result if self.result is not None else {"remote_id": self.remote_id}
        return {
            "status": "ok",
            "value": value,
            "remote_id": self.remote_id,
            "via": via,
            "attempts": attempts,
        }


class EffectRejected(AsientoError):
    """Raised by ``publish`` when the destination refused: the effect certainly did not happen.

    It is recorded as the step's failed outcome. Any other exception from
    ``publish`` leaves the step submitted, to be reconciled on resume.
    """


class IdempotencyKeyConflict(RunError):
    """The destination saw this idempotency key with different parameters.

    Never taken as success: the frozen payload did not change, so someone else
    used the key, or the destination is confused. A person must look.
    """


class Effect:
    """Base class for effect tools. Subclass it and define ``prepare`` and ``publish``.

    ``prepare``'s signature is the tool's argument schema (as for ``@tool``).
    Declare ``honours_keys`` when the destination deduplicates by idempotency
    key, and ``key_ttl`` (seconds) when it forgets keys. Define ``lookup`` when
    the effect can be found by a business id (an issue by title, a file by path
    and content hash, a row by unique key).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    honours_keys: ClassVar[bool] = False
    key_ttl: ClassVar[float | None] = None

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        """Build the JSON payload to publish. Must not touch the destination."""
        raise NotImplementedError

    async def publish(self, payload: Any, idem_key: str) -> Published:
        """Make the effect visible in one deduplicable operation."""
        raise NotImplementedError

    async def lookup(self, payload: Any) -> Published | None:
        """Find the effect at the destination by a business id; None when it is not there."""
        raise NotImplementedError

    @property
    def has_lookup(self) -> bool:
        return type(self).lookup is not Effect.lookup

    @property
    def tool_name(self) -> str:
        return self.name or re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()

    def as_tool(self) -> Tool:
        """The tool the model sees: named after the effect, with ``prepare``'s arguments."""
        from ..tools import tool

        description = self.description or (inspect.getdoc(type(self)) or "").split("\n\n")[0]
        built = tool(name=self.tool_name, description=description)(self.prepare)
        return built.with_effect(self)


class Reconcile(StrEnum):
    """What to do with an effect submitted with no recorded outcome."""

    REPUBLISH = "republish"
    LOOKUP = "lookup"
    UNCERTAIN = "uncertain"


def reconcile(
    *,
    honours_keys: bool,
    key_ttl: float | None,
    has_lookup: bool,
    first_submitted_at: float,
    now: float,
) -> Reconcile:
    """The reconcile table: a live key first, then a lookup, else a person.

    A key older than its TTL is never trusted: the destination may have
    forgotten it and would apply the effect a second time.
    """
    if honours_keys and (key_ttl is None or now - first_submitted_at < key_ttl):
        return Reconcile.REPUBLISH
    if has_lookup:
        return Reconcile.LOOKUP
    return Reconcile.UNCERTAIN
