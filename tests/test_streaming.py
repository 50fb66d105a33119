"""``run(stream=True)``: deltas as the model generates, the step durable only when complete.

The model is ``StreamingScriptedGateway`` (asiento.testing), which streams its
scripted answers in pieces with a pause before each; the journal is a real SQLite
file. The crash test kills a real child process with SIGKILL mid-stream.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from asiento import (
    Agent,
    Delta,
    FinalStep,
    ModelResponse,
    ModelStep,
    Phase,
    Session,
    SqliteCheckpointer,
    StreamRestart,
    TextPart,
    ToolCall,
    ToolCallPart,
    ToolStep,
    UsageError,
    step_ids,
)
from asiento.testing import ScriptedGateway, StreamingScriptedGateway
from sqlite_files import Journal
from test_agent import ECHO_SCRIPT, RUN, TASK, asks, done, echo_agent

LONG = "the answer, long enough to come in many pieces"
SCRIPT = [asks(("echo", {"text": "hi there"}), text="let me echo"), done(LONG)]


async def streamed(agent: Agent, gateway: Any, store: Any) -> list[Any]:
    session = Session(RUN, gateway, store)
    return [item async for item in agent.run(TASK, session=session, stream=True)]


def text_of(items: list[Any], step_id: str) -> str:
    return "".join(i.text for i in items if isinstance(i, Delta) and i.step_id == step_id)


def records(events: list[Any]) -> list[tuple[str, Phase, Any]]:
    """The run's records but the streamed attempts' markers (``m1/1``: see below)."""
    return [
        (e.step_id, e.phase, dict(e.payload)) for e in events if not step_ids.is_streamed(e.step_id)
    ]


async def test_deltas_come_as_generated_then_the_durable_model_step(journal: Journal) -> None:
    gateway = StreamingScriptedGateway(SCRIPT, chunk=5)
    items = await streamed(echo_agent([]), gateway, journal.open())
    assert text_of(items, "m1") == "let me echo"
    assert text_of(items, "m2") == LONG
    assert len([i for i in items if isinstance(i, Delta) and i.step_id == "m2"]) == 10
    # every delta of a step comes before its step; the ModelStep only once it is durable
    kinds = [(type(i).__name__, getattr(i, "step_id", "")) for i in items]
    first_model_step = kinds.index(("ModelStep", "m1"))
    assert all(k != ("Delta", "m1") for k in kinds[first_model_step:])
    assert isinstance(items[-1], FinalStep)
    assert items[-1].text == LONG
    calls = [i.part for i in items if isinstance(i, Delta) and isinstance(i.part, ToolCallPart)]
    assert calls[0] == ToolCallPart(index=0, name="echo", call_id=None)
    assert "".join(c.arguments for c in calls) == '{"text":"hi there"}'
    assert {i.attempt for i in items if isinstance(i, Delta)} == {1}  # the run's first pass
    assert not any(isinstance(i, StreamRestart) for i in items)  # nothing was cut
    assert len(gateway.calls) == 2


async def test_the_first_delta_is_shown_before_anything_of_its_step_is_written(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    gateway = StreamingScriptedGateway(SCRIPT, chunk=3)
    seen: list[list[Phase]] = []
    journal = Journal(path)
    store, other = journal.open(), journal.open()
    session = Session(RUN, gateway, store)
    async for item in echo_agent([]).run(TASK, session=session, stream=True):
        if isinstance(item, Delta) and item.step_id == "m1" and not seen:
            seen.append([e.phase for e in await other.load_step(RUN, "m1")])
        if isinstance(item, ModelStep) and item.step_id == "m1":
            seen.append([e.phase for e in await other.load_step(RUN, "m1")])
    await store.close()
    await other.close()
    assert seen == [[], [Phase.RESULT]]


async def test_a_streamed_run_journals_what_a_plain_run_journals(tmp_path: Path) -> None:
    a, b = Journal(tmp_path / "a.db").open(), Journal(tmp_path / "b.db").open()
    await streamed(echo_agent([]), StreamingScriptedGateway(SCRIPT, chunk=2), a)
    session = Session(RUN, ScriptedGateway(SCRIPT), b)
    [s async for s in echo_agent([]).run(TASK, session=session)]
    streamed_events, plain_events = await a.load(RUN), await b.load(RUN)
    assert records(streamed_events) == records(plain_events)
    markers = [(e.step_id, e.phase, dict(e.payload)) for e in streamed_events]
    extra = [m for m in markers if step_ids.is_streamed(m[0])]
    assert extra == [  # one per streamed model step, written while it streamed
        ("m1/1", Phase.SUBMITTED, {"stream_attempt": 1}),
        ("m2/1", Phase.SUBMITTED, {"stream_attempt": 1}),
    ]
    await a.close()
    await b.close()


async def test_a_gateway_that_cannot_stream_shows_each_answer_whole(journal: Journal) -> None:
    items = await streamed(echo_agent([]), ScriptedGateway(SCRIPT), journal.open())
    deltas = [i for i in items if isinstance(i, Delta)]
    assert [d.part for d in deltas] == [
        TextPart("let me echo"),
        ToolCallPart(index=0, arguments='{"text":"hi there"}', call_id="m1.t1", name="echo"),
        TextPart(LONG),
    ]
    assert not any(d.replayed for d in deltas)


async def test_a_recorded_step_is_shown_whole_and_marked_replayed(journal: Journal) -> None:
    calls: list[str] = []
    first = [s async for s in _until_tool(echo_agent(calls), journal.open())]
    assert any(isinstance(s, ToolStep) for s in first)
    gateway = StreamingScriptedGateway(SCRIPT, chunk=2)
    items = await streamed(echo_agent(calls), gateway, journal.open())
    replayed = [i for i in items if isinstance(i, Delta) and i.step_id == "m1"]
    assert replayed
    assert all(d.replayed for d in replayed)
    assert replayed[0].part == TextPart("let me echo")  # whole, not in pieces
    assert len(gateway.calls) == 1  # only model2 was asked
    # a resumed pass announces the first step it asks: an earlier pass may have cut it
    restart = [i for i in items if isinstance(i, StreamRestart)]
    assert [(r.step_id, r.attempt) for r in restart] == [("m2", 2)]
    assert items.index(restart[0]) < min(
        items.index(i) for i in items if isinstance(i, Delta) and i.step_id == "m2"
    )


async def _until_tool(agent: Agent, store: Any) -> Any:
    """A plain pass the caller stops once the first tool step is durable."""
    gen = agent.run(TASK, session=Session(RUN, ScriptedGateway(SCRIPT), store))
    async for step in gen:
        yield step
        if isinstance(step, ToolStep):
            break
    await gen.aclose()


async def test_stream_must_be_a_bool(journal: Journal) -> None:
    session = Session(RUN, ScriptedGateway(ECHO_SCRIPT), journal.open())
    with pytest.raises(UsageError, match=r"stream=\.\.\."):
        echo_agent([]).run(TASK, session=session, stream="yes")  # type: ignore[call-overload]


def test_the_streaming_scripted_gateway_refuses_bad_settings() -> None:
    with pytest.raises(UsageError, match="chunk"):
        StreamingScriptedGateway([done()], chunk=0)
    with pytest.raises(UsageError, match="pause"):
        StreamingScriptedGateway([done()], pause=-1)


async def test_garbage_from_a_streaming_gateway_is_a_usage_error_and_records_nothing(
    journal: Journal,
) -> None:
    class Garbage(StreamingScriptedGateway):
        async def stream(self, request: Any, *, idempotency_key: str) -> Any:
            yield TextPart("hal")
            yield {"text": "not a ModelResponse"}

    store = journal.open()
    with pytest.raises(UsageError, match="m1"):
        await streamed(echo_agent([]), Garbage(SCRIPT), store)
    assert await store.load_step(RUN, "m1") == []


# -- a real process killed mid-stream ----------------------------------------------------

CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from asiento import Delta, Session, SqliteCheckpointer, StreamRestart
    from asiento.testing import StreamingScriptedGateway
    import test_streaming as ts

    async def main(path, kill_after):
        gateway = StreamingScriptedGateway(ts.SCRIPT, chunk=3, pause=0.001)
        store = SqliteCheckpointer(path)
        session = Session(ts.RUN, gateway, store)
        seen = 0
        async for item in ts.echo_agent([]).run(ts.TASK, session=session, stream=True):
            if isinstance(item, StreamRestart):
                print("restart", item.step_id, item.attempt, flush=True)
            if isinstance(item, Delta) and item.step_id == "m2":
                print("delta", item.attempt, repr(item.text), flush=True)
                seen += 1
                if seen == kill_after:
                    other = SqliteCheckpointer(path)  # the marker, durable beside the stream
                    for _ in range(250):
                        if await other.load_step(ts.RUN, "m2/1"):
                            break
                        await asyncio.sleep(0.02)
                    os.kill(os.getpid(), signal.SIGKILL)
        print("asked", len(gateway.calls), flush=True)
        await store.close()

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)


def _child(path: Path, kill_after: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(kill_after)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


async def test_a_stream_cut_by_sigkill_is_asked_again_after_a_restart_event(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    cut = _child(path, kill_after=3)
    assert cut.returncode == -signal.SIGKILL, cut.stderr
    shown = [line for line in cut.stdout.splitlines() if line.startswith("delta")]
    assert len(shown) == 3
    assert all(line.startswith("delta 1 ") for line in shown)
    store = SqliteCheckpointer(path)  # nothing of the cut step was recorded
    assert await store.load_step(RUN, "m2") == []
    assert [e.phase for e in await store.load_step(RUN, "m1.t1")] == [
        Phase.INTENT,
        Phase.SUBMITTED,
        Phase.RESULT,
    ]
    await store.close()
    resumed = _child(path, kill_after=0)
    assert resumed.returncode == 0, resumed.stderr
    lines = resumed.stdout.splitlines()
    assert lines[0] == "restart m2 2"  # before the new attempt's first delta
    assert all(line.startswith("delta 2 ") for line in lines[1:-1])
    assert "".join(eval(line.split(" ", 2)[2]) for line in lines[1:-1]) == LONG
    assert lines[-1] == "asked 1"  # m1 replayed; m2 asked again (the cut one is lost)
    store = SqliteCheckpointer(path)
    m2 = [e for e in await store.load_step(RUN, "m2") if e.phase is Phase.RESULT]
    assert m2[0].payload["repaid"] == 1  # the cut generation, paid and lost, is counted
    marks = [e.step_id for e in await store.load(RUN) if step_ids.is_streamed(e.step_id)]
    assert marks == ["m1/1", "m2/1", "m2/2"]
    final = await store.final(RUN)
    assert final is not None
    assert final.payload["text"] == LONG
    await store.close()


def test_tool_call_parts_join_into_the_recorded_call() -> None:
    response = ModelResponse(tool_calls=[ToolCall(name="f", arguments={"a": [1, 2]}, id="c1")])
    gateway = StreamingScriptedGateway([response], chunk=1)
    parts = list(gateway._parts(response))
    assert parts[0] == ToolCallPart(index=0, call_id="c1", name="f")
    assert "".join(p.arguments for p in parts if isinstance(p, ToolCallPart)) == '{"a":[1,2]}'


async def test_a_delta_reaches_the_caller_while_the_model_is_still_generating(
    journal: Journal,
) -> None:
    produced: list[Any] = []

    class Counting(StreamingScriptedGateway):
        def _parts(self, response: ModelResponse) -> Any:
            for part in StreamingScriptedGateway._parts(self, response):
                produced.append(part)
                yield part

    session = Session(RUN, Counting([done(LONG)], chunk=1), journal.open())
    at_first: int | None = None
    async for item in echo_agent([]).run(TASK, session=session, stream=True):
        if isinstance(item, Delta) and at_first is None:
            at_first = len(produced)
    assert at_first == 1
    assert len(produced) == len(LONG)
