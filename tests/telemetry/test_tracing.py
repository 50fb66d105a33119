"""A run's trace, in one process, with the real OpenTelemetry SDK and an in-memory exporter:
one trace per run, a span per generation paid and per tool run, none for what was replayed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from asiento import (
    Agent,
    App,
    ApprovalStep,
    Decision,
    Delta,
    JournalFull,
    ModelRequest,
    ModelResponse,
    RunStatus,
    Session,
    SqliteCheckpointer,
    StreamPart,
    Telemetry,
    ToolCall,
    Usage,
    UsageError,
    Worker,
    approve,
    require_approval_for,
    submit,
    tool,
)
from asiento.telemetry import tracing
from asiento.testing import ScriptedGateway, StreamingScriptedGateway
from otel_readings import figures, grew

SENT: list[str] = []


@tool
def send(to: str) -> str:
    """Send a message (an effect: it happens once)."""
    SENT.append(to)
    return f"sent to {to}"


@tool(idempotent=True)
def broken(x: int) -> int:
    """A tool that fails."""
    raise RuntimeError("the disk is full")


def _answers() -> list[ModelResponse]:
    usage = Usage(input_tokens=11, output_tokens=7)
    return [
        ModelResponse(
            tool_calls=[ToolCall(name="send", arguments={"to": "ana"})],
            usage=usage,
            model="m-1",
            request_id="resp-1",
        ),
        ModelResponse(text="done", usage=usage, model="m-1", request_id="resp-2"),
    ]


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    SENT.clear()
    yield provider, exporter
    provider.shutdown()


def _named(found: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return [s for s in found if s.name.startswith(prefix)]


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def _drive(agent: Agent, run_id: str, gateway: ScriptedGateway, path: Path) -> list[Any]:
    store = SqliteCheckpointer(path)
    try:
        return [
            step
            async for step in agent.run("write to ana", session=Session(run_id, gateway, store))
        ]
    finally:
        await store.close()


async def test_a_run_is_one_trace_with_a_span_per_generation_and_per_tool(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    agent = Agent(tools=[send], name="mailer", telemetry=Telemetry(tracer_provider=provider))
    gateway = ScriptedGateway(_answers())
    await _drive(agent, "r1", gateway, tmp_path / "j.db")
    found = exporter.get_finished_spans()
    assert len({s.context.trace_id for s in found}) == 1
    chats, tools = _named(found, "chat"), _named(found, "execute_tool")
    assert len(chats) == len(gateway.calls) == 2
    assert [s.name for s in tools] == ["execute_tool send"]
    assert SENT == ["ana"]
    passes = [s for s in found if "asiento.pass.fence" in _attrs(s)]
    [run_span] = [s for s in _named(found, "invoke_agent") if s not in passes]
    [one_pass] = passes
    assert run_span.parent is None
    assert one_pass.parent is not None
    assert one_pass.parent.span_id == run_span.context.span_id
    for step in chats + tools:
        assert step.parent is not None
        assert step.parent.span_id == one_pass.context.span_id
    assert chats[0].kind is trace.SpanKind.CLIENT
    first = _attrs(chats[0])
    assert first["gen_ai.operation.name"] == "chat"
    assert first["gen_ai.response.id"] == "resp-1"
    assert first["gen_ai.response.model"] == "m-1"
    assert (first["gen_ai.usage.input_tokens"], first["gen_ai.usage.output_tokens"]) == (11, 7)
    assert first["asiento.step.id"] == "m1"
    assert _attrs(tools[0])["gen_ai.tool.call.id"] == "m1.t1"
    assert _attrs(tools[0])["asiento.outcome"] == "applied"
    counts = _attrs(one_pass)
    assert counts["asiento.pass.cause"] == "first"
    assert counts["asiento.run.status"] == "closed"
    assert (counts["asiento.executed.model_calls"], counts["asiento.replayed.model_calls"]) == (
        2,
        0,
    )
    # No content and no idempotency key by default: a digest at most, never in clear.
    keys = set(gateway.keys)
    for span in found:
        assert not any(str(v) in keys for v in _attrs(span).values())
        assert not any(
            k.startswith("gen_ai.input") or k.startswith("gen_ai.output") for k in _attrs(span)
        )


async def test_a_resumed_pass_joins_the_trace_and_replays_without_spans(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    agent = Agent(
        tools=[send],
        name="mailer",
        policy=require_approval_for("send"),
        telemetry=Telemetry(tracer_provider=provider),
    )
    gateway, path = ScriptedGateway(_answers()), tmp_path / "j.db"
    steps = await _drive(agent, "r1", gateway, path)
    assert isinstance(steps[-1], ApprovalStep)
    first = exporter.get_finished_spans()
    [pass1] = _named(first, "invoke_agent")
    assert _attrs(pass1)["asiento.run.status"] == "awaiting_approval"
    assert [(e.name, dict(e.attributes or {})) for e in pass1.events] == [
        ("asiento.approval.requested", {"asiento.step.id": "m1.t1", "gen_ai.tool.name": "send"})
    ]
    store = SqliteCheckpointer(path)
    await approve(store, "r1", "m1.t1", by="ana")
    await store.close()
    exporter.clear()
    await _drive(agent, "r1", gateway, path)
    second = exporter.get_finished_spans()
    assert {s.context.trace_id for s in second} == {pass1.context.trace_id}
    assert len(gateway.calls) == 2  # m1 was replayed, m2 asked: one chat span, for m2
    assert [_attrs(s)["asiento.step.id"] for s in _named(second, "chat")] == ["m2"]
    passes = [s for s in second if "asiento.pass.fence" in _attrs(s)]
    [pass2] = passes
    counts = _attrs(pass2)
    assert counts["asiento.pass.cause"] == "decided"
    assert (counts["asiento.replayed.model_calls"], counts["asiento.executed.model_calls"]) == (
        1,
        1,
    )
    assert counts["asiento.saved.input_tokens"] == 11
    assert [link.context.span_id for link in pass2.links] == [pass1.context.span_id]
    [tool_span] = _named(second, "execute_tool")
    assert _attrs(tool_span)["asiento.outcome"] == "approved"


async def test_a_run_started_under_a_callers_span_joins_its_trace(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    agent = Agent(tools=[send], telemetry=Telemetry(tracer_provider=provider))
    caller = provider.get_tracer("web")
    with caller.start_as_current_span("POST /runs") as request:
        await _drive(agent, "r1", ScriptedGateway(_answers()), tmp_path / "j.db")
    found = exporter.get_finished_spans()
    assert {s.context.trace_id for s in found} == {request.get_span_context().trace_id}
    run_span = next(
        s for s in _named(found, "invoke_agent") if "asiento.pass.fence" not in _attrs(s)
    )
    assert run_span.parent is not None
    assert run_span.parent.span_id == request.get_span_context().span_id


async def test_span_ids_are_the_same_for_the_same_step(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """Two runs with the same trace context (a journal copied, say) get the same step ids:
    an exporter that receives a span twice sees the same span."""
    provider, exporter = spans
    agent = Agent(tools=[send], telemetry=Telemetry(tracer_provider=provider))
    await _drive(agent, "r1", ScriptedGateway(_answers()), tmp_path / "a.db")
    found = exporter.get_finished_spans()
    trace_id = found[0].context.trace_id
    chat = _named(found, "chat")[0]
    assert chat.context.span_id == tracing._digest_id(trace_id, "m1", 1)


async def test_content_is_captured_only_when_asked(
    tmp_path: Path,
    spans: tuple[TracerProvider, InMemorySpanExporter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    provider, exporter = spans
    monkeypatch.setenv(tracing.CAPTURE_CONTENT, "true")
    agent = Agent(tools=[send], telemetry=Telemetry(tracer_provider=provider))
    await _drive(agent, "r1", ScriptedGateway(_answers()), tmp_path / "j.db")
    found = exporter.get_finished_spans()
    chat = _attrs(_named(found, "chat")[0])
    assert "write to ana" in chat["gen_ai.input.messages"]
    assert "send" in chat["gen_ai.output.messages"]
    tool_span = _attrs(_named(found, "execute_tool")[0])
    assert "ana" in tool_span["gen_ai.tool.call.arguments"]
    assert "sent to ana" in tool_span["gen_ai.tool.call.result"]
    exporter.clear()
    quiet = Agent(
        tools=[send], telemetry=Telemetry(tracer_provider=provider, capture_content=False)
    )
    await _drive(quiet, "r2", ScriptedGateway(_answers()), tmp_path / "j.db")
    assert all("gen_ai.input.messages" not in _attrs(s) for s in exporter.get_finished_spans())


async def test_a_failed_tool_is_an_error_span(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    agent = Agent(tools=[broken], telemetry=Telemetry(tracer_provider=provider))
    answers = [
        ModelResponse(tool_calls=[ToolCall(name="broken", arguments={"x": 1})]),
        ModelResponse(text="it failed"),
    ]
    await _drive(agent, "r1", ScriptedGateway(answers), tmp_path / "j.db")
    [span] = _named(exporter.get_finished_spans(), "execute_tool")
    assert span.status.status_code is trace.StatusCode.ERROR
    assert _attrs(span)["asiento.outcome"] == "failed"


async def test_telemetry_off_records_and_emits_nothing(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    _, exporter = spans
    path = tmp_path / "j.db"
    await _drive(Agent(tools=[send]), "r1", ScriptedGateway(_answers()), path)
    store = SqliteCheckpointer(path)
    records = await store.load("r1")
    await store.close()
    assert not [e for e in records if e.step_id.startswith("trace")]
    assert exporter.get_finished_spans() == ()


def test_a_wrong_telemetry_value_is_refused() -> None:
    with pytest.raises(UsageError, match=r"Agent\(telemetry=...\) takes True, False or Telemetry"):
        Agent(telemetry="yes")  # type: ignore[arg-type]


async def test_a_traced_run_reports_its_steps_in_metrics(
    tmp_path: Path,
    spans: tuple[TracerProvider, InMemorySpanExporter],
    reader: InMemoryMetricReader,
) -> None:
    """Model calls paid (duration, tokens), tools run (by outcome), passes by cause and by
    how they ended; a pass that only replays adds no model call and no tool."""
    provider, _ = spans
    agent = Agent(
        tools=[send],
        policy=require_approval_for("send"),
        telemetry=Telemetry(tracer_provider=provider),
    )
    gateway, path = ScriptedGateway(_answers()), tmp_path / "j.db"
    before = figures(reader)
    await _drive(agent, "r1", gateway, path)
    store = SqliteCheckpointer(path)
    await approve(store, "r1", "m1.t1", by="ana")
    await store.close()
    await _drive(agent, "r1", gateway, path)
    after = figures(reader)
    chat = (("gen_ai.operation.name", "chat"), ("gen_ai.provider.name", "scripted"))
    calls = after[("gen_ai.client.operation.duration", chat)][0]
    calls -= before.get(("gen_ai.client.operation.duration", chat), (0,))[0]
    assert calls == len(gateway.calls) == 2
    tokens = (*chat, ("gen_ai.token.type", "input"))
    spent = after[("gen_ai.client.token.usage", tokens)][1]
    spent -= before.get(("gen_ai.client.token.usage", tokens), (0, 0))[1]
    assert spent == 22
    ran = (("asiento.outcome", "approved"), ("gen_ai.tool.name", "send"))
    assert (
        after[("asiento.tool.duration", ran)][0]
        - before.get(("asiento.tool.duration", ran), (0,))[0]
        == 1
    )
    assert grew(before, after, "asiento.passes", **{"asiento.pass.cause": "first"}) == 1
    assert grew(before, after, "asiento.passes", **{"asiento.pass.cause": "decided"}) == 1
    ended = {"asiento.run.status": "awaiting_approval"}
    assert grew(before, after, "asiento.passes.ended", **ended) == 1
    assert grew(before, after, "asiento.passes.ended", **{"asiento.run.status": "closed"}) == 1


async def test_a_run_submitted_under_a_span_is_traced_in_that_trace(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """submit() inside a caller's span (a web request) records that span as the run's
    trace: the worker's pass, later and elsewhere, joins it."""
    provider, exporter = spans
    store = SqliteCheckpointer(tmp_path / "j.db")
    with provider.get_tracer("web").start_as_current_span("POST /runs") as request:
        await submit(store, "r1", "write to ana")
    await submit(store, "r2", "write to ana")  # no caller span: nothing recorded
    assert [e.step_id for e in await store.load("r2")] == []
    agent = Agent(tools=[send], name="mailer", telemetry=Telemetry(tracer_provider=provider))
    app = App(agents={"default": agent}, gateway=lambda: ScriptedGateway(_answers()))
    worker = Worker(store, app, poll=0.01)
    await worker.run(until_idle=True, max_seconds=20)
    await store.close()
    by_run: dict[str, set[int]] = {}
    for span in exporter.get_finished_spans():
        run = _attrs(span).get("asiento.run.id")
        if run is not None:
            by_run.setdefault(str(run), set()).add(span.context.trace_id)
    assert by_run["r1"] == {request.get_span_context().trace_id}
    assert len(by_run["r2"]) == 1
    assert by_run["r2"] != by_run["r1"]


