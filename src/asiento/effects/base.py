"""Effects: steps that change the world, split into prepare, publish and confirm.

- prepare: build the payload where nobody reads it; the loop freezes it in the
  journal and every retry reuses it, never a regenerated one.
- publish: one operation the destination treats as atomic and deduplicable.
- confirm: the loop records the destination's answer (``remote_id``).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, ClassVar

from .. import outcomes
from .._canonical import canonical_json, fingerprint, idem_key
from .._crash import crash_point
from .._described import described
from ..errors import AsientoError, RunError, ToolAnswerLost, UsageError
from ..payloads import Intent, Outcome
from ..tools import Again, Found, PrepareFailed, Reconciled, Tool, Unknown, tool


@dataclass(frozen=True, slots=True, kw_only=True)
class Published:
    """What the destination answered: its id for the effect and a JSON result for the model."""

    remote_id: str | None = None
    result: Any = None

    def outcome(self, via: str, attempts: int) -> Outcome:
        """The step's recorded outcome: published ``via`` publish, republish or lookup."""
        value = self.result if self.result is not None else {"remote_id": self.remote_id}
        return Outcome.published(value, remote_id=self.remote_id, via=via, attempts=attempts)


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
    key, and ``key_ttl`` (seconds) when it forgets keys. ``key_margin`` (seconds)
    is how much younger than ``key_ttl`` a key must be to be published again
    (``None``: 10% of the TTL, at least 60 s and at most an hour). Define
    ``lookup`` when the effect can be found by a business id (an issue by title, a
    file by path and content hash, a row by unique key).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    honours_keys: ClassVar[bool] = False
    key_ttl: ClassVar[float | None] = None
    key_margin: ClassVar[float | None] = None

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
        key_margin_of(self.key_ttl, self.key_margin, who=type(self).__name__)
        description = self.description or (inspect.getdoc(type(self)) or "").split("\n\n")[0]
        built = tool(name=self.tool_name, description=description)(self.prepare)
        return built.with_runner(EffectRunner(self), idempotent=False)


class EffectRunner:
    """How an effect's step is carried out: prepare, publish, and reconcile by key or lookup."""

    prepares: bool = True

    def __init__(self, effect: Effect) -> None:
        self.effect = effect

    def prepare(self, tool: Tool, run_id: str, step_id: str, intent: Intent) -> Intent:
        """Freeze the payload to publish and its key: every retry publishes the same."""
        try:
            prepared = outcomes.to_jsonable(self.effect.prepare(**tool.validate(intent.args)))
            canonical_json(prepared)
        except EffectRejected as exc:
            raise PrepareFailed(f"refused while preparing: {exc}") from exc
        except Exception as exc:
            raise PrepareFailed(f"prepare failed: {type(exc).__name__}: {exc}") from exc
        fp = fingerprint({"args": intent.args, "prepared": prepared})[:32]
        key = idem_key(run_id, step_id, prepared)
        return replace(intent, fp=fp, prepared=prepared, idem_key=key)

    async def execute(
        self,
        tool: Tool,
        intent: Intent,
        kwargs: Mapping[str, Any] | None,
        *,
        via: str,
        attempts: int,
    ) -> Outcome:
        """Publish the frozen payload under the frozen key. Only a refusal is an outcome:

        any other failure leaves the step submitted, to be reconciled on resume, and
        stops the pass with ``ToolAnswerLost`` naming the effect (the library's own
        exception, an ``httpx`` error or a body that is not JSON, is its cause).
        """
        try:
            published = await self.effect.publish(intent.prepared, str(intent.idem_key))
        except EffectRejected as exc:
            return Outcome.failed(f"refused: {exc}", attempts=attempts)
        except AsientoError:
            raise
        except Exception as exc:
            raise ToolAnswerLost(self._lost_why(tool, exc)) from exc
        crash_point("after_publish")
        if not isinstance(published, Published):
            raise UsageError(
                f"{type(self.effect).__name__}.publish() must return Published, got {published!r}"
            )
        return _recorded(published, via, attempts)

    async def reconcile(
        self, tool: Tool, intent: Intent, *, age: float | None, attempts: int
    ) -> Reconciled:
        """Submitted, no outcome: a live key, then a lookup, else a person."""
        effect = self.effect
        how = reconcile(
            honours_keys=effect.honours_keys,
            key_ttl=effect.key_ttl,
            has_lookup=effect.has_lookup,
            age=age,
            key_margin=effect.key_margin,
        )
        if how is Reconcile.UNCERTAIN:
            return Unknown(self._why_uncertain(age))
        if how is Reconcile.LOOKUP:
            found = await effect.lookup(intent.prepared)
            if found is not None:
                return Found(_recorded(found, "lookup", attempts))
        return Again(how.value)

    def _lost_why(self, tool: Tool, exc: Exception) -> str:
        url = getattr(self.effect, "url", None)
        where = f" ({getattr(self.effect, 'method', 'POST')} {url})" if isinstance(url, str) else ""
        return (
            f"effect {tool.name!r}{where}: its publish failed ({described(exc)}) and it may "
            "have happened: the step stays submitted and is settled when the run is resumed "
            "(under the same key, by its lookup, or by a person)"
        )

    def _why_uncertain(self, age: float | None) -> str:
        effect = self.effect
        if effect.honours_keys:
            why = distrust_key(age=age, key_ttl=effect.key_ttl, key_margin=effect.key_margin)
            return f"{why} It has no lookup."
        return "Its destination does not honour idempotency keys and it has no lookup."


