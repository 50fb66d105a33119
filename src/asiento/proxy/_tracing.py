"""The proxy's spans: a request that arrives with a W3C ``traceparent`` joins its trace.

The proxy's work for such a request is a SERVER span (``POST /v1/chat/completions``),
a child of the incoming context, saying how it was answered
(``asiento.proxy.answer``: ``upstream``, ``replayed``, ``attached``, ``conflict``,
``in_flight`` or ``forwarded``; ``asiento.proxy.kept`` for an answer asked upstream
and kept under its key). The upstream request carries the proxy's span on as its
``traceparent``, in place of the client's.

Only with the OpenTelemetry API installed (``asiento[otel]``), and only for a request
that carries a ``traceparent``: any other costs a header lookup. The tracer is the
global provider's (``opentelemetry.trace.get_tracer("asiento.proxy")``); without an SDK
set up, the incoming context is forwarded upstream as it came.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterable, AsyncIterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final

from starlette.responses import Response, StreamingResponse

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from starlette.requests import Request

TRACE_HEADERS: Final = ("traceparent", "tracestate")

# The span of the request being handled (copied into the tasks the proxy spawns for it).
_SPAN: ContextVar[Span | None] = ContextVar("asiento_proxy_span", default=None)


@functools.cache
def available() -> bool:
    """Whether the OpenTelemetry API is installed (looked for once)."""
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        return False
    return True


def traced(request: Request) -> bool:
    """Whether this request's handling is a span: it carries a ``traceparent``, and the
    API is installed."""
    return "traceparent" in request.headers and available()


class Joined:
    """A request's SERVER span, current while it is handled; ended with its response."""

    def __init__(self, request: Request) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from .. import __version__

        carrier = {n: request.headers[n] for n in TRACE_HEADERS if n in request.headers}
        parent = TraceContextTextMapPropagator().extract(carrier)
        path = request.url.path
        tracer = trace.get_tracer("asiento.proxy", __version__)
        attributes = {"http.request.method": request.method, "url.path": path, "http.route": path}
        kind = trace.SpanKind.SERVER
        self.span = tracer.start_span(f"{request.method} {path}", parent, kind, attributes)
        self._token = _SPAN.set(self.span)
        self._attached = context.attach(trace.set_span_in_context(self.span))

    def failed(self, exc: BaseException) -> None:
        """The handling raised: the span says so and ends."""
        from opentelemetry.trace import Status, StatusCode

        self.span.record_exception(exc)
        self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        self._leave()
        self.span.end()

    def ends_with(self, response: Response) -> Response:
        """``response``, the span ended once its body is sent: a stream's last chunk, not
        its first, ends it (what a recorded stream replays, or upstream trickles)."""
        self._leave()
        if not isinstance(response, StreamingResponse):
            self.span.end()
            return response
        response.body_iterator = self._then_end(response.body_iterator)
        return response

    async def _then_end(self, body: AsyncIterable[Any]) -> AsyncIterator[Any]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            self.span.end()

    def _leave(self) -> None:
        from opentelemetry import context

        context.detach(self._attached)
        _SPAN.reset(self._token)


def answered(status: int) -> None:
    """The response's status on the request's span (a 5xx is an error)."""
    span = _SPAN.get()
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_attribute("error.type", str(status))
        span.set_status(Status(StatusCode.ERROR))


def note(answer: str, *, kept: bool | None = None) -> None:
    """How the request was answered, on its span (nothing when it has none)."""
    span = _SPAN.get()
    if span is None:
        return
    span.set_attribute("asiento.proxy.answer", answer)
    if kept is not None:
        span.set_attribute("asiento.proxy.kept", kept)


def carry_on(headers: dict[str, str]) -> None:
    """The upstream request's trace headers: the proxy's span's, in place of the client's."""
    span = _SPAN.get()
    if span is None:
        return
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    for name in TRACE_HEADERS:
        headers.pop(name, None)
    TraceContextTextMapPropagator().inject(headers, context=trace.set_span_in_context(span))
