"""What each record of a step holds: one frozen type per payload, the only reader and writer.

    ModelResult   result of a model step (m1): the request's fingerprint, the answer, its cost
    Intent        intent of a tool step (m1.t1): the tool, the frozen arguments, their
                  fingerprint; for an effect, the prepared payload and its idempotency key
    Outcome       result of a tool step's attempt: ok (value), error, denied (by, reason);
                  a published effect adds remote_id, via and attempts
    Approval      a person's approval or denial of the frozen arguments (their fingerprint)
    Resolution    what a person found about an uncertain effect
    Final         the run's final record: the answer, or who abandoned the run and why

``to_json`` writes the keys in the order asiento has always written them, so the
bytes on disk do not depend on this module (``tests/journal/test_old_journals.py``
holds it to journals written before it); ``from_json`` reads every journal so far.
A submitted record holds nothing (``SUBMITTED``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .model import ModelResponse

Json = dict[str, Any]
Status = Literal["ok", "error", "denied"]

SUBMITTED: Mapping[str, Any] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelResult:
    """A model step: what was asked (its fingerprint), what came back, what it cost.

    ``budget``: a budgeted run's limits in force, recorded with the first new call of
    each pass (so the run index shows a budget before any stop); absent otherwise.
    """

    fp: str
    response: ModelResponse
    cost: float | None = None
    repaid: int = 0  # streamed attempts of this step cut before it: generations paid, lost
    # The first model step of a run whose tools come from elsewhere (an MCP server):
    # each tool's name and digest, so a resumed run can name the tools that changed.
    tools: Mapping[str, str] | None = None
    budget: Mapping[str, float | None] | None = None

    def to_json(self) -> Json:
        payload: Json = {"fp": self.fp, "response": self.response.to_json()}
        if self.cost is not None:
            payload["cost"] = self.cost
        if self.repaid:
            payload["repaid"] = self.repaid
        if self.tools is not None:
            payload["tools"] = dict(self.tools)
        if self.budget is not None:
            payload["budget"] = dict(self.budget)
        return payload

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> ModelResult:
        cost, tools, budget = payload.get("cost"), payload.get("tools"), payload.get("budget")
        if isinstance(tools, Mapping):
            tools = {str(name): str(digest) for name, digest in tools.items()}
        return cls(
            fp=str(payload.get("fp", "")),
            response=ModelResponse.from_json(payload["response"]),
            cost=None if cost is None else float(cost),
            repaid=int(payload.get("repaid", 0)),
            tools=tools if isinstance(tools, dict) else None,
            budget=dict(budget) if isinstance(budget, Mapping) else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamAttempt:
    """A pass began streaming a model step (written while it streams, never before).

    Found without the step's result by a later pass, it says that a generation was
    paid for and cut: the step's answer counts it as re-paid (``ModelResult.repaid``).
    """

    attempt: int

    def to_json(self) -> Json:
        return {"stream_attempt": self.attempt}

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> StreamAttempt:
        return cls(attempt=int(payload.get("stream_attempt", 0)))


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceContext:
    """The run's trace (W3C ``traceparent``): every pass, in any process, joins it."""

    traceparent: str
    tracestate: str = ""

    def to_json(self) -> Json:
        return {"traceparent": self.traceparent, "tracestate": self.tracestate}

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> TraceContext:
        return cls(
            traceparent=str(payload.get("traceparent", "")),
            tracestate=str(payload.get("tracestate", "")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PassMark:
    """A traced pass began (``submitted``) or ended (``result``): the spans it left.

    A begun pass with no end died with its process; the next pass stands in for its
    span and records the end (``died``), so a trace never holds orphaned steps.
    """

    at: float
    cause: str = ""  # began: first, resumed, decided, taken_over
    by: str = ""  # began: the holder that drove it
    status: str = ""  # ended: how the pass left the run
    died: bool = False  # ended: written by a later pass for a pass that died

    def to_json(self) -> Json:
        payload: Json = {"at": self.at}
        for name in ("cause", "by", "status"):
            if value := getattr(self, name):
                payload[name] = value
        if self.died:
            payload["died"] = True
        return payload

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> PassMark:
        return cls(
            at=float(payload.get("at", 0.0)),
            cause=str(payload.get("cause", "")),
            by=str(payload.get("by", "")),
            status=str(payload.get("status", "")),
            died=bool(payload.get("died", False)),
        )


def is_model_result(payload: Mapping[str, Any]) -> bool:
    """Whether a result record is a model step's (it holds the answer)."""
    return isinstance(payload.get("response"), Mapping)


# The tool of the intent that freezes a LangGraph ``interrupt(value)`` for a person: its
# arguments are ``{"value": value}`` (integrations._langgraph_pass; the views show it).
INTERRUPT = "interrupt"


@dataclass(frozen=True, slots=True, kw_only=True)
class Intent:
    """A tool call, frozen before anything runs; an effect's also holds its prepared payload."""

    tool: str
    args: Mapping[str, Any]
    fp: str
    prepared: Any = None
    idem_key: str | None = None  # set for an effect (and only then)

    @property
    def is_effect(self) -> bool:
        return self.idem_key is not None

    def to_json(self) -> Json:
        payload: Json = {"tool": self.tool, "args": dict(self.args), "fp": self.fp}
        if self.idem_key is not None:
            payload["prepared"] = self.prepared
            payload["idem_key"] = self.idem_key
        return payload

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> Intent:
        args = payload.get("args")
        return cls(
            tool=str(payload.get("tool", "")),
            args=args if isinstance(args, Mapping) else {},
            fp=str(payload.get("fp", "")),
            prepared=payload.get("prepared"),
            idem_key=payload.get("idem_key"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """How a tool step's attempt ended, as the model is told and the journal keeps it."""

    status: Status
    value: Any = None  # ok
    error: str | None = None  # error
    by: str | None = None  # denied: who
    reason: str | None = None  # denied: why
    remote_id: str | None = None  # a published effect: the destination's id
    via: str | None = None  # a published effect: publish, republish or lookup
    attempts: int | None = None  # an effect: how many attempts it took

    @classmethod
    def ok(cls, value: Any) -> Outcome:
        return cls(status="ok", value=value)

    @classmethod
    def failed(cls, error: str, *, attempts: int | None = None) -> Outcome:
        return cls(status="error", error=error, attempts=attempts)

    @classmethod
    def denied(cls, by: str, reason: str) -> Outcome:
        return cls(status="denied", by=by, reason=reason)

    @classmethod
    def published(cls, value: Any, *, remote_id: str | None, via: str, attempts: int) -> Outcome:
        return cls(status="ok", value=value, remote_id=remote_id, via=via, attempts=attempts)

    @property
    def shown(self) -> Any:
        """What a caller is shown of it: the value, the error or the reason."""
        if self.status == "ok":
            return self.value
        return self.error if self.status == "error" else self.reason

    def text(self) -> str:
        """What the model reads."""
        if self.status == "ok":
            return (
                self.value
                if isinstance(self.value, str)
                else json.dumps(self.value, ensure_ascii=False)
            )
        if self.status == "denied":
            return f"denied: {self.reason or ''}"
        return f"error: {self.error or ''}"

    def to_json(self) -> Json:
        payload: Json = {"status": self.status}
        if self.status == "ok":
            payload["value"] = self.value
        elif self.status == "error":
            payload["error"] = self.error
        else:
            payload["by"], payload["reason"] = self.by, self.reason
        if self.via is not None:
            payload["remote_id"], payload["via"] = self.remote_id, self.via
        if self.attempts is not None:
            payload["attempts"] = self.attempts
        return payload

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> Outcome:
        status = payload.get("status")
        return cls(
            status=status if status in ("ok", "error", "denied") else "error",
            value=payload.get("value"),
            error=payload.get("error"),
            by=payload.get("by"),
            reason=payload.get("reason"),
            remote_id=payload.get("remote_id"),
            via=payload.get("via"),
            attempts=payload.get("attempts"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Approval:
    """A person's decision on the frozen arguments of fingerprint ``fp``."""

    approved: bool
    by: str
    reason: str
    fp: str | None

    def to_json(self) -> Json:
        return {"approved": self.approved, "by": self.by, "reason": self.reason, "fp": self.fp}

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> Approval:
        return cls(
            approved=bool(payload.get("approved")),
            by=str(payload.get("by") or ""),
            reason=str(payload.get("reason") or ""),
            fp=payload.get("fp"),
        )

    def as_outcome(self) -> Outcome:
        """A denial as the model is told it."""
        return Outcome.denied(self.by, self.reason or f"denied by {self.by}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Resolution:
    """What a person found about an uncertain effect: it happened (and its result), or not."""

    happened: bool
    by: str
    reason: str
    remote_id: str | None = None
    result: Any = None  # what the model is told, when it happened

    def to_json(self) -> Json:
        payload: Json = {
            "happened": self.happened,
            "by": self.by,
            "reason": self.reason,
            "remote_id": self.remote_id,
        }
        if self.happened:
            payload["result"] = self.result
        return payload

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> Resolution:
        return cls(
            happened=bool(payload.get("happened")),
            by=str(payload.get("by") or ""),
            reason=str(payload.get("reason") or ""),
            remote_id=payload.get("remote_id"),
            result=payload.get("result"),
        )

    def as_outcome(self) -> Outcome:
        """An effect that happened, as the model is told it."""
        return Outcome.ok(self.result)


@dataclass(frozen=True, slots=True, kw_only=True)
class Final:
    """The run is closed: the model's answer after step ``step``, or a person gave up on it."""

    step: str
    text: str
    abandoned: bool = False
    by: str | None = None
    reason: str | None = None

    @classmethod
    def abandoning(cls, by: str, reason: str) -> Final:
        return cls(
            step="abandoned",
            text=f"abandoned by {by}: {reason}",
            abandoned=True,
            by=by,
            reason=reason,
        )

    def to_json(self) -> Json:
        payload: Json = {"step": self.step, "text": self.text}
        if self.abandoned:
            payload |= {"abandoned": True, "by": self.by, "reason": self.reason}
        return payload

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> Final:
        return cls(
            step=str(payload.get("step", "")),
            text=str(payload.get("text", "")),
            abandoned=bool(payload.get("abandoned")),
            by=payload.get("by"),
            reason=payload.get("reason"),
        )


# Any payload type: what ``_Pass.record`` takes.


def usage_of(payload: Mapping[str, Any]) -> tuple[int, int, int, int, float] | None:
    """What a model result paid (input, output, cache read, cache written, cost), or None.

    For the run index, on every append: read from the record without building the
    whole answer.
    """
    response = payload.get("response")
    if not isinstance(response, Mapping):
        return None
    usage = response.get("usage", (0, 0))
    cache = response.get("cache") or (0, 0)
    cost = float(payload.get("cost") or 0.0)
    return int(usage[0]), int(usage[1]), int(cache[0]), int(cache[1]), cost


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetStop:
    """The run stopped before a model call because its budget was spent (a new record
    kind, written at a ``budget{n}`` step as its intent): what was spent, against what."""

    limit: str
    spent: Mapping[str, float]
    budget: Mapping[str, float | None]
    before: str

    def to_json(self) -> Json:
        return {
            "limit": self.limit,
            "spent": dict(self.spent),
            "budget": dict(self.budget),
            "before": self.before,
        }

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> BudgetStop:
        return cls(
            limit=str(payload.get("limit", "")),
            spent=dict(payload.get("spent") or {}),
            budget=dict(payload.get("budget") or {}),
            before=str(payload.get("before", "")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetRaise:
    """A person's raise of a stopped run's budget (written at the stop's step as its
    approval): the new limits it names, who and why."""

    limits: Mapping[str, float]
    by: str
    reason: str

    def to_json(self) -> Json:
        return {"limits": dict(self.limits), "by": self.by, "reason": self.reason}

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> BudgetRaise:
        limits = payload.get("limits") or {}
        return cls(
            limits={str(k): float(v) for k, v in limits.items()},
            by=str(payload.get("by") or ""),
            reason=str(payload.get("reason") or ""),
        )


Payload = ModelResult | Intent | Outcome | Approval | Resolution | Final | BudgetStop | BudgetRaise
