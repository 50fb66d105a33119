"""The agent loop: what a pass calls, what it records, and what a resumed pass skips.

"Resume" here means a new SqliteCheckpointer on the same file, a new gateway and a
new Agent built the same way, with the same run_id, in the same process. A crash
is simulated by closing the step generator early or by a tool that raises a
BaseException (which the loop does not catch, as it would not survive a SIGKILL).

test_agent_replay.py and test_agent_approval.py import their helpers from here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from asiento import (
    Agent,
    FinalStep,
    Lease,
    MaxTurnsExceeded,
    MemoryCheckpointer,
    ModelRequest,
    ModelResponse,
    ModelStep,
    Phase,
    RunInfo,
    RunStatus,
    Savings,
    Session,
    SqliteCheckpointer,
    Step,
    StepEvent,
    Tool,
    ToolCall,
    ToolStep,
    UsageError,
    tool,
)
from asiento.lease import Holder
from asiento.testing import ScriptedGateway
from sqlite_files import Journal

RUN = "run-1"
TASK = "read /x"


class Crash(BaseException):
    """Stands for the process dying: the loop must not catch it."""


class Spy:
    """A Checkpointer that delegates to a real one and remembers which methods were called."""

    def __init__(self, inner: SqliteCheckpointer) -> None:
        self.inner = inner
        self.called: list[str] = []

    async def append(
        self,
        *events: StepEvent,
        status: RunStatus | None = None,
        lease: Lease | None = None,
        release: Savings | None = None,
    ) -> None:
        self.called.append("append")
        await self.inner.append(*events, status=status, lease=lease, release=release)

    async def acquire(self, run_id: str, holder: Holder, *, ttl: float) -> Lease:
        self.called.append("acquire")
        return await self.inner.acquire(run_id, holder, ttl=ttl)

    async def renew(self, lease: Lease, *, ttl: float) -> Lease:
        self.called.append("renew")
        return await self.inner.renew(lease, ttl=ttl)

    async def release(
        self, lease: Lease, *, savings: Savings | None = None, clean: bool = False
    ) -> None:
        self.called.append("release")
        await self.inner.release(lease, savings=savings, clean=clean)

    async def load(self, run_id: str) -> list[StepEvent]:
        self.called.append("load")
        return await self.inner.load(run_id)

    async def load_step(self, run_id: str, step_id: str) -> list[StepEvent]:
        self.called.append("load_step")
        return await self.inner.load_step(run_id, step_id)

    async def final(self, run_id: str) -> StepEvent | None:
        self.called.append("final")
        return await self.inner.final(run_id)

    async def set_status(self, run_id: str, status: RunStatus) -> None:
        self.called.append("set_status")
        await self.inner.set_status(run_id, status)

    async def runs(self, *, status: RunStatus | None = None) -> list[RunInfo]:
        self.called.append("runs")
        return await self.inner.runs(status=status)

    async def close(self) -> None:
        self.called.append("close")
        await self.inner.close()


def asks(*calls: tuple[str, dict[str, Any]], text: str = "") -> ModelResponse:
    """A model answer asking for the given (tool name, arguments) calls."""
    return ModelResponse(text=text, tool_calls=[ToolCall(name=n, arguments=a) for n, a in calls])


def done(text: str = "all done") -> ModelResponse:
    return ModelResponse(text=text)


def scripted(script: Sequence[Any], *, fail_at: int | None = None) -> ScriptedGateway:
    """A ScriptedGateway answering turn N with script[N]; turn ``fail_at`` raises."""

    def answer(request: ModelRequest) -> Any:
        turn = sum(1 for m in request.messages if m.role == "assistant")
        if turn == fail_at:
            raise ConnectionError("the provider connection dropped")
        return script[turn]

    return ScriptedGateway(answer)


def counting_tool(
    name: str, calls: list[str], *, idempotent: bool = False, crash: bool = False
) -> Tool:
    """A tool that counts its calls; its answer carries the count, so a re-run shows."""

    def body(text: str) -> str:
        calls.append(text)
        if crash:
            raise Crash(name)
        return f"{name}:{text}:{len(calls)}"

    body.__doc__ = f"The {name} tool."
    return tool(idempotent=idempotent, name=name)(body)


def echo_agent(calls: list[str], **kwargs: Any) -> Agent:
    """The agent most tests use: one counting ``echo`` tool."""
    idempotent, crash = kwargs.pop("idempotent", False), kwargs.pop("crash", False)
    echo = counting_tool("echo", calls, idempotent=idempotent, crash=crash)
    return Agent(instructions="be brief", tools=[echo], **kwargs)


ECHO_SCRIPT = [asks(("echo", {"text": "hi"})), done()]


async def drive(agent: Agent, gateway: Any, store: Any, task: str = TASK) -> list[Step]:
    """One whole pass: every step it yields."""
    return [s async for s in agent.run(task, session=Session(RUN, gateway, store))]


async def drive_until(
    agent: Agent, gateway: Any, store: Any, stop: Callable[[Step], bool]
) -> list[Step]:
    """A pass abandoned right after the first step for which ``stop`` is true."""
    gen = agent.run(TASK, session=Session(RUN, gateway, store))
    seen: list[Step] = []
    async for step in gen:
        seen.append(step)
        if stop(step):
            break
    await gen.aclose()  # type: ignore[attr-defined]
    return seen


def after_tool(step: Step) -> bool:
    """Stop a pass once a tool step is durable (before the next model answer is recorded)."""
    return isinstance(step, ToolStep)


def tool_messages(request: ModelRequest) -> list[str]:
    return [m.content for m in request.messages if m.role == "tool"]


async def phases(store: Any, step_id: str) -> list[Phase]:
    return [e.phase for e in await store.load_step(RUN, step_id)]


# -- 1. the seed's durability passes -------------------------------------------------


async def test_seed_durability_passes(journal: Journal) -> None:
    """Pass 1 pays model x1 tool x1, pass 2 model x1 tool x0, pass 3 nothing at all."""
    calls1: list[str] = []
    gw1 = ScriptedGateway(ECHO_SCRIPT)
    steps1 = await drive_until(echo_agent(calls1), gw1, journal.open(), after_tool)
    assert (len(gw1.calls), len(calls1)) == (1, 1)
    assert [type(s) for s in steps1] == [ModelStep, ToolStep]
    assert await journal.open().load_step(RUN, "m2") == []

    calls2: list[str] = []
    gw2 = ScriptedGateway(ECHO_SCRIPT)
    store2 = journal.open()
    session2 = Session(RUN, gw2, store2)
    steps2 = [s async for s in echo_agent(calls2).run(TASK, session=session2)]
    assert (len(gw2.calls), len(calls2)) == (1, 0)
    assert [type(s) for s in steps2] == [ModelStep, FinalStep]
    assert session2.stats.model_calls_replayed == 1
    assert session2.stats.tool_calls_replayed == 1

    calls3: list[str] = []
    gw3 = ScriptedGateway(ECHO_SCRIPT)
    steps3 = await drive(echo_agent(calls3), gw3, journal.open())
    assert (len(gw3.calls), len(calls3)) == (0, 0)
    assert steps3 == [FinalStep(run_id=RUN, step_id="m2", text="all done", replayed=True)]


async def test_resumed_request_is_the_uninterrupted_one(journal: Journal) -> None:
    """The m2 request rebuilt from the journal equals, key included, the one never interrupted."""
    straight = ScriptedGateway(ECHO_SCRIPT)
    await drive(echo_agent([]), straight, MemoryCheckpointer())

    await drive_until(echo_agent([]), ScriptedGateway(ECHO_SCRIPT), journal.open(), after_tool)
    resumed = ScriptedGateway(ECHO_SCRIPT)
    await drive(echo_agent([]), resumed, journal.open())
    assert resumed.calls == [straight.calls[1]]
    assert tool_messages(resumed.calls[0][0]) == ["echo:hi:1"]


# -- 2. a closed run -----------------------------------------------------------------


async def test_closed_run_reads_only_final(journal: Journal) -> None:
    """A closed run costs one final() read: no load(), no model call, no tool call."""
    await drive(echo_agent([]), ScriptedGateway(ECHO_SCRIPT), journal.open())
    spy = Spy(journal.open())
    calls: list[str] = []
    gw = ScriptedGateway(ECHO_SCRIPT)
    steps = await drive(echo_agent(calls), gw, spy)
    assert steps == [FinalStep(run_id=RUN, step_id="m2", text="all done", replayed=True)]
    assert spy.called == ["final"]
    assert "load" not in spy.called
    assert (len(gw.calls), len(calls)) == (0, 0)


async def test_closed_run_is_listed_closed(journal: Journal) -> None:
    """Reaching the final answer marks the run closed in the listing."""
    await drive(echo_agent([]), ScriptedGateway(ECHO_SCRIPT), journal.open())
    closed = await journal.open().runs(status=RunStatus.CLOSED)
    assert [r.run_id for r in closed] == [RUN]


# -- 9. commits per step -------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
async def test_two_appends_per_model_and_tool_step(journal: Journal, k: int) -> None:
    """K model+tool steps and a final answer make exactly 2K + 1 appends, and nothing
    else is written: the closing append gives the lease up (no release of its own)."""
    script = [asks(("echo", {"text": f"n{i}"})) for i in range(k)] + [done()]
    spy = Spy(journal.open())
    calls: list[str] = []
    await drive(echo_agent(calls), ScriptedGateway(script), spy)
    assert len(calls) == k
    assert spy.called.count("append") == 2 * k + 1
    assert "set_status" not in spy.called
    assert "release" not in spy.called
    info = await spy.inner.run(RUN)
    assert info is not None
    assert (info.status, info.lease_owner) == (RunStatus.CLOSED, None)


# -- 8. tool failures ----------------------------------------------------------------


async def test_tool_exception_is_a_recorded_error_and_the_run_goes_on(journal: Journal) -> None:
    """A tool that raises gives ToolStep(status=error), fed to the model; the run closes."""

    @tool
    def boom(text: str) -> str:
        """Always fails."""
        raise ValueError(f"cannot {text}")

    gw = ScriptedGateway([asks(("boom", {"text": "hi"})), done()])
    steps = await drive(Agent(tools=[boom]), gw, journal.open())
    tool_step = next(s for s in steps if isinstance(s, ToolStep))
    assert tool_step.status == "error"
    assert "ValueError: cannot hi" in str(tool_step.result)
    assert tool_messages(gw.calls[1][0]) == ["error: ValueError: cannot hi"]
    assert isinstance(steps[-1], FinalStep)
    result = (await journal.open().load_step(RUN, "m1.t1"))[-1]
    assert result.phase == Phase.RESULT
    assert result.payload["status"] == "error"


class Opaque:
    """An object pydantic cannot turn into JSON."""


def _self_referencing() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


NOT_JSON = {
    "nan": lambda: float("nan"),
    "set": lambda: {"b", "a"},
    "bad-utf8-bytes": lambda: b"\xff\xfe",
    "object": Opaque,
    "self-referencing-list": _self_referencing,
}


@pytest.mark.parametrize("kind", list(NOT_JSON))
async def test_non_json_tool_result_is_a_recorded_error(journal: Journal, kind: str) -> None:
    """A result that is not JSON is recorded as an error once and never re-run on resume."""

    def make(calls: list[int]) -> Agent:
        @tool
        def odd() -> Any:
            """Returns something odd."""
            calls.append(1)
            return NOT_JSON[kind]()

        return Agent(tools=[odd])

    script = [asks(("odd", {})), done()]
    calls: list[int] = []
    steps = await drive_until(make(calls), ScriptedGateway(script), journal.open(), after_tool)
    assert calls == [1]
    assert isinstance(steps[-1], ToolStep)
    assert steps[-1].status == "error"
    result = (await journal.open().load_step(RUN, "m1.t1"))[-1]
    assert (result.phase, result.payload["status"]) == (Phase.RESULT, "error")

    again: list[int] = []
    gw = ScriptedGateway(script)
    final = await drive(make(again), gw, journal.open())
    assert again == []
    assert isinstance(final[-1], FinalStep)
    assert tool_messages(gw.calls[0][0])[0].startswith("error: ")


@pytest.mark.parametrize(
    "call",
    [("echo", {"text": 42}), ("echo", {"text": "hi", "extra": 1}), ("echo", {}), ("nope", {})],
    ids=["wrong-type", "extra-arg", "missing-arg", "unknown-tool"],
)
async def test_unusable_call_is_a_recorded_error_and_nothing_runs(
    journal: Journal, call: tuple[str, dict[str, Any]]
) -> None:
    """Bad arguments or an unknown tool: intent and an error result, no submitted, no call."""
    calls: list[str] = []
    gw = ScriptedGateway([asks(call), done()])
    steps = await drive(echo_agent(calls), gw, journal.open())
    assert calls == []
    tool_step = next(s for s in steps if isinstance(s, ToolStep))
    assert tool_step.status == "error"
    store = journal.open()
    assert await phases(store, "m1.t1") == [Phase.INTENT, Phase.RESULT]
    assert tool_messages(gw.calls[1][0])[0].startswith("error: ")
    assert isinstance(steps[-1], FinalStep)


# -- 11. max_turns -------------------------------------------------------------------


async def test_max_turns_bounds_the_model_calls(journal: Journal) -> None:
    """A model that always asks for a tool stops with MaxTurnsExceeded after max_turns calls."""
    calls: list[str] = []
    gw = ScriptedGateway(lambda request: asks(("echo", {"text": "again"})))
    with pytest.raises(MaxTurnsExceeded, match=RUN):
        await drive(echo_agent(calls, max_turns=3), gw, journal.open())
    assert len(gw.calls) == 3
    assert len(calls) == 3
    assert await journal.open().load_step(RUN, "m4") == []


# -- 12. a gateway that answers garbage ----------------------------------------------


async def test_gateway_garbage_is_a_usage_error_and_records_nothing(journal: Journal) -> None:
    """A gateway answer that is not a ModelResponse records nothing; a good gateway finishes."""
    calls: list[str] = []
    bad = scripted([ECHO_SCRIPT[0], {"text": "all done"}])
    with pytest.raises(UsageError, match="ModelResponse"):
        await drive(echo_agent(calls), bad, journal.open())
    store = journal.open()
    assert await store.load_step(RUN, "m2") == []
    assert await store.final(RUN) is None

    good = ScriptedGateway(ECHO_SCRIPT)
    steps = await drive(echo_agent(calls), good, journal.open())
    assert isinstance(steps[-1], FinalStep)
    assert steps[-1].text == "all done"
    assert len(good.calls) == 1
    assert calls == ["hi"]


async def test_tool_arguments_that_are_not_json_are_a_usage_error(journal: Journal) -> None:
    """Arguments a gateway built from Python objects JSON cannot hold are refused by name."""
    calls: list[str] = []
    bad = ScriptedGateway(
        [ModelResponse(tool_calls=[ToolCall(name="echo", arguments={"text": {"a", "b"}})])]
    )
    with pytest.raises(UsageError, match="tool call 'echo' has arguments that are not JSON"):
        await drive(echo_agent(calls), bad, journal.open())
    assert calls == []
    assert await journal.open().load_step(RUN, "m1") == []


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (float("nan"), "argument 'text' holds NaN, which JSON cannot carry"),
        (
            [1.0, float("-inf")],
            "argument 'text' holds -Infinity (at text[1]), which JSON cannot carry",
        ),
        (
            {"n": 10**4400},
            "argument 'text' holds an integer with more than 4300 digits (at text.n), which "
            "exceeds Python's limit of 4300 digits for int/str conversion",
        ),
    ],
    ids=["nan", "minus-infinity-in-a-list", "long-int-in-a-dict"],
)
async def test_arguments_json_cannot_carry_are_the_steps_recorded_outcome(
    journal: Journal, value: Any, said: str
) -> None:
    """A gateway's call holding NaN or a too-long int is recorded with its problem, not run."""
    calls: list[str] = []
    gateway = ScriptedGateway(
        [ModelResponse(tool_calls=[ToolCall(name="echo", arguments={"text": value})]), done()]
    )
    steps = await drive(echo_agent(calls), gateway, journal.open())
    assert calls == []
    [tool_step] = [s for s in steps if isinstance(s, ToolStep)]
    assert (tool_step.status, tool_step.result, tool_step.call.problem) == ("error", said, said)
    assert gateway.calls[1][0].messages[-1].content == f"error: {said}"
    again = ScriptedGateway([])
    assert isinstance((await drive(echo_agent(calls), again, journal.open()))[-1], FinalStep)
    assert again.calls == []


