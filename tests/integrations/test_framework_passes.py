"""asiento's own traces of framework runs (``durable_run(..., telemetry=...)``), read with the
real OpenTelemetry SDK and an in-memory exporter: the same shape as a native run's.

A run that calls ``lookup`` twice (two calls of one answer, run side by side) and then
``refund`` (which needs a person's approval: the first pass stops there), resumed after
the approval in a second pass, is ONE trace: two ``invoke_agent`` pass spans, the second
linked to the first; one ``chat`` span per generation paid (``FakeProvider`` counts them
by key) and one ``execute_tool`` span per tool that ran (each tool counts its own runs),
none for what the second pass replayed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from asiento import SqliteCheckpointer, Telemetry, approve
from asiento.testing import ENV_VAR
from otel_readings import Key, figures, grew
from providers.fake_servers import Answer, FakeProvider

from .refund_tools import counted_tools

RUN = "refund-9"
TASK = "refund order A1"
LOOKUPS = Answer(calls=(("lookup", {"order": "A1"}), ("lookup", {"order": "B2"})))  # side by side
REFUND = Answer(calls=(("refund", {"order": "A1"}),))
DONE = Answer(text="refunded A1")


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def _asiento(found: tuple[ReadableSpan, ...], operation: str) -> list[ReadableSpan]:
    """asiento's own spans of one GenAI operation (``chat``, ``execute_tool``...)."""
    return [
        s
        for s in found
        if s.instrumentation_scope is not None
        and s.instrumentation_scope.name == "asiento"
        and _attrs(s).get("gen_ai.operation.name") == operation
    ]


def _passes(found: tuple[ReadableSpan, ...]) -> list[ReadableSpan]:
    passes = [s for s in _asiento(found, "invoke_agent") if "asiento.pass.fence" in _attrs(s)]
    return sorted(passes, key=lambda s: _attrs(s)["asiento.pass.fence"])


def _check_passes(found: tuple[ReadableSpan, ...], name: str) -> tuple[ReadableSpan, ...]:
    """One trace, its run span, two pass spans (first, then after the approval) linked in
    order, each a child of the run's span; the two pass spans."""
    assert len({s.context.trace_id for s in found}) == 1
    first, second = _passes(found)
    assert first.name == second.name == f"invoke_agent {name}"
    [run_span] = [s for s in _asiento(found, "invoke_agent") if s not in (first, second)]
    assert run_span.parent is None
    assert _attrs(run_span)["asiento.run.status"] == "closed"
    for span in (first, second):
        assert span.parent is not None
        assert span.parent.span_id == run_span.context.span_id
    assert [link.context.span_id for link in second.links] == [first.context.span_id]
    causes = [
        (_attrs(s)["asiento.pass.cause"], _attrs(s)["asiento.run.status"]) for s in (first, second)
    ]
    assert causes == [("first", "awaiting_approval"), ("decided", "closed")]
    assert [e.name for e in first.events] == ["asiento.approval.requested"]
    return first, second


def _steps_under(span: ReadableSpan, steps: list[ReadableSpan]) -> list[str]:
    return sorted(
        _attrs(s)["asiento.step.id"]
        for s in steps
        if s.parent is not None and s.parent.span_id == span.context.span_id
    )


def _counts(span: ReadableSpan) -> tuple[int, ...]:
    """(executed model, executed tools, replayed model, replayed tools) of a pass span."""
    names = ("executed.model_calls", "executed.tool_calls")
    names += ("replayed.model_calls", "replayed.tool_calls")
    return tuple(int(_attrs(span)[f"asiento.{n}"]) for n in names)


def _recorded(before: dict[Key, Any], after: dict[Key, Any], name: str, **attrs: str) -> int:
    """How many records a histogram with these attributes took between two readings."""
    key = (name, tuple(sorted(attrs.items())))
    return int(after.get(key, (0,))[0]) - int(before.get(key, (0,))[0])


def _tool(name: str, outcome: str) -> dict[str, str]:
    return {"gen_ai.tool.name": name, "asiento.outcome": outcome}


def _carried(provider: FakeProvider, chats: list[ReadableSpan]) -> None:
    """Each paid generation's request carried its ``chat`` span's context."""
    sent = [r.headers.get("traceparent", "") for r in provider.requests if r.key]
    assert [p.split("-")[2] for p in sent] == [f"{s.context.span_id:016x}" for s in chats]


# -- Pydantic AI ------------------------------------------------------------------------------


