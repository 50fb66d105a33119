"""Why a model call failed, said once for every provider; and what the gateways share.

    RunError
    └── ModelCallFailed          a model step got no answer that can be recorded
        ├── ModelRequestRejected the provider said the request is wrong (a 4xx): fix, resume
        ├── ModelUnavailable     rate limits, 5xx or the network outlasted the retries: resume
        │   └── RateLimited      the provider's 429s outlasted asiento's retries: resume later
        └── ModelResponseInvalid the model's answer cannot be parsed: it is never recorded

None of them records anything: the step stays without a result, so running
the same ``run_id`` again resumes exactly there, with the same idempotency key.
An answer that parses but whose tool-call arguments hold values JSON cannot
carry (``NaN``, ``Infinity``, an integer past Python's digit limit) is not an
error: it is recorded, and the call's ``problem`` becomes its step's outcome.
``read_answer`` is the one rule for what an answer may be recorded: the
gateways apply it, and ``asiento gateway`` keeps only the answers it accepts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from .. import _unfit_json
from .._crash import crash_point
from ..errors import RunError, UsageError
from ..model import ModelResponse, ToolCall, check_response, recordable_call

#: Statuses that mean "later" (as do 5xx): when they outlast the retries, ModelUnavailable.
TRANSIENT_STATUSES = frozenset({408, 409, 425, 429})


class ModelCallFailed(RunError):
    """A model step could not get an answer to record. Nothing was recorded."""

    def __init__(
        self,
        idempotency_key: str,
        detail: str,
        *,
        status: int | None = None,
        request_id: str | None = None,
    ) -> None:
        self.run_id, self.step_id = split_key(idempotency_key)
        self.idempotency_key, self.status, self.request_id = idempotency_key, status, request_id
        super().__init__(f"run {self.run_id!r} step {self.step_id!r}: {detail}")


class ModelRequestRejected(ModelCallFailed):
    """The provider refused the request as wrong (4xx): retrying it unchanged cannot help."""


class ModelUnavailable(ModelCallFailed):
    """Rate limits, server errors or the network outlasted the retries."""


class RateLimited(ModelUnavailable):
    """The provider kept answering 429 (its rate limit) past asiento's retries.

    ``retries`` is how many times the request was sent again. Nothing was paid:
    a 429 is not processed.
    """

    retries: int = 0


class ModelResponseInvalid(ModelCallFailed):
    """The model's answer cannot be recorded and replayed: its fault, not the caller's."""


class Parser(Protocol):
    """How one wire format's answer (a JSON object) becomes a ``ModelResponse``."""

    def __call__(
        self, body: Mapping[str, Any], *, provider: str, key: str, request_id: str | None
    ) -> ModelResponse: ...


def split_key(idempotency_key: str) -> tuple[str, str]:
    """(run_id, step_id) from ``run_id:step_id:fingerprint``; run ids may hold colons."""
    parts = idempotency_key.rsplit(":", 2)
    if len(parts) != 3:
        return "?", idempotency_key
    return parts[0], parts[1]


def rejected(
    provider: str, key: str, status: int, message: str, request_id: str | None
) -> ModelRequestRejected:
    """The error for a 4xx answer: what was refused, and that a fix then a resume is the way."""
    what = _reused_key_hint(message) or "fix the request (model name, API key, options)"
    return ModelRequestRejected(
        key,
        f"{provider} refused the model request ({status}: {_short(message)}). Nothing was "
        f"recorded for this step; {what}, then run the same run_id again to resume here",
        status=status,
        request_id=request_id,
    )


def unavailable(
    provider: str, key: str, cause: str, *, status: int | None = None, request_id: str | None = None
) -> ModelUnavailable:
    """The error when retries ran out: nothing recorded, resume later with the same key."""
    return ModelUnavailable(
        key,
        f"{provider} gave no answer after its retries ({_short(cause)}). Nothing was recorded "
        "for this step; run the same run_id again later to resume here (the request carries "
        "the same idempotency key)",
        status=status,
        request_id=request_id,
    )


def rate_limited(
    provider: str, key: str, message: str, retries: int, request_id: str | None
) -> RateLimited:
    """The error when 429s outlasted the retries: nothing paid, resume later or lower the pace."""
    error = RateLimited(
        key,
        f"{provider} kept refusing the request with 429 (rate limited: {_short(message)}) "
        f"after {retries} retries. Nothing was recorded or paid for this step; run the same "
        "run_id again later to resume here (the request carries the same idempotency key), "
        "or lower the pace with a Quota (requests_per_minute, tokens_per_minute)",
        status=429,
        request_id=request_id,
    )
    error.retries = retries
    return error


