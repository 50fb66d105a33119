"""Step ids: the one grammar that names a run's records.

    m{n}             the n-th model step: m1, m2, ...
    m{n}.t{k}        the k-th tool call the model asked for in m{n}: m1.t1, m1.t2, ...
    m{n}.t{k}/{a}    attempt a (2, 3, ...) of that tool step; attempt 1 is the step id itself
    m{n}/{p}         a streamed attempt of model step m{n} by the pass of fence p (a marker)
    budget{n}        the n-th stop of the run on its budget (and a person's raise of it)
    trace            the run's trace context (telemetry on)
    trace/{p}        the traced pass of fence p: when it began and ended
    final            the run's final record

The same journal always yields the same ids. Nothing else in asiento builds or
splits step ids: ask this module.
"""

from __future__ import annotations

from collections.abc import Iterable

FINAL = "final"

_TOOL = ".t"
_ATTEMPT = "/"


def model(turn: int) -> str:
    """The id of model step ``turn`` (counted from 1)."""
    return f"m{turn}"


def tool(model_step: str, number: int) -> str:
    """The id of the ``number``-th tool call (from 1) the model asked for in ``model_step``."""
    return f"{model_step}{_TOOL}{number}"


def attempt(step_id: str, number: int) -> str:
    """Where attempt ``number`` of a tool step writes its records (the step id for the first)."""
    return step_id if number == 1 else f"{step_id}{_ATTEMPT}{number}"


def base(record_id: str) -> str:
    """The step a record id belongs to: the id without its attempt."""
    return record_id.split(_ATTEMPT, 1)[0]


def is_tool(record_id: str) -> bool:
    """Whether the record belongs to a tool step (any attempt of it)."""
    return _TOOL in base(record_id)


def is_retry(record_id: str) -> bool:
    """Whether the record id names a second or later attempt of a tool step."""
    return _ATTEMPT in record_id


def is_model(record_id: str) -> bool:
    """Whether the record id names a model step."""
    return record_id.startswith("m") and record_id[1:].isdigit()


def streamed(model_step: str, attempt: int) -> str:
    """Where the pass of fence ``attempt`` marks that it began streaming ``model_step``."""
    return f"{model_step}{_ATTEMPT}{attempt}"


def streamed_by_step(record_ids: Iterable[str]) -> dict[str, list[str]]:
    """The streamed-attempt markers among ``record_ids``, by the model step they attempted."""
    found: dict[str, list[str]] = {}
    for record_id in record_ids:
        step, mark, attempt = record_id.partition(_ATTEMPT)
        if mark and attempt.isdigit() and is_model(step):
            found.setdefault(step, []).append(record_id)
    return found


def is_streamed(record_id: str) -> bool:
    """Whether the record id names a streamed attempt of a model step."""
    step, _, attempt = record_id.partition(_ATTEMPT)
    return is_model(step) and attempt.isdigit()


TRACE = "trace"


def pass_mark(fence: int) -> str:
    """Where the traced pass of fence ``fence`` marks its beginning and its end."""
    return f"{TRACE}{_ATTEMPT}{fence}"


def is_trace(record_id: str) -> bool:
    """Whether the record is the run's trace context or a traced pass's mark."""
    return base(record_id) == TRACE


def pass_fences(record_ids: Iterable[str]) -> list[int]:
    """The fences of the traced passes marked among ``record_ids``, in order."""
    prefix = f"{TRACE}{_ATTEMPT}"
    return sorted(
        int(r[len(prefix) :])
        for r in record_ids
        if r.startswith(prefix) and r[len(prefix) :].isdigit()
    )


_BUDGET = "budget"


def budget(number: int) -> str:
    """The id of the run's ``number``-th stop on its budget (counted from 1)."""
    return f"{_BUDGET}{number}"


def is_budget(record_id: str) -> bool:
    """Whether the record id names a stop on the run's budget."""
    return record_id.startswith(_BUDGET) and record_id[len(_BUDGET) :].isdigit()