def _pydantic_agent(client: Any, ran: Counter[str], instrumented: TracerProvider | None) -> Any:
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.capabilities import Instrumentation
    from pydantic_ai.models.instrumented import InstrumentationSettings
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("gpt-test", provider=OpenAIProvider(openai_client=client))
    capabilities: list[Any] = []
    if instrumented is not None:
        settings = InstrumentationSettings(tracer_provider=instrumented)
        capabilities.append(Instrumentation(settings=settings))
    output: list[Any] = [str, DeferredToolRequests]
    agent = Agent(model, name="refunds", output_type=output, capabilities=capabilities)

    lookup, refund = counted_tools(ran)
    agent.tool_plain(lookup)
    agent.tool_plain(requires_approval=True)(refund)

    return agent


async def _pydantic_run(
    tmp_path: Path, provider: FakeProvider, tracers: TracerProvider, *, instrument: bool
) -> Counter[str]:
    """The run's two passes, the approval between them; the tools' own count of their runs."""
    import openai

    from asiento.integrations.pydantic_ai import durable_run

    ran: Counter[str] = Counter()
    telemetry = Telemetry(tracer_provider=tracers)
    store = SqliteCheckpointer(tmp_path / "runs.db")
    async with openai.AsyncOpenAI(base_url=provider.openai_url, api_key="sk-t") as client:
        agent = _pydantic_agent(client, ran, tracers if instrument else None)
        try:
            first = await durable_run(agent, TASK, run_id=RUN, store=store, telemetry=telemetry)
            assert first.awaiting == ("m2.t1",)
            await approve(store, RUN, "m2.t1", by="ana")
            done = await durable_run(agent, TASK, run_id=RUN, store=store, telemetry=telemetry)
        finally:
            await store.close()
    assert done.output == "refunded A1"
    return ran


async def test_a_pydantic_ai_run_is_one_trace_with_a_span_per_paid_step(
    tmp_path: Path,
    spans: tuple[TracerProvider, InMemorySpanExporter],
    reader: InMemoryMetricReader,
) -> None:
    """Pydantic AI's instrumentation off: asiento's pass spans, and its ``chat`` and
    ``execute_tool`` spans for what each pass paid for or ran, none for what it replayed;
    its metrics count the same."""
    tracers, exporter = spans
    before = figures(reader)
    with FakeProvider((LOOKUPS, REFUND, DONE)) as provider:
        ran = await _pydantic_run(tmp_path, provider, tracers, instrument=False)
    after = figures(reader)
    chat = {"gen_ai.provider.name": "openai", "gen_ai.request.model": "gpt-test"}
    chat["gen_ai.operation.name"] = "chat"
    assert _recorded(before, after, "gen_ai.client.operation.duration", **chat) == 3
    assert _recorded(before, after, "asiento.tool.duration", **_tool("lookup", "applied")) == 2
    assert _recorded(before, after, "asiento.tool.duration", **_tool("refund", "approved")) == 1
    assert grew(before, after, "asiento.passes", **{"asiento.pass.cause": "decided"}) == 1
    found = exporter.get_finished_spans()
    first, second = _check_passes(found, "refunds")
    chats, tools = _asiento(found, "chat"), _asiento(found, "execute_tool")
    assert len(chats) == provider.billed() == 3
    assert (_steps_under(first, chats), _steps_under(second, chats)) == (["m1", "m2"], ["m3"])
    assert (
        Counter(_attrs(s)["gen_ai.tool.name"] for s in tools) == ran == {"lookup": 2, "refund": 1}
    )
    assert (_steps_under(first, tools), _steps_under(second, tools)) == (
        ["m1.t1", "m1.t2"],
        ["m2.t1"],
    )
    assert _attrs(tools[-1])["asiento.outcome"] == "approved"
    assert _attrs(chats[0])["gen_ai.request.model"] == "gpt-test"
    assert _attrs(chats[0])["gen_ai.provider.name"] == "openai"
    assert (_counts(first), _counts(second)) == ((2, 2, 0, 0), (1, 1, 2, 2))
    _carried(provider, chats)


