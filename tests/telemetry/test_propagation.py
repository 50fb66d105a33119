"""The step's trace context travels (#24 item 4): in the model requests of the SDK gateways,
through ``asiento gateway`` (a span of the same trace, carried on upstream), and in the
``_meta`` of MCP tool calls. Real SDKs, a real proxy and a real MCP server on 127.0.0.1;
the real OpenTelemetry SDK with an in-memory exporter."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from asiento import (
    Agent,
    Gateway,
    ModelResponse,
    Session,
    SqliteCheckpointer,
    Telemetry,
    ToolCall,
    tool,
)
from asiento.gateways import AnthropicGateway, OpenAIGateway
from asiento.mcp import McpServer
from asiento.proxy import create_app
from asiento.telemetry import tracing
from asiento.testing import ScriptedGateway
from mcp_tools.rig import SERVER
from providers.fake_servers import Answer, AsgiServer, FakeProvider, Received

RUN = "run-1"
MCP_CHILD = Path(__file__).with_name("mcp_child.py")
SCRIPT = (Answer(calls=(("read", {"path": "/x"}),)), Answer(text="done"))


@tool(idempotent=True)
def read(path: str) -> str:
    """Read a file."""
    return f"contents of {path}"


@functools.cache
def _global_exporter() -> InMemorySpanExporter:
    """The spans of the global provider (the proxy's), set up once in this process."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture
def proxy_spans() -> InMemorySpanExporter:
    exporter = _global_exporter()
    exporter.clear()
    return exporter


async def _drive(gateway: Gateway, db: Path, *, telemetry: Any, stream: bool = False) -> None:
    agent = Agent(tools=[read], telemetry=telemetry)
    store = SqliteCheckpointer(db)
    try:
        session = Session(RUN, gateway, store)
        async for _ in agent.run("read /x", session=session, stream=stream):  # type: ignore[call-overload]
            pass
    finally:
        await store.close()


def _parent(traceparent: str) -> tuple[int, int]:
    """(trace id, parent span id) of a W3C ``traceparent``."""
    version, trace_id, span_id, flags = traceparent.split("-")
    assert (version, len(trace_id), len(span_id), len(flags)) == ("00", 32, 16, 2)
    return int(trace_id, 16), int(span_id, 16)


def _chats(found: tuple[ReadableSpan, ...]) -> list[ReadableSpan]:
    chats = [s for s in found if s.name.startswith("chat") and s.kind is SpanKind.CLIENT]
    return sorted(chats, key=lambda s: s.start_time or 0)


def _model_requests(provider: FakeProvider, path: str) -> list[Received]:
    return [r for r in provider.requests if r.path == path]


def _ids(span: ReadableSpan) -> tuple[int, int]:
    context = span.get_span_context()
    assert context is not None
    return context.trace_id, context.span_id


def _parent_ids(span: ReadableSpan) -> tuple[int, int]:
    assert span.parent is not None
    return span.parent.trace_id, span.parent.span_id


# -- the gateways' model requests -----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_a_traced_runs_model_requests_carry_its_chat_spans(
    spans: tuple[TracerProvider, InMemorySpanExporter], tmp_path: Path, kind: str, stream: bool
) -> None:
    """Each generation's request carries ``traceparent``: the run's trace, the ``chat``
    span of that generation as its parent."""
    tracer_provider, exporter = spans
    with FakeProvider(SCRIPT) as provider:
        gateway: OpenAIGateway | AnthropicGateway
        if kind == "openai":
            gateway, path = (
                OpenAIGateway("gpt-test", base_url=provider.openai_url, api_key="k"),
                ("/v1/chat/completions"),
            )
        else:
            gateway = AnthropicGateway("claude-test", base_url=provider.anthropic_url, api_key="k")
            path = "/v1/messages"
        async with gateway:
            await _drive(
                gateway,
                tmp_path / "runs.db",
                telemetry=Telemetry(tracer_provider=tracer_provider),
                stream=stream,
            )
    chats = _chats(exporter.get_finished_spans())
    requests = _model_requests(provider, path)
    assert len(chats) == len(requests) == 2
    for chat, request in zip(chats, requests, strict=True):
        assert _parent(request.headers["traceparent"]) == _ids(chat)
        assert "idempotency-key" in request.headers
    (trace_id,) = {_ids(chat)[0] for chat in chats}
    assert trace_id != 0


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_an_untraced_run_sends_no_trace_headers(tmp_path: Path, kind: str) -> None:
    """Tracing off: the requests carry the key and nothing of a trace."""
    with FakeProvider(SCRIPT) as provider:
        gateway: OpenAIGateway | AnthropicGateway = (
            OpenAIGateway("gpt-test", base_url=provider.openai_url, api_key="k")
            if kind == "openai"
            else AnthropicGateway("claude-test", base_url=provider.anthropic_url, api_key="k")
        )
        async with gateway:
            await _drive(gateway, tmp_path / "runs.db", telemetry=False)
    assert len(provider.requests) == 2
    for request in provider.requests:
        assert "idempotency-key" in request.headers
        assert "traceparent" not in request.headers
        assert "tracestate" not in request.headers
    assert tracing.step_traceparent() == {}