def invalid(provider: str, key: str, detail: str, request_id: str | None) -> ModelResponseInvalid:
    """The error for an answer that cannot be recorded; the step stays unanswered."""
    return ModelResponseInvalid(
        key,
        f"{provider} answered with something that cannot be recorded ({_short(detail)}). "
        "It was not recorded; run the same run_id again to ask for this step again",
        request_id=request_id,
    )


def status_error(provider: str, key: str, exc: Any) -> ModelCallFailed:
    """Translate an SDK ``APIStatusError`` (after the SDK's own retries) into our tree."""
    status = int(exc.status_code)
    request_id = getattr(exc, "request_id", None)
    message = str(exc.message)
    if status in TRANSIENT_STATUSES or status >= 500:
        cause = f"{status}: {message}"
        return unavailable(provider, key, cause, status=status, request_id=request_id)
    return rejected(provider, key, status, message, request_id)


def read_answer(
    parse: Parser, content: bytes, *, provider: str, key: str, request_id: str | None
) -> ModelResponse:
    """The answer as the agent will record it, or ``ModelResponseInvalid`` saying why not.

    What the agent's ``check_response`` would refuse is refused here, as the
    model's fault, so nothing a gateway returns can be refused later.
    """
    body = parse_body(provider, key, content, request_id)
    return answer_from(parse, body, provider=provider, key=key, request_id=request_id)


def answer_from(
    parse: Parser, body: Mapping[str, Any], *, provider: str, key: str, request_id: str | None
) -> ModelResponse:
    """``read_answer`` for a body already decoded (a streamed answer, assembled)."""
    request_id = request_id or nonempty(body.get("id"))
    response = parse(body, provider=provider, key=key, request_id=request_id)
    try:
        return check_response(response, where="the answer")
    except UsageError as exc:
        raise invalid(provider, key, str(exc), request_id) from None


def parse_body(provider: str, key: str, content: bytes, request_id: str | None) -> dict[str, Any]:
    """The answer's JSON object (unfit values kept as such), or ``ModelResponseInvalid``."""
    try:
        body = _unfit_json.loads(content)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise invalid(provider, key, f"the body is not JSON: {exc}", request_id) from None
    if not isinstance(body, dict):
        raise invalid(provider, key, "the body is not a JSON object", request_id)
    return body


def tool_call(
    provider: str, key: str, request_id: str | None, *, name: str, raw: Any, call_id: str
) -> ToolCall:
    """One tool call of the answer; arguments sent as text are decoded.

    Arguments holding values JSON cannot carry make a call with a ``problem``
    (recorded, and fed to the model); arguments that are not a JSON object are
    refused.
    """
    text = raw if isinstance(raw, str) else None
    if text is not None:
        try:
            raw = _unfit_json.loads(text) if text.strip() else {}
        except (ValueError, RecursionError):
            detail = f"tool-call arguments are not valid JSON (cut short?): {text[:80]!r}"
            raise invalid(provider, key, detail, request_id) from None
    if not isinstance(raw, Mapping):
        raise invalid(provider, key, "tool-call arguments are not a JSON object", request_id)
    call = ToolCall(name=name, arguments=dict(raw), id=call_id)
    try:
        return recordable_call(call, raw_arguments=text)
    except (TypeError, ValueError, RecursionError) as exc:
        detail = f"tool-call arguments are not JSON: {exc}"
        raise invalid(provider, key, detail, request_id) from None


def answered(response: ModelResponse) -> ModelResponse:
    """Hand the parsed answer back; a test may kill the process here (paid, not recorded)."""
    crash_point("inside_model_call")
    return response


def usage_fields(usage: Any, *fields: str) -> list[int]:
    """Token counts as the provider reported them; a missing, null or odd figure counts as 0.

    A field ``a.b`` is read inside the object ``a`` (``prompt_tokens_details.cached_tokens``).
    """
    return [_count(_field(usage, name.split("."))) for name in fields]


def _field(data: Any, path: list[str]) -> Any:
    for name in path:
        data = data.get(name) if isinstance(data, Mapping) else None
    return data


def nonempty(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def sdk_missing(package: str, extra: str) -> UsageError:
    return UsageError(f"this gateway needs the {package!r} package: pip install 'asiento[{extra}]'")


def _reused_key_hint(message: str) -> str:
    if "idempotency" not in message.lower():
        return ""
    return (
        "the idempotency gateway already holds an answer for this step made from another "
        "request body (the model or its options changed since the step was sent); resume "
        "with the original model and options, or let the key expire"
    )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