class _ClosesCounted(StreamingScriptedGateway):
    """Counts the streams that ended, read to their end or closed by the pass."""

    closed = 0

    async def stream(
        self, request: ModelRequest, *, idempotency_key: str
    ) -> AsyncIterator[StreamPart | ModelResponse]:
        try:
            async for item in super().stream(request, idempotency_key=idempotency_key):
                yield item
        finally:
            self.closed += 1


async def test_a_stream_asked_again_after_a_cut_is_a_new_span_marked_reask(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """Pass 1 stops reading its stream mid-answer (the generation was paid, and lost);
    pass 2 asks again: a second chat span, marked a re-ask, with what was re-paid."""
    provider, exporter = spans
    agent = Agent(telemetry=Telemetry(tracer_provider=provider))
    gateway = _ClosesCounted([ModelResponse(text="a long answer " * 8)], chunk=4)
    store = SqliteCheckpointer(tmp_path / "j.db")
    stream = agent.run("talk", session=Session("r1", gateway, store), stream=True)
    shown = 0
    async for item in stream:
        shown += isinstance(item, Delta)
        if shown == 3:
            break
    await stream.aclose()  # type: ignore[attr-defined]
    ended = exporter.get_finished_spans()
    [cut] = _named(ended, "chat")
    assert "asiento.reask" not in _attrs(cut)
    # closed at once, in order: the step's span before its pass's, the stream before both
    [first_pass] = [s for s in ended if "asiento.pass.fence" in _attrs(s)]
    assert ended.index(cut) < ended.index(first_pass)
    assert gateway.closed == 1
    exporter.clear()
    async for _ in agent.run("talk", session=Session("r1", gateway, store), stream=True):
        pass
    await store.close()
    found = exporter.get_finished_spans()
    [again] = _named(found, "chat")
    assert len(gateway.calls) == 2
    assert _attrs(again)["asiento.reask"] is True
    assert _attrs(again)["asiento.repaid"] == 1
    assert again.context.span_id != cut.context.span_id  # another attempt, another span
    [second_pass] = [s for s in found if "asiento.pass.fence" in _attrs(s)]
    assert _attrs(second_pass)["asiento.repaid.model_calls"] == 1


async def test_a_denied_call_is_an_event_of_its_pass_not_a_tool_span(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    agent = Agent(
        tools=[send],
        policy=lambda call: Decision.DENY,
        telemetry=Telemetry(tracer_provider=provider),
    )
    await _drive(agent, "r1", ScriptedGateway(_answers()), tmp_path / "j.db")
    found = exporter.get_finished_spans()
    assert _named(found, "execute_tool") == []
    assert SENT == []
    [one_pass] = [s for s in found if "asiento.pass.fence" in _attrs(s)]
    assert [(e.name, dict(e.attributes or {})) for e in one_pass.events] == [
        (
            "asiento.tool.denied",
            {"asiento.step.id": "m1.t1", "gen_ai.tool.name": "send", "by": "policy"},
        )
    ]


class _FullAtTheClose(SqliteCheckpointer):
    """A real SQLite journal whose disk fills up at the run's closing commit."""

    async def append(self, *events: Any, status: Any = None, **kwargs: Any) -> None:
        if status is RunStatus.CLOSED:
            raise JournalFull("database or disk is full (the closing commit)")
        await super().append(*events, status=status, **kwargs)


async def test_a_run_whose_close_failed_to_commit_exports_no_run_span(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """The run's span says the run closed: it goes out only once that close is durable.
    The next pass closes the run and exports it then, once."""
    provider, exporter = spans
    agent = Agent(tools=[send], name="mailer", telemetry=Telemetry(tracer_provider=provider))
    gateway, path = ScriptedGateway(_answers()), tmp_path / "j.db"
    store = _FullAtTheClose(path)
    with pytest.raises(JournalFull):
        async for _ in agent.run("write to ana", session=Session("r1", gateway, store)):
            pass
    await store.close()
    found = exporter.get_finished_spans()
    assert [s for s in _named(found, "invoke_agent") if "asiento.pass.fence" not in _attrs(s)] == []
    exporter.clear()
    await _drive(agent, "r1", gateway, path)  # the disk has room again
    again = exporter.get_finished_spans()
    runs = [s for s in _named(again, "invoke_agent") if "asiento.pass.fence" not in _attrs(s)]
    assert [_attrs(s)["asiento.run.status"] for s in runs] == ["closed"]
    assert SENT == ["ana"]