async def test_pydantic_ais_own_spans_nest_under_the_pass_and_are_the_step_spans(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """Pydantic AI's instrumentation on: its spans join the run's trace under asiento's
    pass spans; its ``chat`` and ``execute_tool`` spans are the steps' (one per generation
    paid, per tool run, none replayed: ``replay_scope``), and asiento adds none of its own."""
    tracers, exporter = spans
    with FakeProvider((LOOKUPS, REFUND, DONE)) as provider:
        ran = await _pydantic_run(tmp_path, provider, tracers, instrument=True)
    found = exporter.get_finished_spans()
    first, second = _check_passes(found, "refunds")
    assert (_asiento(found, "chat"), _asiento(found, "execute_tool")) == ([], [])
    theirs = [s for s in found if s.instrumentation_scope.name != "asiento"]
    kinds = Counter(_attrs(s).get("gen_ai.operation.name") for s in theirs)
    assert kinds["chat"] == provider.billed() == 3
    tools = [_attrs(s)["gen_ai.tool.name"] for s in theirs if s.name.startswith("execute_tool")]
    assert Counter(tools) == ran == {"lookup": 2, "refund": 1}
    steps = [
        _attrs(s).get("asiento.step.id")
        for s in theirs
        if _attrs(s).get("gen_ai.tool.name") or s.name.startswith("chat")
    ]
    assert sorted(steps) == ["m1", "m1.t1", "m1.t2", "m2", "m2.t1", "m3"]  # asiento's steps
    runs = [s for s in theirs if s.name.startswith("invoke_agent") or s.name == "agent run"]
    parents = [s.parent.span_id if s.parent else None for s in runs]
    ids = (first.context.span_id, second.context.span_id)
    assert Counter(parents) == {ids[0]: 1, ids[1]: 2}  # the pass after the approval: 2 runs
    assert (_counts(first), _counts(second)) == ((2, 2, 0, 0), (1, 1, 2, 2))
    _carried(provider, [s for s in theirs if _attrs(s).get("gen_ai.operation.name") == "chat"])


# -- OpenAI Agents SDK ------------------------------------------------------------------------


async def test_an_agents_sdk_run_is_one_trace_with_a_span_per_paid_step(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """The SDK's own tracing off (its default in ``durable_run``): asiento's OpenTelemetry
    spans of the run, as a native run's."""
    import openai
    from agents import Agent, OpenAIChatCompletionsModel, function_tool

    from asiento.integrations.openai_agents import durable_run

    tracers, exporter = spans
    ran: Counter[str] = Counter()

    lookup, refund = counted_tools(ran)
    tools = [function_tool(lookup), function_tool(refund, needs_approval=True)]

    telemetry = Telemetry(tracer_provider=tracers)
    store = SqliteCheckpointer(tmp_path / "runs.db")
    with FakeProvider((LOOKUPS, REFUND, DONE)) as provider:
        async with openai.AsyncOpenAI(
            base_url=provider.openai_url, api_key="sk-t", max_retries=0
        ) as client:
            model = OpenAIChatCompletionsModel(model="gpt-test", openai_client=client)
            agent = Agent(name="refunds", model=model, tools=tools)
            try:
                first = await durable_run(agent, TASK, run_id=RUN, store=store, telemetry=telemetry)
                assert first.awaiting == "m2.t1"
                await approve(store, RUN, "m2.t1", by="ana")
                done = await durable_run(agent, TASK, run_id=RUN, store=store, telemetry=telemetry)
            finally:
                await store.close()
    assert done.final_output == "refunded A1"
    found = exporter.get_finished_spans()
    first_pass, second_pass = _check_passes(found, "refunds")
    chats, tools = _asiento(found, "chat"), _asiento(found, "execute_tool")
    assert len(chats) == provider.billed() == 3
    steps = (_steps_under(first_pass, chats), _steps_under(second_pass, chats))
    assert steps == (["m1", "m2"], ["m3"])
    assert (
        Counter(_attrs(s)["gen_ai.tool.name"] for s in tools) == ran == {"lookup": 2, "refund": 1}
    )
    steps = (_steps_under(first_pass, tools), _steps_under(second_pass, tools))
    assert steps == (["m1.t1", "m1.t2"], ["m2.t1"])
    assert (_counts(first_pass), _counts(second_pass)) == ((2, 2, 0, 0), (1, 1, 2, 2))
    _carried(provider, chats)


# -- a pass killed with SIGKILL ---------------------------------------------------------------
#
# The first pass runs in a new interpreter and is killed with SIGKILL once its tool's result
# is recorded; the run is resumed in another process: this one, not to pay for a second
# interpreter's imports. Each process's spans are fsynced JSON lines of one file.


def _killed_pass(child: str, argv: list[str], crash: str) -> None:
    """One traced pass of ``child`` (a script beside this file) in a new interpreter,
    killed with SIGKILL at ``crash``."""
    script = Path(__file__).with_name(child)
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR} | {ENV_VAR: crash}
    done = subprocess.run(
        [sys.executable, str(script), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr


def _check_killed_run(spans: Path, billed: int, applied: int) -> None:
    """One trace, no orphan; the killed pass's stand-in (it never ended its span) linked
    before the pass that closed the run; a ``chat`` span per generation billed and an
    ``execute_tool`` span per effect applied, none for what the second pass replayed."""
    from asiento.testing._files import read_lines

    found: list[dict[str, Any]] = read_lines(spans)
    assert len({s["context"]["trace_id"] for s in found}) == 1
    by_id = {s["context"]["span_id"]: s for s in found}
    assert all(s["parent_id"] is None or s["parent_id"] in by_id for s in found)
    passes = sorted(
        (s for s in found if "asiento.pass.fence" in s["attributes"]),
        key=lambda s: s["attributes"]["asiento.pass.fence"],
    )
    dead, resumed = (s["attributes"] for s in passes)
    assert (dead["asiento.pass.died"], resumed["asiento.pass.cause"]) == (True, "taken_over")
    linked = [link["context"]["span_id"] for link in passes[1]["links"]]
    assert linked == [passes[0]["context"]["span_id"]]
    replayed = (resumed["asiento.replayed.model_calls"], resumed["asiento.replayed.tool_calls"])
    assert replayed == (1, 1)

    def steps(operation: str) -> list[tuple[int, str]]:
        """(the fence of the pass it is under, its step) of each span of ``operation``."""
        return [
            (by_id[s["parent_id"]]["attributes"]["asiento.pass.fence"], attrs["asiento.step.id"])
            for s in found
            if (attrs := s["attributes"]).get("gen_ai.operation.name") == operation
        ]

    assert steps("chat") == [(1, "m1"), (2, "m2")]
    assert billed == 2
    assert steps("execute_tool") == [(1, "m1.t1")]
    assert applied == 1


async def test_a_pydantic_ai_pass_killed_and_resumed_elsewhere_is_one_trace(
    tmp_path: Path,
) -> None:
    """Pydantic AI, killed after ``refund``'s result: the run is one whole trace."""
    from .pydantic_ai_child import arguments, one_pass

    with FakeProvider((REFUND, DONE)) as provider:
        argv = [str(tmp_path / "runs.db"), RUN, provider.openai_url, str(tmp_path / "effects")]
        argv += ["--spans", str(tmp_path / "spans.jsonl")]
        _killed_pass("pydantic_ai_child.py", argv, "after_result")
        resumed = await one_pass(arguments(argv))
    assert resumed["ended"] == "closed"
    applied = (tmp_path / "effects").read_text().split()
    _check_killed_run(tmp_path / "spans.jsonl", provider.billed(), len(applied))


async def test_an_agents_sdk_pass_killed_and_resumed_elsewhere_is_one_trace(
    tmp_path: Path,
) -> None:
    """The Agents SDK, killed after ``refund``'s result: the run is one whole trace."""
    from .oa_child import main

    refund = Answer(calls=(("refund", {"order": 42, "amount": 9.5}),))
    with FakeProvider((refund, DONE)) as provider:
        argv = [str(tmp_path / "runs.db"), RUN, provider.openai_url, str(tmp_path / "effects")]
        argv.append(f"spans={tmp_path / 'spans.jsonl'}")
        _killed_pass("oa_child.py", argv, "after_result")
        resumed = await main(*argv)
    assert resumed["ended"] == "closed"
    applied = (tmp_path / "effects").read_text().splitlines()
    _check_killed_run(tmp_path / "spans.jsonl", provider.billed(), len(applied))


async def test_a_framework_run_started_under_a_callers_span_joins_its_trace(
    tmp_path: Path, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """A run started inside a span of the caller's (a web request) is in that trace, its
    run span the request's child, as a native run's is."""
    import openai
    from agents import Agent, OpenAIChatCompletionsModel

    from asiento.integrations.openai_agents import durable_run

    tracers, exporter = spans
    store = SqliteCheckpointer(tmp_path / "runs.db")
    with FakeProvider((DONE,)) as provider:
        async with openai.AsyncOpenAI(
            base_url=provider.openai_url, api_key="sk-t", max_retries=0
        ) as client:
            model = OpenAIChatCompletionsModel(model="gpt-test", openai_client=client)
            agent = Agent(name="refunds", model=model)
            with tracers.get_tracer("web").start_as_current_span("POST /runs") as request:
                try:
                    await durable_run(
                        agent, TASK, run_id=RUN, store=store, telemetry=Telemetry(tracers)
                    )
                finally:
                    await store.close()
    found = exporter.get_finished_spans()
    assert {s.context.trace_id for s in found} == {request.get_span_context().trace_id}
    [run_span] = [s for s in _asiento(found, "invoke_agent") if s not in _passes(found)]
    assert run_span.parent is not None
    assert run_span.parent.span_id == request.get_span_context().span_id
