"""Traces of runs on the OpenTelemetry API that know what was replayed (docs/observability.md).

One trace per run, across every pass and process: the run's trace context is a
journal record (``trace``), so a pass in another process, days later, joins the
same trace. Each pass is a span (a child of the run's ``invoke_agent`` span, linked
to the pass before); under it, one ``chat {model}`` span per generation paid for
and one ``execute_tool {tool}`` span per tool that ran. A step read back from the
journal emits nothing: the pass span counts what was replayed and what it saved.

Span ids are a digest of (trace, step, attempt), so a span exported twice (a pass
killed after the export) is the same span. The ids are chosen through the SDK
tracer's ``id_generator``; another API implementation keeps its own ids, and the
trace id and tree are the same.

A pass's marks (``trace/{fence}``) say when it began and ended. A pass that began
and never ended died with its process: the next pass exports a stand-in span for
it (same id, status error, ``asiento.pass.died``), so the steps it exported have
their parent, and records its end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final
from weakref import WeakKeyDictionary

from .. import step_ids
from ..errors import AsientoError, UsageError
from ..events import Decision, Lease, Phase, StepEvent
from ..payloads import ModelResult, Outcome, PassMark, TraceContext
from . import metrics

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

    from ..journal.base import Journal
    from ..model import ModelRequest
    from ..session import RunStats, Session

log = logging.getLogger("asiento")

#: The GenAI semantic conventions' switch for prompt and completion content.
CAPTURE_CONTENT: Final = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_DECIDED: Final = frozenset({Phase.APPROVAL, Phase.RESOLUTION})


@dataclass(frozen=True, slots=True)
class Telemetry:
    """How runs are traced: ``Agent(telemetry=Telemetry(...))``; ``True`` takes these defaults.

    ``tracer_provider``: None for the global one (``opentelemetry.trace``'s).
    ``capture_content``: record prompts, completions, tool arguments and results;
    None follows the GenAI conventions' ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``.
    """

    tracer_provider: Any = None
    capture_content: bool | None = None

    def captures(self) -> bool:
        if self.capture_content is not None:
            return self.capture_content
        return os.environ.get(CAPTURE_CONTENT, "").strip().lower() in _TRUE


def telemetry_of(value: object, where: str) -> Telemetry | None:
    """``telemetry=`` checked: a ``Telemetry``, True (defaults), or False / None (off)."""
    if value is None or value is False:
        return None
    if value is True:
        value = Telemetry()
    if not isinstance(value, Telemetry):
        raise UsageError(
            f"{where}(telemetry=...) takes True, False or Telemetry(...), got {value!r}"
        )
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            f"{where}(telemetry=...) needs the OpenTelemetry API: pip install 'asiento[otel]'"
        ) from exc
    return value


# -- chosen span ids --------------------------------------------------------------------

_CHOSEN: ContextVar[int | None] = ContextVar("asiento_span_id", default=None)
_CHOSEN_TRACE: ContextVar[int | None] = ContextVar("asiento_trace_id", default=None)


class _ChosenIds:
    """The SDK tracer's id generator, giving the span id asiento chose when it chose one."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def generate_span_id(self) -> int:
        chosen = _CHOSEN.get()
        return chosen if chosen is not None else int(self.inner.generate_span_id())

    def is_trace_id_random(self) -> bool:
        return _CHOSEN_TRACE.get() is None and bool(
            getattr(self.inner, "is_trace_id_random", lambda: True)()
        )

    def generate_trace_id(self) -> int:
        chosen = _CHOSEN_TRACE.get()
        return chosen if chosen is not None else int(self.inner.generate_trace_id())


# The span of the step under way (a model call, a tool): what its requests carry on.
_STEP: ContextVar[Span | None] = ContextVar("asiento_step_span", default=None)


@dataclass(slots=True)
class _Tool:
    """The span of a tool under way, and how it ended so far (``asiento.outcome``)."""

    span: Span
    outcome: str = "unsent"


_TOOL: ContextVar[_Tool | None] = ContextVar("asiento_tool_span", default=None)


def step_traceparent() -> dict[str, str]:
    """The W3C trace headers of the step under way (``traceparent``, ``tracestate``), for a
    request the step sends (a model request, an MCP call's ``_meta``); empty when untraced."""
    span = _STEP.get()
    if span is None:
        return {}
    return _traceparent(span)


def _traceparent(span: Span) -> dict[str, str]:
    context = span.get_span_context()
    headers = {
        "traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-"
        f"{int(context.trace_flags):02x}"
    }
    if context.trace_state:
        headers["tracestate"] = context.trace_state.to_header()
    return headers


_TRACERS: WeakKeyDictionary[Any, Tracer] = WeakKeyDictionary()


def _tracer(provider: Any) -> Tracer:
    from opentelemetry import trace

    from .. import __version__

    provider = provider or trace.get_tracer_provider()
    tracer = _TRACERS.get(provider)
    if tracer is None:
        tracer = provider.get_tracer("asiento", __version__)
        inner = getattr(tracer, "id_generator", None)
        if inner is not None:  # the SDK's tracer: asiento's spans get the ids it chooses
            tracer.id_generator = _ChosenIds(inner)
        with contextlib.suppress(TypeError):  # a provider that takes no weak reference
            _TRACERS[provider] = tracer
    return tracer


def _digest_id(trace_id: int, *parts: object) -> int:
    text = "/".join([f"{trace_id:032x}", *map(str, parts)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") or 1


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _content(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)[:65536]


# -- one pass ---------------------------------------------------------------------------


class PassTrace:
    """The spans of one pass of one run; what the pass records of its trace."""

    on: Final = True

    def __init__(
        self,
        config: Telemetry,
        *,
        run_id: str,
        agent: str,
        holder: str,
        fence: int,
        stats: RunStats,
    ) -> None:
        self.tracer = _tracer(config.tracer_provider)
        self.content = config.captures()
        self.run_id, self.agent, self.holder, self.fence = run_id, agent, holder, fence
        self.stats, self.before = stats, _counts(stats)
        self.context: Context | None = None
        self.trace_id = 0
        self.run_parent: Context | None = None  # where the run's span hangs (a caller's span)
        self.run_began = 0.0
        self.span: Span | None = None
        self.begun = False
        self.marked = False
        self.closed_run = False  # the pass closed the run: its span goes out after the commit
        self._inside: Context | None = None  # the pass's span as the steps' parent
        self._model: Span | None = None
        self._tokens: tuple[int, int] | None = None  # the paid call's, for its metrics

    # the run's context and the pass's span

    async def open(self, events: Sequence[StepEvent], store: Journal, lease: Lease | None) -> None:
        """Open the pass's span; its marks (and a new run's trace context) are durable
        before any step, in one commit."""
        await store.append(*self.begin(events), lease=lease)

    async def close(
        self, status: str, error: BaseException | None, store: Journal, lease: Lease
    ) -> None:
        """End the pass's span, then record its end mark (a commit of its own).

        The span is exported before the mark is durable: a pass killed in between gets
        a stand-in with the same id (a span seen twice, the second saying it died),
        never a span without its parent. The run's span is exported once the run's
        close is durable (``end`` rode the final commit).
        """
        ended = self.end(status, error)
        if ended is not None:
            try:
                await store.append(ended, lease=lease)
            except AsientoError as exc:  # the next pass stands in for this pass's span
                log.warning(
                    "run %r: could not mark the end of its traced pass: %s", self.run_id, exc
                )
        if self.closed_run and error is None:  # an error after end(): the close never landed
            self._run_span()
        self.closed_run = False

    def begin(self, events: Sequence[StepEvent]) -> list[StepEvent]:
        """Open the pass's span: the records to commit before anything else (the run's
        trace context, new, the pass's begin mark, the end marks of passes that died).

        The pass's begin mark is durable before the pass exports any span: a pass killed
        after its first model call ended (its ``chat`` span exported) and before its first
        step commit would otherwise leave no mark, so no stand-in and an orphaned span.
        On the run's first pass it shares the trace context's commit; a later pass pays
        one commit for it."""
        from opentelemetry import trace

        self.begun = True
        journal = {(e.step_id, e.phase): e for e in events}
        now: list[StepEvent] = []
        recorded = journal.get((step_ids.TRACE, Phase.RESULT))
        if recorded is None:
            context = _new_context()
            now.append(context_record(self.run_id, context))
            self.run_began = time.time()
        else:
            context = TraceContext.from_json(recorded.payload)
            self.run_began = recorded.created_at
        self._join(context)
        fences = step_ids.pass_fences(e.step_id for e in events)
        earlier = [f for f in dict.fromkeys(fences) if f < self.fence]
        died = [f for f in earlier if (step_ids.pass_mark(f), Phase.RESULT) not in journal]
        last_at = max((e.created_at for e in events), default=time.time())
        for fence in died:
            began = PassMark.from_json(
                journal[(step_ids.pass_mark(fence), Phase.SUBMITTED)].payload
            )
            self._stand_in(fence, began, last_at, self._link_before(fence, earlier))
            ended = PassMark(at=last_at, status="died", died=True)
            now.append(self._event(step_ids.pass_mark(fence), Phase.RESULT, ended.to_json()))
        cause = _cause(events, died)
        links = self._link_before(self.fence, earlier)
        self.span = self._start(
            f"invoke_agent {self.agent}".strip(),
            _digest_id(self.trace_id, "pass", self.fence),
            self.context,
            trace.SpanKind.INTERNAL,
            {
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.agent.name": self.agent,
                "asiento.run.id": self.run_id,
                "asiento.pass.fence": self.fence,
                "asiento.pass.cause": cause,
                "asiento.worker": self.holder,
            },
            links=links,
        )
        metrics.pass_began(cause)
        mark = PassMark(at=time.time(), cause=cause, by=self.holder)
        now.append(self._event(step_ids.pass_mark(self.fence), Phase.SUBMITTED, mark.to_json()))
        self.marked = True
        return now

    def _link_before(self, fence: int, earlier: Sequence[int]) -> list[Any]:
        """The link of pass ``fence``'s span to the traced pass before it (none for the first)."""
        from opentelemetry.trace import Link, SpanContext, TraceFlags

        before = [f for f in earlier if f < fence]
        if not before:
            return []
        previous = SpanContext(
            self.trace_id,
            _digest_id(self.trace_id, "pass", before[-1]),
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )
        return [Link(previous, {"asiento.link": "previous_pass"})]

    def _join(self, context: TraceContext) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier = {"traceparent": context.traceparent}
        if context.tracestate:
            carrier["tracestate"] = context.tracestate
        parent = TraceContextTextMapPropagator().extract(carrier)
        span_context = trace.get_current_span(parent).get_span_context()
        self.trace_id = span_context.trace_id
        root = _digest_id(self.trace_id, "run")
        # A run started under a caller's span hangs the run's span there; a run of its
        # own has a root made up from its trace, as its span has.
        self.run_parent = None if span_context.span_id == root else parent
        self.context = trace.set_span_in_context(
            trace.NonRecordingSpan(
                trace.SpanContext(
                    self.trace_id, root, is_remote=True, trace_flags=span_context.trace_flags
                )
            )
        )

    def _stand_in(self, fence: int, began: PassMark, ended_at: float, links: Sequence[Any]) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        span = self._start(
            f"invoke_agent {self.agent}".strip(),
            _digest_id(self.trace_id, "pass", fence),
            self.context,
            trace.SpanKind.INTERNAL,
            {
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.agent.name": self.agent,
                "asiento.run.id": self.run_id,
                "asiento.pass.fence": fence,
                "asiento.pass.cause": began.cause,
                "asiento.worker": began.by,
                "asiento.pass.died": True,
            },
            links=links,
            start=began.at,
        )
        span.set_status(Status(StatusCode.ERROR, "the pass's process died"))
        span.set_attribute("error.type", "process_died")
        span.end(end_time=_ns(max(ended_at, began.at)))

    def end(self, status: str, error: BaseException | None = None) -> StepEvent | None:
        """Close the pass's span, saying how it left the run; its end mark, to record."""
        if self.span is None:
            return None
        from opentelemetry.trace import Status, StatusCode

        span, self.span = self.span, None
        done = _counts(self.stats)
        for name, value in zip(_COUNTED, done, strict=True):
            span.set_attribute(name, value - self.before[_COUNTED.index(name)])
        span.set_attribute("asiento.run.status", status)
        if error is not None:
            span.set_attribute("error.type", type(error).__qualname__)
            span.set_status(Status(StatusCode.ERROR, str(error)[:500]))
        span.end()
        metrics.pass_ended(status)
        self.closed_run = status == "closed"
        if not self.marked:
            return None
        ended = PassMark(at=time.time(), status=status)
        return self._event(step_ids.pass_mark(self.fence), Phase.RESULT, ended.to_json())

    def _run_span(self) -> None:
        """The run's own span, once it closed: from its first pass to now."""
        from opentelemetry import trace

        span = self._start(
            f"invoke_agent {self.agent}".strip(),
            _digest_id(self.trace_id, "run"),
            self.run_parent,
            trace.SpanKind.INTERNAL,
            {
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.agent.name": self.agent,
                "asiento.run.id": self.run_id,
                "asiento.run.status": "closed",
            },
            start=self.run_began,
            root=self.run_parent is None,
        )
        span.end()

    # model and tool steps

    def asking(
        self, step_id: str, gateway: object, request: ModelRequest
    ) -> contextlib.AbstractContextManager[None]:
        """A generation asked for (and paid) by this pass: a CLIENT ``chat`` span."""

        def content() -> tuple[Any, str | None]:
            return [m.to_json() for m in request.messages], request.instructions

        model = str(getattr(gateway, "model", "") or "")
        return self.generating(step_id, model, provider_of(gateway), content)

    @contextlib.contextmanager
    def generating(
        self,
        step_id: str,
        model: str,
        provider: str,
        content: Callable[[], tuple[Any, str | None]],
    ) -> Iterator[None]:
        """A generation asked for (and paid) by this pass, however it was asked (a native
        gateway, a framework's model): a CLIENT ``chat`` span. ``content()``: the request's
        messages (JSON) and instructions, read only when content is captured."""
        from opentelemetry import trace

        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider,
            "asiento.run.id": self.run_id,
            "asiento.step.id": step_id,
            "asiento.attempt": self.fence,
        }
        if model:
            attributes["gen_ai.request.model"] = model
        if self.content:
            messages, instructions = content()
            attributes["gen_ai.input.messages"] = _content(messages)
            if instructions:
                attributes["gen_ai.system_instructions"] = instructions
        self._model = self._start(
            f"chat {model}".strip(),
            _digest_id(self.trace_id, step_id, self.fence),
            self._parent(),
            trace.SpanKind.CLIENT,
            attributes,
        )
        outer, began, error = _STEP.get(), time.monotonic(), None
        _STEP.set(self._model)
        try:
            yield
        except BaseException as exc:
            _failed(self._model, exc)
            error = type(exc).__qualname__
            raise
        finally:
            _STEP.set(outer)  # not reset(): a stream may be closed from another context
            self._model.end()
            self._model = None
            measured: dict[str, Any] = {k: attributes[k] for k in _MODEL_METRIC if k in attributes}
            if error is not None:
                measured["error.type"] = error
            metrics.model_called(time.monotonic() - began, measured, self._tokens)
            self._tokens = None

    def answered(self, result: ModelResult) -> None:
        """What the generation cost, on its span (called before it is recorded)."""
        span = self._model
        if span is None:
            return
        response, usage = result.response, result.response.usage
        self._tokens = (usage.input_tokens, usage.output_tokens)
        found: dict[str, Any] = {
            "gen_ai.usage.input_tokens": usage.input_tokens,
            "gen_ai.usage.output_tokens": usage.output_tokens,
        }
        if response.model:
            found["gen_ai.response.model"] = response.model
        if response.request_id:
            found["gen_ai.response.id"] = response.request_id
        if usage.cached_input_tokens:
            found["gen_ai.usage.cache_read.input_tokens"] = usage.cached_input_tokens
        if usage.cache_write_tokens:
            found["gen_ai.usage.cache_creation.input_tokens"] = usage.cache_write_tokens
        if result.cost is not None:
            found["asiento.cost"] = result.cost
        if result.repaid:  # asked again after cut attempts, each paid and lost
            found["asiento.reask"], found["asiento.repaid"] = True, result.repaid
        if response.kept:  # the proxy answered from the generation it kept: nothing paid
            found["asiento.kept"] = True
        if self.content:
            calls = [c.to_json() for c in response.tool_calls]
            found["gen_ai.output.messages"] = _content({"text": response.text, "tool_calls": calls})
        span.set_attributes(found)  # one lock, not one a key

    @contextlib.contextmanager
    def executing(
        self,
        step_id: str,
        attempt_id: str,
        name: str,
        call_id: str,
        arguments: Mapping[str, Any],
        *,
        resent: bool = False,
    ) -> Iterator[None]:
        """A tool that runs in this pass: an ``execute_tool`` span (``resent``: the same
        attempt's call sent again under its key, a span of its own)."""
        from opentelemetry import trace

        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.call.id": call_id,
            "asiento.run.id": self.run_id,
            "asiento.step.id": step_id,
            "asiento.attempt.id": attempt_id,
        }
        if self.content:
            attributes["gen_ai.tool.call.arguments"] = _content(dict(arguments))
        if resent:
            attributes["asiento.resent"] = True
        tool = _Tool(
            self._start(
                f"execute_tool {name}",
                _digest_id(self.trace_id, attempt_id, "tool", *(["resent"] if resent else [])),
                self._parent(),
                trace.SpanKind.INTERNAL,
                attributes,
            )
        )
        outer, outer_tool, began = _STEP.get(), _TOOL.get(), time.monotonic()
        _STEP.set(tool.span)
        _TOOL.set(tool)  # per task: a framework runs an answer's tool calls side by side
        try:
            yield
        except BaseException as exc:
            from ..errors import UncertainEffect

            tool.outcome = "uncertain" if isinstance(exc, UncertainEffect) else "unsent"
            tool.span.set_attribute("asiento.outcome", tool.outcome)
            _failed(tool.span, exc)
            raise
        finally:
            _STEP.set(outer)  # not reset(): a stream may be closed from another context
            _TOOL.set(outer_tool)
            tool.span.end()
            metrics.tool_ran(time.monotonic() - began, name, tool.outcome)

    def executed(self, outcome: Outcome, decision: Decision, *, reconciled: bool = False) -> None:
        """How the tool ended, on its span (before the outcome is recorded); ``reconciled``:
        the destination answered from its own record (a key it had), nothing applied again."""
        tool = _TOOL.get()
        if tool is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span = tool.span
        if outcome.status == "ok":
            applied = "approved" if decision is Decision.APPROVED else "applied"
            found = reconciled or outcome.via == "lookup"  # the destination had it
            tool.outcome = "reconciled" if found else applied
            span.set_attribute("asiento.outcome", tool.outcome)
        else:
            tool.outcome = "failed"
            span.set_attribute("asiento.outcome", "failed")
            span.set_attribute("error.type", "tool_error")
            span.set_status(Status(StatusCode.ERROR, (outcome.error or "")[:500]))
        if self.content:
            span.set_attribute("gen_ai.tool.call.result", _content(outcome.shown))

    def noted(self, event: str, step_id: str, tool: str, **more: str) -> None:
        """Something this pass decided about a step without running it (a denial, a wait
        for a person, an uncertain effect): an event on the pass's span."""
        if self.span is not None:
            attributes = {"asiento.step.id": step_id, "gen_ai.tool.name": tool}
            self.span.add_event(event, {**attributes, **more})

    # a framework's pass (asiento.integrations)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """The pass's span as the current OpenTelemetry context while a framework runs the
        pass, so the framework's own spans (Pydantic AI's ``instrument=True``) nest under it."""
        from opentelemetry import context as otel_context

        if self.span is None:
            yield
            return
        token = otel_context.attach(self._parent() or otel_context.Context())
        try:
            yield
        finally:
            otel_context.detach(token)

    def framework_step(self, step_id: str) -> bool:
        """Whether the framework's own span of step ``step_id`` is current (its
        instrumentation opened it before asiento's model or tool was reached: a recording
        span that is not the pass's). It is then the step's span: it gets the step's ids
        (``asiento.run.id``, ``asiento.step.id``) and asiento adds no span of its own for
        the step, not to count it twice."""
        span = self._framework_span()
        if span is not None:
            span.set_attributes({"asiento.run.id": self.run_id, "asiento.step.id": step_id})
        return span is not None

    def framework_traceparent(self) -> dict[str, str]:
        """The W3C trace headers of the framework's span of the step (``framework_step``),
        for the request the step sends; empty without one."""
        span = self._framework_span()
        return {} if span is None else _traceparent(span)

    def _framework_span(self) -> Span | None:
        from opentelemetry import trace

        current = trace.get_current_span()
        return current if current is not self.span and current.is_recording() else None

    # plumbing

    def _parent(self) -> Context | None:
        from opentelemetry import trace

        if self.span is None:
            return self.context
        if self._inside is None:
            self._inside = trace.set_span_in_context(self.span)
        return self._inside

    def _start(
        self,
        name: str,
        span_id: int,
        parent: Context | None,
        kind: Any,
        attributes: Mapping[str, Any],
        *,
        links: Sequence[Any] = (),
        start: float | None = None,
        root: bool = False,
    ) -> Span:
        from opentelemetry import context as otel_context

        if root:  # no parent, this trace's id: the SDK's generator is asked for it
            parent = otel_context.Context()
        token, trace_token = _CHOSEN.set(span_id), _CHOSEN_TRACE.set(self.trace_id)
        try:
            return self.tracer.start_span(
                name,
                context=parent,
                kind=kind,
                attributes=attributes,
                links=links,
                start_time=None if start is None else _ns(start),
            )
        finally:
            _CHOSEN.reset(token)
            _CHOSEN_TRACE.reset(trace_token)

    def _event(self, step_id: str, phase: Phase, payload: Mapping[str, Any]) -> StepEvent:
        return StepEvent(run_id=self.run_id, step_id=step_id, phase=phase, payload=payload)


class Off:
    """Telemetry off: every hook is a no-op, so a pass pays nothing for it."""

    on: Final = False
    begun: Final = True

    async def open(self, events: Sequence[StepEvent], store: Journal, lease: Lease | None) -> None:
        return None

    async def close(
        self, status: str, error: BaseException | None, store: Journal, lease: Lease
    ) -> None:
        return None

    def end(self, status: str, error: BaseException | None = None) -> StepEvent | None:
        return None

    def asking(
        self, step_id: str, gateway: object, request: ModelRequest
    ) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def generating(
        self,
        step_id: str,
        model: str,
        provider: str,
        content: Callable[[], tuple[Any, str | None]],
    ) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def answered(self, result: ModelResult) -> None:
        return None

    def executing(
        self,
        step_id: str,
        attempt_id: str,
        name: str,
        call_id: str,
        arguments: Mapping[str, Any],
        *,
        resent: bool = False,
    ) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def executed(self, outcome: Outcome, decision: Decision, *, reconciled: bool = False) -> None:
        return None

    def noted(self, event: str, step_id: str, tool: str, **more: str) -> None:
        return None

    def current(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def framework_step(self, step_id: str) -> bool:
        return False

    def framework_traceparent(self) -> dict[str, str]:
        return {}


OFF: Final = Off()


def for_pass(
    config: Telemetry | None, agent: str, session: Session, lease: Lease
) -> PassTrace | Off:
    """The trace of the pass ``session`` drives under ``lease``, or ``OFF``."""
    if config is None:
        return OFF
    holder = dataclasses.replace(session.holder, owner=lease.owner).describe()
    return PassTrace(
        config,
        run_id=session.run_id,
        agent=agent,
        holder=holder,
        fence=lease.token,
        stats=session.stats,
    )


# -- helpers ----------------------------------------------------------------------------

_MODEL_METRIC: Final = ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model")
_COUNTED: Final = (
    "asiento.executed.model_calls",
    "asiento.executed.tool_calls",
    "asiento.replayed.model_calls",
    "asiento.replayed.tool_calls",
    "asiento.repaid.model_calls",
    "asiento.saved.input_tokens",
    "asiento.saved.output_tokens",
    "asiento.saved.cost",
)


def _counts(stats: RunStats) -> tuple[float, ...]:
    return (
        stats.model_calls,
        stats.tool_calls,
        stats.model_calls_replayed,
        stats.tool_calls_replayed,
        stats.model_calls_repaid,
        stats.input_tokens_saved,
        stats.output_tokens_saved,
        stats.cost_saved,
    )


def status_of(exc: BaseException) -> str:
    """How a pass left the run when it ended with ``exc`` (``asiento.run.status``)."""
    import asyncio

    from .. import shutdown
    from ..errors import LeaseLost, UncertainEffect

    if isinstance(exc, UncertainEffect):
        return "uncertain"
    if isinstance(exc, shutdown.ShutdownRequested | GeneratorExit | asyncio.CancelledError):
        return "stopped"
    if isinstance(exc, LeaseLost):
        return "lease_lost"
    return "failed"


def caller_context() -> TraceContext | None:
    """The caller's current span as a run's trace context (a web request that submits a
    run, say); None without one, or without the OpenTelemetry API."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    current = trace.get_current_span().get_span_context()
    if not current.is_valid:
        return None
    flags = int(current.trace_flags)
    return TraceContext(
        traceparent=f"00-{current.trace_id:032x}-{current.span_id:016x}-{flags:02x}",
        tracestate=current.trace_state.to_header() if current.trace_state else "",
    )


