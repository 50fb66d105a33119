"""Values a model may write in JSON that strict JSON, and so the journal, cannot carry.

A model's tool-call arguments can hold ``NaN``, ``Infinity``, ``-Infinity``
(Python's ``json`` reads them, strict JSON has no such values), a number past
a float's range (``1e999`` reads as infinity) or an integer longer than
Python's limit for int/str conversion (4,300 digits by default, which
``json.loads`` refuses outright). ``loads`` reads such text without failing,
keeping each of those values as an ``Unfit`` that says what it is and why it
cannot be kept; ``problem`` names the first one found in arguments, so the
call can be recorded with that note instead of being lost.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

_CANNOT_CARRY = "which JSON cannot carry"


@dataclass(frozen=True, slots=True)
class Unfit:
    """A value as the model wrote it (``source``), what it is, and why it cannot be kept."""

    source: str
    what: str
    why: str


def loads(text: str | bytes) -> Any:
    """``json.loads``, with each value strict JSON cannot carry kept as an ``Unfit``."""
    return json.loads(text, parse_constant=_constant, parse_int=_int, parse_float=_float)


def problem(arguments: Mapping[str, Any]) -> str | None:
    """What is wrong with arguments that hold values JSON cannot carry, or None.

    Finds ``Unfit`` values and also the Python values a gateway built itself
    (``float("nan")``, an int too long to write). Recursion on a cycle is left
    to the caller, as ``canonical_json`` leaves it.
    """
    found = [
        (str(name), path, unfit)
        for name, value in arguments.items()
        for path, unfit in _unfit_in(value, str(name))
    ]
    if not found:
        return None
    name, path, unfit = found[0]
    where = f" (at {path})" if path != name else ""
    said = f"argument {name!r} holds {unfit.what}{where}, {unfit.why}"
    if len(found) > 1:
        said += f" (and {len(found) - 1} more such value{'s' if len(found) > 2 else ''})"
    return said


def render(value: Any) -> str:
    """JSON-like text of ``value`` with each unfit value written as the model wrote it."""
    if isinstance(value, Unfit):
        return value.source
    if isinstance(value, Mapping):
        items = (f"{json.dumps(str(k), ensure_ascii=False)}: {render(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(render(v) for v in value) + "]"
    if isinstance(value, int) and not isinstance(value, bool) and _too_long(value):
        return f"<an integer with more than {sys.get_int_max_str_digits()} digits>"
    return json.dumps(value, ensure_ascii=False, default=repr)


def _unfit_in(value: Any, path: str) -> Iterator[tuple[str, Unfit]]:
    if isinstance(value, Unfit):
        yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            name = str(key)
            inner = f"{path}.{name}" if name.isidentifier() else f"{path}[{json.dumps(name)}]"
            yield from _unfit_in(item, inner)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _unfit_in(item, f"{path}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        name = "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
        yield path, Unfit(name, name, _CANNOT_CARRY)
    elif isinstance(value, int) and not isinstance(value, bool) and _too_long(value):
        limit = sys.get_int_max_str_digits()
        yield path, Unfit("", f"an integer with more than {limit} digits", _digit_limit())


def _too_long(value: int) -> bool:
    try:
        str(value)
    except ValueError:
        return True
    return False


def _digit_limit() -> str:
    limit = sys.get_int_max_str_digits()
    return f"which exceeds Python's limit of {limit} digits for int/str conversion"


def _constant(name: str) -> Unfit:
    return Unfit(name, name, _CANNOT_CARRY)


def _int(text: str) -> int | Unfit:
    try:
        return int(text)
    except ValueError:
        digits = len(text.lstrip("-"))
        return Unfit(text, f"an integer with {digits} digits", _digit_limit())


def _float(text: str) -> float | Unfit:
    value = float(text)
    if math.isfinite(value):
        return value
    return Unfit(text, f"the number {text}", "which is beyond the range of a float")