# -- 13. sync and async tools, async policy ------------------------------------------


async def test_sync_and_async_tools_and_async_policy() -> None:
    """Sync and async tools both run once; an async policy's deny is honoured."""
    ran: list[str] = []

    @tool
    def sync_tool(text: str) -> str:
        """Sync."""
        ran.append("sync")
        return f"sync:{text}"

    @tool
    async def async_tool(text: str) -> str:
        """Async."""
        await asyncio.sleep(0)
        ran.append("async")
        return f"async:{text}"

    @tool
    def forbidden(text: str) -> str:
        """Never allowed."""
        ran.append("forbidden")
        return "no"

    async def policy(call: ToolCall) -> str:
        await asyncio.sleep(0)
        return "deny" if call.name == "forbidden" else "allow"

    calls = [
        ("sync_tool", {"text": "a"}),
        ("async_tool", {"text": "b"}),
        ("forbidden", {"text": "c"}),
    ]
    gw = ScriptedGateway([asks(*calls), done()])
    agent = Agent(tools=[sync_tool, async_tool, forbidden], policy=policy)
    steps = await drive(agent, gw, MemoryCheckpointer())
    assert ran == ["sync", "async"]
    statuses = [(s.step_id, s.status) for s in steps if isinstance(s, ToolStep)]
    assert statuses == [("m1.t1", "ok"), ("m1.t2", "ok"), ("m1.t3", "denied")]
    assert tool_messages(gw.calls[1][0]) == ["sync:a", "async:b", "denied: denied by policy"]