# -- through the proxy ----------------------------------------------------------------------


async def test_the_proxy_joins_the_runs_trace_and_carries_it_upstream(
    spans: tuple[TracerProvider, InMemorySpanExporter],
    proxy_spans: InMemorySpanExporter,
    tmp_path: Path,
) -> None:
    """Each model request through the proxy is a SERVER span of the run's trace, a child of
    its ``chat`` span, saying it was asked upstream and kept; upstream's request has the
    proxy's span as its parent. The same request again is a span saying it was replayed."""
    tracer_provider, exporter = spans
    with (
        FakeProvider(SCRIPT) as provider,
        AsgiServer(create_app(provider.openai_url, db=tmp_path / "keys.db")) as proxy,
    ):
        async with OpenAIGateway("gpt-test", base_url=proxy.url + "/v1", api_key="k") as gateway:
            await _drive(
                gateway, tmp_path / "runs.db", telemetry=Telemetry(tracer_provider=tracer_provider)
            )
        chats = _chats(exporter.get_finished_spans())
        served = sorted(proxy_spans.get_finished_spans(), key=lambda s: s.start_time or 0)
        upstream = _model_requests(provider, "/v1/chat/completions")
        assert len(chats) == len(served) == len(upstream) == 2
        for chat, span, request in zip(chats, served, upstream, strict=True):
            assert span.name == "POST /v1/chat/completions"
            assert span.kind is SpanKind.SERVER
            assert span.instrumentation_scope is not None
            assert span.instrumentation_scope.name == "asiento.proxy"
            assert _parent_ids(span) == _ids(chat)
            attributes = dict(span.attributes or {})
            assert attributes["asiento.proxy.answer"] == "upstream"
            assert attributes["asiento.proxy.kept"] is True
            assert attributes["http.response.status_code"] == 200
            assert _parent(request.headers["traceparent"]) == _ids(span)

        # The first generation's request again, with its key and context: replayed.
        first = upstream[0]
        proxy_spans.clear()
        async with openai.AsyncOpenAI(api_key="k", base_url=proxy.url + "/v1") as client:
            again = await client.chat.completions.with_raw_response.create(
                **first.body,
                extra_headers={
                    "Idempotency-Key": first.headers["idempotency-key"],
                    "traceparent": first.headers["traceparent"],
                },
            )
        assert again.headers["idempotent-replayed"] == "true"
        (replayed,) = proxy_spans.get_finished_spans()
        assert dict(replayed.attributes or {})["asiento.proxy.answer"] == "replayed"
        assert _parent_ids(replayed) == _ids(served[0])  # the context it was sent
        assert len(_model_requests(provider, "/v1/chat/completions")) == 2


def _let_go(provider: FakeProvider, go_on: threading.Event) -> None:
    """Let the held stream go on half a second after its generation began."""
    for _ in range(200):  # at most 10 s
        if provider.generations:
            break
        time.sleep(0.05)
    time.sleep(0.5)
    go_on.set()


async def test_the_proxys_span_of_a_stream_ends_with_the_stream(
    spans: tuple[TracerProvider, InMemorySpanExporter],
    proxy_spans: InMemorySpanExporter,
    tmp_path: Path,
) -> None:
    """A streamed answer the proxy records is one SERVER span from the request to the
    stream's last chunk (it ended when the stream started: a few milliseconds for a
    stream upstream held for half a second after its first event), inside the run's
    ``chat`` span."""
    tracer_provider, exporter = spans
    with (
        FakeProvider(SCRIPT) as provider,
        AsgiServer(create_app(provider.openai_url, db=tmp_path / "keys.db")) as proxy,
    ):
        go_on = provider.hold_stream(after=0)
        threading.Thread(target=_let_go, args=(provider, go_on), daemon=True).start()
        async with OpenAIGateway("gpt-test", base_url=proxy.url + "/v1", api_key="k") as gateway:
            telemetry = Telemetry(tracer_provider=tracer_provider)
            await _drive(gateway, tmp_path / "runs.db", telemetry=telemetry, stream=True)
        chats = _chats(exporter.get_finished_spans())
        served = sorted(proxy_spans.get_finished_spans(), key=lambda s: s.start_time or 0)
    assert len(chats) == len(served) == 2
    first, chat = served[0], chats[0]
    assert dict(first.attributes or {})["asiento.proxy.answer"] == "upstream"
    assert _parent_ids(first) == _ids(chat)
    assert first.start_time is not None
    assert first.end_time is not None
    assert first.end_time - first.start_time >= 400_000_000  # ns: the held stream
    assert chat.end_time is not None
    assert first.end_time <= chat.end_time