def context_record(run_id: str, context: TraceContext) -> StepEvent:
    """The journal record of a run's trace context."""
    return StepEvent(
        run_id=run_id, step_id=step_ids.TRACE, phase=Phase.RESULT, payload=context.to_json()
    )


def _new_context() -> TraceContext:
    """The run's trace: the caller's current one (a web request's, say), else a new one."""
    caller = caller_context()
    if caller is not None:
        return caller
    trace_id = int.from_bytes(secrets.token_bytes(16), "big") or 1
    root = _digest_id(trace_id, "run")
    return TraceContext(traceparent=f"00-{trace_id:032x}-{root:016x}-01")


def _cause(events: Sequence[StepEvent], died: Sequence[int]) -> str:
    """Why the pass began: the run's first, after a person decided, after a death, or resumed."""
    steps = [e for e in events if not step_ids.is_trace(e.step_id)]
    if not steps:  # none recorded yet: the run's first pass, or one after it died early
        return "taken_over" if died else "first"
    if steps[-1].phase in _DECIDED:
        return "decided"
    return "taken_over" if died else "resumed"


def provider_of(gateway: object) -> str:
    """The ``gen_ai.provider.name`` of a gateway or a framework's model, from its class."""
    kind = type(gateway).__name__.lower()
    for name in ("openai", "anthropic"):
        if name in kind:
            return name
    return str(getattr(gateway, "provider_name", "") or kind.removesuffix("gateway") or "unknown")


def _failed(span: Span, exc: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", type(exc).__qualname__)
    span.set_status(Status(StatusCode.ERROR, str(exc)[:500]))