def _recorded(published: Published, via: str, attempts: int) -> Outcome:
    """What the destination answered, as the outcome the journal keeps."""
    outcome = published.outcome(via, attempts)
    value = outcomes.jsonable_or(outcome.value, {"remote_id": published.remote_id})
    return replace(outcome, value=value)


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
    age: float | None,
    key_margin: float | None = None,
) -> Reconcile:
    """The reconcile table: a live key first, then a lookup, else a person.

    ``age``: seconds since the step's first submission, on the store's clock (None
    when unknown). A key is live only when ``distrust_key`` finds nothing wrong with it.
    """
    if honours_keys and distrust_key(age=age, key_ttl=key_ttl, key_margin=key_margin) is None:
        return Reconcile.REPUBLISH
    if has_lookup:
        return Reconcile.LOOKUP
    return Reconcile.UNCERTAIN


def distrust_key(
    *, age: float | None, key_ttl: float | None, key_margin: float | None
) -> str | None:
    """Why the destination may have forgotten a key of this ``age``; None if it surely has not.

    Conservative: an age that is unknown, not a number or negative says a clock is
    wrong, and is never "fresh"; a key must be younger than its TTL minus the margin,
    which absorbs clock steps and skew between the clocks that stamped and judge it.
    """
    if key_ttl is None:
        return None  # keys never forgotten: republishing is safe at any age
    margin = key_margin_of(key_ttl, key_margin)
    if age is None or not math.isfinite(age):
        return f"Its idempotency key's age cannot be known ({age}), so it cannot be trusted."
    if age < 0:
        return (
            f"Its idempotency key's age cannot be trusted: it reads {age:.1f}s, from the "
            "future (a clock was ahead when it was written, or went back since)."
        )
    if age >= key_ttl - margin:
        return (
            f"Its idempotency key is {age:.0f}s old; the destination keeps keys {key_ttl:g}s, "
            f"and publishing again needs a key younger than {max(key_ttl - margin, 0):g}s "
            f"(key_ttl minus key_margin, {margin:g}s)."
        )
    return None


def default_key_margin(key_ttl: float) -> float:
    """10% of the TTL, at least 60 s and at most an hour (``Effect.key_margin`` = None).

    60 s covers clocks NTP keeps in step and the time a republish takes to reach the
    destination; a longer TTL means a resume longer after the crash, with more time
    for clocks to drift apart; past an hour a clock is broken, not drifting, and a
    wider margin would only waste the key (23 of a 24 h TTL stay usable).
    """
    return min(max(0.1 * key_ttl, 60.0), 3600.0)


def key_margin_of(key_ttl: float | None, key_margin: float | None, *, who: str = "") -> float:
    """The margin in force; ``UsageError`` for a TTL or margin that is not a number >= 0."""
    where = f"{who}: " if who else ""
    for name, value in (("key_ttl", key_ttl), ("key_margin", key_margin)):
        if value is not None and not (isinstance(value, int | float) and 0 <= value < math.inf):
            raise UsageError(
                f"{where}{name} must be None or a number of seconds >= 0, got {value!r}"
            )
    if key_ttl is None:
        return 0.0
    return default_key_margin(key_ttl) if key_margin is None else float(key_margin)