async def test_the_proxy_traces_nothing_for_a_request_without_traceparent(
    proxy_spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    """An untraced run through the proxy: no proxy span, no trace headers upstream."""
    with (
        FakeProvider(SCRIPT) as provider,
        AsgiServer(create_app(provider.openai_url, db=tmp_path / "keys.db")) as proxy,
    ):
        async with OpenAIGateway("gpt-test", base_url=proxy.url + "/v1", api_key="k") as gateway:
            await _drive(gateway, tmp_path / "runs.db", telemetry=False)
    assert len(provider.requests) == 2
    assert all("traceparent" not in r.headers for r in provider.requests)
    assert proxy_spans.get_finished_spans() == ()


# -- MCP tool calls ---------------------------------------------------------------------------


def test_an_mcp_tool_call_carries_the_execute_tool_span_in_its_meta(tmp_path: Path) -> None:
    """``tools/call`` of a traced run carries ``_meta.traceparent`` (beside the key): the
    run's trace, its ``execute_tool`` span as the parent; an untraced run's, no trace context.
    In a process of its own, with no global tracer provider (the MCP SDK's spans no-ops)."""
    done = subprocess.run(
        [sys.executable, str(MCP_CHILD), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    trace_id, span_id = (int(x, 16) for x in seen["execute_tool"])
    assert _parent(seen["traced"]["traceparent"]) == (trace_id, span_id)
    assert seen["traced"]["asiento/idempotency-key"] == seen["untraced"]["asiento/idempotency-key"]
    assert not {"traceparent", "tracestate"} & set(seen["untraced"])


async def test_an_mcp_sdk_span_of_the_call_stays_in_the_runs_trace(
    spans: tuple[TracerProvider, InMemorySpanExporter],
    proxy_spans: InMemorySpanExporter,
    tmp_path: Path,
) -> None:
    """With an SDK provider set up globally (as here), the MCP SDK makes the call a span of
    its own and writes it in ``_meta``: that span is a child of ``execute_tool``, in the
    run's trace, not the root of a trace of its own. An untraced run's call is in no run's
    trace."""
    tracer_provider, exporter = spans
    metas = tmp_path / "metas"
    env = {
        "MCP_LEDGER": str(tmp_path / "ledger"),
        "MCP_GATE": str(tmp_path / "gate"),
        "MCP_DEDUP": str(tmp_path / "dedup.db"),
        "MCP_META": str(metas),
    }
    call = ToolCall(name="lookup", arguments={"city": "Lima"})
    for run_db, telemetry in (
        (tmp_path / "traced.db", Telemetry(tracer_provider=tracer_provider)),
        (tmp_path / "untraced.db", False),
    ):
        server = McpServer("notes", command=[sys.executable, str(SERVER), "stdio"], env=env)
        async with server:
            agent = Agent(tools=await server.tools(), telemetry=telemetry)
            gateway = ScriptedGateway([ModelResponse(tool_calls=[call]), ModelResponse(text="ok")])
            store = SqliteCheckpointer(run_db)
            try:
                async for _ in agent.run("weather", session=Session(RUN, gateway, store)):
                    pass
            finally:
                await store.close()
    traced, untraced = (json.loads(line) for line in metas.read_text().splitlines())
    assert traced["asiento/idempotency-key"] == untraced["asiento/idempotency-key"]
    (executed,) = [s for s in exporter.get_finished_spans() if s.name == "execute_tool lookup"]
    sent = {_ids(s): s for s in proxy_spans.get_finished_spans() if "tools/call" in s.name}
    parent = sent[_parent(traced["traceparent"])]  # the MCP SDK's span of the call
    assert parent.kind is SpanKind.CLIENT
    assert _parent_ids(parent) == _ids(executed)
    others = sent[_parent(untraced["traceparent"])]
    assert others.parent is None  # a trace of the MCP SDK's own
    assert _ids(others)[0] != _ids(executed)[0]
