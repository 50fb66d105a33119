"""A traced run through the real OTLP/HTTP exporter to a collector-like server on 127.0.0.1:
what a collector receives is the run's one trace, decoded from the OTLP protobuf."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from asiento import (
    Agent,
    ModelResponse,
    Session,
    SqliteCheckpointer,
    Telemetry,
    ToolCall,
    approve,
    require_approval_for,
    tool,
)
from asiento.testing import ScriptedGateway


class _Collector(ThreadingHTTPServer):
    """Keeps every span an OTLP/HTTP exporter posts to ``/v1/traces``."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Receive)
        self.spans: list[Any] = []
        self.services: set[str] = set()
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"


class _Receive(BaseHTTPRequestHandler):
    server: _Collector

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        request = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            for resource in request.resource_spans:
                for attribute in resource.resource.attributes:
                    if attribute.key == "service.name":
                        self.server.services.add(attribute.value.string_value)
                for scope in resource.scope_spans:
                    self.server.spans.extend(scope.spans)
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Collector]:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    server = _Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@tool
def pay(amount: int) -> str:
    """Pay an amount (an effect)."""
    return f"paid {amount}"


def _attrs(span: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        found[kv.key] = getattr(value, value.WhichOneof("value"))
    return found


async def test_a_collector_receives_one_trace_for_a_run_resumed_after_an_approval(
    tmp_path: Path, collector: _Collector
) -> None:
    def provider() -> TracerProvider:  # a new one per pass, as a new process has
        made = TracerProvider(resource=Resource.create({"service.name": "billing-worker"}))
        made.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=collector.endpoint)))
        return made

    answers = [
        ModelResponse(tool_calls=[ToolCall(name="pay", arguments={"amount": 5})]),
        ModelResponse(text="paid"),
    ]
    gateway, path = ScriptedGateway(answers), tmp_path / "j.db"
    for n in (1, 2):
        traced = provider()
        agent = Agent(
            tools=[pay],
            name="billing",
            policy=require_approval_for("pay"),
            telemetry=Telemetry(tracer_provider=traced),
        )
        store = SqliteCheckpointer(path)
        async for _ in agent.run("pay 5", session=Session("r1", gateway, store)):
            pass
        if n == 1:
            await approve(store, "r1", "m1.t1", by="ana")
        await store.close()
        traced.shutdown()  # the batch processor exports what it holds
    spans = collector.spans
    assert collector.services == {"billing-worker"}
    assert len({bytes(s.trace_id) for s in spans}) == 1
    names = sorted(s.name for s in spans)
    assert names.count("chat") == len(gateway.calls) == 2
    assert names.count("execute_tool pay") == 1
    passes = sorted(
        (s for s in spans if "asiento.pass.fence" in _attrs(s)),
        key=lambda s: _attrs(s)["asiento.pass.fence"],
    )
    assert [_attrs(s)["asiento.pass.cause"] for s in passes] == ["first", "decided"]
    assert [bytes(link.span_id) for link in passes[1].links] == [bytes(passes[0].span_id)]
    ids = {bytes(s.span_id) for s in spans}
    assert all(not s.parent_span_id or bytes(s.parent_span_id) in ids for s in spans)
