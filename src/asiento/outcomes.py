"""A tool's return value as the outcome the journal keeps: recordable, or a recorded failure.

Dataclasses and pydantic models become objects; sets are refused, because their
order differs between processes and the journal must not depend on it, and so is
a value that contains itself, naming where; so is a value over the record limit.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import to_jsonable_python

from ._canonical import canonical_json, unstable_part
from .journal.base import MAX_RECORD_BYTES
from .payloads import Outcome

# Room for a result in one record, its envelope aside. A character is at most 12 bytes of
# the journal's JSON (which escapes every non-ASCII one: ``\ud83d\ude00`` for an emoji).
_ROOM = MAX_RECORD_BYTES - 1024
_MAX_BYTES_PER_CHAR = 12


def of_value(value: Any) -> Outcome:
    """The outcome of a tool that returned ``value``: ok, or why it cannot be recorded."""
    if type(value) is str and len(value) * _MAX_BYTES_PER_CHAR < _ROOM:
        try:  # the usual result, checked without serialising it
            value.encode()
            return Outcome.ok(value)
        except UnicodeEncodeError:
            pass  # a lone surrogate: the general path below words the failure
    if (unstable := unstable_part(value, "result")) is not None:
        return unrecordable(unstable)
    try:
        jsonable = to_jsonable_python(value)
        json.dumps(jsonable, ensure_ascii=False).encode()  # lone surrogates cannot be sent
    except RecursionError:
        return unrecordable("it is nested too deeply to be serialised (RecursionError)")
    except Exception as exc:
        return unrecordable(f"{type(exc).__name__}: {exc}")
    return bounded(jsonable)


def bounded(jsonable: Any) -> Outcome:
    """``Outcome.ok(jsonable)``, or a recorded failure if one record cannot hold it.

    Every tool source's result passes here before it is recorded (native, MCP, the
    frameworks'): a result beyond the limit is the step's failure, told to the model,
    never a refused append that would leave an effect that ran uncertain.
    """
    if type(jsonable) is str and len(jsonable) * _MAX_BYTES_PER_CHAR < _ROOM:
        return Outcome.ok(jsonable)
    try:
        size = len(canonical_json(jsonable))
    except RecursionError:
        return unrecordable("it is nested too deeply to be serialised (RecursionError)")
    except (TypeError, ValueError) as exc:
        return unrecordable(f"{type(exc).__name__}: {exc}")
    if size > _ROOM:
        return unrecordable(f"{size:,} bytes, over the journal's limit of {MAX_RECORD_BYTES:,}")
    return Outcome.ok(jsonable)


def unrecordable(reason: str) -> Outcome:
    return Outcome.failed(f"the tool's result cannot be recorded ({reason[:500]})")


def to_jsonable(value: Any) -> Any:
    """``value`` as plain JSON types (dataclasses and pydantic models become objects)."""
    return to_jsonable_python(value)


def jsonable_or(value: Any, fallback: Any) -> Any:
    """``value`` as JSON the journal can keep, or ``fallback`` when it cannot be."""
    try:
        jsonable = to_jsonable_python(value)
        canonical_json(jsonable)
    except Exception:
        return fallback
    return jsonable
