"""OpenAI Agents SDK agents on asiento's journal: the real SDK, the official client, real kills.

The agent is the SDK's own ``Agent`` on ``OpenAIChatCompletionsModel`` and
``AsyncOpenAI``, talking Chat Completions over HTTP to ``FakeProvider`` on
127.0.0.1, which counts billable generations by their ``Idempotency-Key``. The
crash tests run one pass per child process (``oa_child.py``) and kill it with
SIGKILL at a named point; each real run of the tool is a line in a file.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import agents
import openai
import pydantic
import pytest
from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIProvider,
    RunConfig,
    function_tool,
    handoff,
)

import asiento
from asiento import ReplayDivergence, SqliteCheckpointer, UsageError, submit
from asiento._canonical import model_key
from asiento.events import Phase, RunStatus
from asiento.integrations.openai_agents import durable_run
from asiento.lease import Holder
from asiento.proxy import create_app
from asiento.testing import ENV_VAR
from providers.fake_servers import Answer, AsgiServer, FakeProvider
from sqlite_files import record_commits

from .oa_child import TASK, build_agent

os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
agents.set_tracing_disabled(True)

CHILD = Path(__file__).with_name("oa_child.py")
RUN = "refund-42"
KILLED = -signal.SIGKILL
REFUND = ("refund", {"order": 42, "amount": 9.5})
SCRIPT = (Answer(calls=(REFUND,)), Answer(text="all done"))


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    """A scripted Chat Completions provider: refund, then done."""
    with FakeProvider(SCRIPT) as p:
        yield p


def child(
    tmp_path: Path, url: str, *, crash_at: str | None = None, idempotent: bool = False
) -> dict[str, Any] | None:
    """One pass in a new process; its JSON outcome, or None if it was killed."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if crash_at:
        env[ENV_VAR] = crash_at
    argv = [sys.executable, str(CHILD), str(tmp_path / "runs.db"), RUN, url,
            str(tmp_path / "tools.log"), *(["idempotent"] if idempotent else [])]  # fmt: skip
    proc = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        assert proc.returncode == KILLED, proc.stderr
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tool_runs(tmp_path: Path) -> int:
    log = tmp_path / "tools.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def billed_per_step(provider: FakeProvider) -> Counter[str]:
    return Counter(key.split(":")[1] for key in provider.generations if key)


async def timeline(db: Path, run_id: str = RUN) -> list[tuple[str, str]]:
    store = SqliteCheckpointer(db)
    try:
        return [(e.step_id, str(e.phase)) for e in await store.load(run_id)]
    finally:
        await store.close()


def test_the_seeds_three_passes(provider: FakeProvider, tmp_path: Path) -> None:
    """Killed after the tool: model x1 tool x1; then model x1 tool x0; then nothing at all."""
    assert child(tmp_path, provider.openai_url, crash_at="after_result") is None
    assert (provider.billed(), tool_runs(tmp_path)) == (1, 1)
    second = child(tmp_path, provider.openai_url)
    assert second == {"ended": "closed", "output": "all done", "replayed": False}
    assert (provider.billed(), tool_runs(tmp_path)) == (2, 1)
    third = child(tmp_path, provider.openai_url)
    assert third == {"ended": "closed", "output": "all done", "replayed": True}
    assert (provider.billed(), tool_runs(tmp_path)) == (2, 1)
    assert billed_per_step(provider) == {"m1": 1, "m2": 1}
    assert asyncio.run(timeline(tmp_path / "runs.db")) == [
        ("m1", "result"), ("m1.t1", "intent"), ("m1.t1", "submitted"), ("m1.t1", "result"),
        ("m2", "result"), ("final", "result"),
    ]  # fmt: skip


def test_every_request_carries_its_steps_idempotency_key(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """The key a request is sent with is asiento's key of its step and fingerprint."""
    assert child(tmp_path, provider.openai_url) is not None
    keys = [r.key for r in provider.requests]
    assert [k.split(":")[:2] for k in keys if k] == [[RUN, "m1"], [RUN, "m2"]]
    payloads = asyncio.run(_model_results(tmp_path / "runs.db"))
    assert keys == [model_key(RUN, step, payloads[step]["fp"]) for step in ("m1", "m2")]


async def _model_results(db: Path) -> dict[str, Any]:
    store = SqliteCheckpointer(db)
    try:
        events = await store.load(RUN)
    finally:
        await store.close()
    return {e.step_id: e.payload for e in events if e.step_id in ("m1", "m2")}


def test_a_tool_killed_before_its_result_is_an_uncertain_effect(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """Killed between the tool's submitted record and its result: the resume does not guess."""
    assert child(tmp_path, provider.openai_url, crash_at="after_tool") is None
    assert tool_runs(tmp_path) == 1
    assert child(tmp_path, provider.openai_url) == {"ended": "uncertain", "step": "m1.t1"}
    assert (provider.billed(), tool_runs(tmp_path)) == (1, 1)
    info = asyncio.run(_info(tmp_path / "runs.db"))
    assert info.status is RunStatus.UNCERTAIN


@pytest.mark.parametrize("happened", [True, False], ids=["happened", "not-happened"])
def test_an_uncertain_effect_is_resolved_from_the_cli(
    provider: FakeProvider, tmp_path: Path, *, happened: bool
) -> None:
    """`asiento resolve` settles the SDK run's uncertain step: found, it is fed to the model
    and never run again; not happened, the next pass runs it once more."""
    db = str(tmp_path / "runs.db")
    assert child(tmp_path, provider.openai_url, crash_at="after_tool") is None
    assert child(tmp_path, provider.openai_url) == {"ended": "uncertain", "step": "m1.t1"}
    found = "--happened" if happened else "--not-happened"
    decided = _asiento("resolve", RUN, "m1.t1", found, "--by", "ana", "--store", db)
    assert decided.returncode == 0, decided.stderr
    resumed = child(tmp_path, provider.openai_url)
    assert resumed == {"ended": "closed", "output": "all done", "replayed": False}
    assert tool_runs(tmp_path) == (1 if happened else 2)
    assert billed_per_step(provider) == {"m1": 1, "m2": 1}


async def _info(db: Path) -> Any:
    store = SqliteCheckpointer(db)
    try:
        return await store.run(RUN)
    finally:
        await store.close()


def test_an_idempotent_tool_killed_before_its_result_runs_again(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """Declared idempotent, the same crash re-runs the tool as a second attempt and goes on."""
    assert child(tmp_path, provider.openai_url, crash_at="after_tool", idempotent=True) is None
    resumed = child(tmp_path, provider.openai_url, idempotent=True)
    assert resumed == {"ended": "closed", "output": "all done", "replayed": False}
    assert (billed_per_step(provider), tool_runs(tmp_path)) == ({"m1": 1, "m2": 1}, 2)
    assert ("m1.t1/2", "result") in asyncio.run(timeline(tmp_path / "runs.db"))


def test_a_crash_inside_a_model_call_through_the_gateway_is_billed_once(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """Killed after m1's answer came, before it was recorded: asiento gateway answers the
    resumed request from what it kept under the key; without it, m1 is paid twice."""
    app = create_app(provider.openai_url, db=tmp_path / "keys.db")
    with AsgiServer(app) as server:
        url = server.url + "/v1"
        assert child(tmp_path, url, crash_at="inside_model_call") is None
        assert asyncio.run(timeline(tmp_path / "runs.db")) == []
        resumed = child(tmp_path, url)
    assert resumed == {"ended": "closed", "output": "all done", "replayed": False}
    assert billed_per_step(provider) == {"m1": 1, "m2": 1}


def test_without_the_gateway_that_crash_pays_twice(provider: FakeProvider, tmp_path: Path) -> None:
    """The same crash straight to the provider: the journal had nothing, m1 is asked again."""
    assert child(tmp_path, provider.openai_url, crash_at="inside_model_call") is None
    assert child(tmp_path, provider.openai_url) is not None
    assert billed_per_step(provider) == {"m1": 2, "m2": 1}


@function_tool
def lookup_order(order: int) -> str:
    """Read an order."""
    return "order"


@pytest.mark.parametrize(
    "change",
    [{"instructions": "Be generous."}, {"more_tools": (lookup_order,)}],
    ids=["instructions", "tools"],
)
def test_a_changed_agent_is_a_replay_divergence(
    provider: FakeProvider, tmp_path: Path, change: dict[str, Any]
) -> None:
    """A resumed run whose agent asks m1 differently (other instructions, another tool)
    stops, naming the step, and runs nothing."""
    assert child(tmp_path, provider.openai_url, crash_at="after_model_result") is None

    async def resume() -> None:
        client = sdk(provider)
        agent = build_agent(client, tmp_path / "tools.log", **change)
        store = SqliteCheckpointer(tmp_path / "runs.db")
        try:
            await durable_run(agent, TASK, run_id=RUN, store=store)
        finally:
            await store.close()
            await client.close()

    with pytest.raises(ReplayDivergence, match="'m1'"):
        asyncio.run(resume())
    assert (provider.billed(), tool_runs(tmp_path)) == (1, 0)


# -- in one process ----------------------------------------------------------------------


def sdk(provider: FakeProvider) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="sk-test", base_url=provider.openai_url, max_retries=0)


@pytest.fixture
async def clients() -> AsyncIterator[list[openai.AsyncOpenAI]]:
    """The official clients a test made, closed at its end."""
    made: list[openai.AsyncOpenAI] = []
    yield made
    for client in made:
        await client.close()


def _model(provider: FakeProvider, clients: list[openai.AsyncOpenAI]) -> OpenAIChatCompletionsModel:
    clients.append(sdk(provider))
    return OpenAIChatCompletionsModel(model="gpt-test", openai_client=clients[-1])


async def test_parallel_calls_are_numbered_by_their_place_in_the_answer(
    tmp_path: Path, clients: list[openai.AsyncOpenAI]
) -> None:
    """Two calls in one answer are m1.t1 and m1.t2 in the order the model wrote them."""
    calls = (("refund", {"order": 1, "amount": 1.0}), ("refund", {"order": 2, "amount": 2.0}))
    seen: list[int] = []

    @function_tool
    async def refund(order: int, amount: float) -> str:
        """Refund an order."""
        await asyncio.sleep(0.05 if order == 1 else 0)  # the second finishes first
        seen.append(order)
        return f"refunded {order}"

    with FakeProvider((Answer(calls=calls), Answer(text="both done"))) as provider:
        agent = Agent(name="refunds", model=_model(provider, clients), tools=[refund])
        store = SqliteCheckpointer(tmp_path / "runs.db")
        try:
            result = await durable_run(agent, TASK, run_id=RUN, store=store)
            events = await store.load(RUN)
        finally:
            await store.close()
    assert result.final_output == "both done"
    assert seen == [2, 1]
    intents = {e.step_id: e.payload["args"]["order"] for e in events if e.phase is Phase.INTENT}
    assert intents == {"m1.t1": 1, "m1.t2": 2}


@pytest.mark.parametrize("as_handoff", [True, False], ids=["handoff()", "agent"])
async def test_a_handoff_is_a_step_of_the_same_run(
    tmp_path: Path, clients: list[openai.AsyncOpenAI], *, as_handoff: bool
) -> None:
    """Triage hands off to refunds: the handoff and the refunds agent's steps share the run."""
    script = (
        Answer(calls=(("transfer_to_refunds", {}),)),
        Answer(calls=(REFUND,)),
        Answer(text="refunded"),
    )
    runs: list[int] = []

    @function_tool
    def refund(order: int, amount: float) -> str:
        """Refund an order."""
        runs.append(order)
        return "ok"

    with FakeProvider(script) as provider:
        refunds = Agent(name="refunds", model=_model(provider, clients), tools=[refund])
        to = handoff(refunds) if as_handoff else refunds
        triage = Agent(name="triage", model=_model(provider, clients), handoffs=[to])
        store = SqliteCheckpointer(tmp_path / "runs.db")
        try:
            first = await durable_run(triage, TASK, run_id=RUN, store=store)
            again = await durable_run(triage, TASK, run_id=RUN, store=store)
            events = await store.load(RUN)
        finally:
            await store.close()
    assert (first.final_output, again.final_output, again.replayed) == (
        "refunded",
        "refunded",
        True,
    )
    assert runs == [42]
    steps = [(e.step_id, str(e.phase)) for e in events if e.phase in (Phase.INTENT, Phase.RESULT)]
    assert steps == [
        ("m1", "result"), ("m1.t1", "intent"), ("m1.t1", "result"), ("m2", "result"),
        ("m2.t1", "intent"), ("m2.t1", "result"), ("m3", "result"), ("final", "result"),
    ]  # fmt: skip
    handed = next(e for e in events if e.step_id == "m1.t1" and e.phase is Phase.RESULT)
    assert handed.payload["value"] == {"handoff": "refunds"}


async def test_the_run_is_listed_like_a_native_run(
    provider: FakeProvider, tmp_path: Path, clients: list[openai.AsyncOpenAI]
) -> None:
    """The run index shows it closed, with its model calls and tool steps."""
    clients.append(sdk(provider))
    agent = build_agent(clients[-1], tmp_path / "tools.log")
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        await durable_run(agent, TASK, run_id=RUN, store=store)
        info = await store.run(RUN)
    finally:
        await store.close()
    assert info is not None
    assert (info.status, info.model_calls, info.tool_steps) == (RunStatus.CLOSED, 2, 1)
    shown = subprocess.run(
        [sys.executable, "-m", "asiento", "show", RUN, "--store", str(tmp_path / "runs.db")],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "m1.t1" in shown.stdout
    assert "closed after m2" in shown.stdout


async def test_a_model_and_tool_step_costs_two_commits_and_the_close_gives_the_lease_up(
    provider: FakeProvider, tmp_path: Path, clients: list[openai.AsyncOpenAI]
) -> None:
    """As a native run: m1's answer rides with its tool's intent and submitted, the
    outcome is one commit, m2's answer rides with the final record, and that commit
    gives the lease up (no release of its own)."""
    clients.append(sdk(provider))
    agent = build_agent(clients[-1], tmp_path / "tools.log")
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        commits = record_commits(store, every=True)
        await durable_run(agent, TASK, run_id=RUN, store=store)
        info = await store.run(RUN)
    finally:
        await store.close()
    assert commits == [0, 3, 1, 2]  # the lease, (m1, intent, submitted), result, (m2, final)
    assert info is not None
    assert (info.status, info.lease_owner) == (RunStatus.CLOSED, None)


# -- what it refuses, rather than repeat effects silently --------------------------------


@function_tool(timeout=5.0)
async def slow(x: int) -> int:
    """A tool the SDK may cancel."""
    return x


@function_tool
def _plain(x: int) -> int:
    """A plain tool."""
    return x


@pytest.mark.parametrize(
    ("tools", "idempotent", "match"),
    [
        ([slow], (), "timeout_seconds"),
        ([_plain], ("nope",), "'nope'"),
        ([_plain], "_plain", r"idempotent_tools=\.\.\.\) takes names .*got str '_plain'"),
    ],
    ids=["timeout", "unknown-idempotent", "one-string"],
)
async def test_what_would_repeat_silently_is_refused(
    provider: FakeProvider,
    tmp_path: Path,
    clients: list[openai.AsyncOpenAI],
    *,
    tools: list[Any],
    idempotent: tuple[str, ...] | str,
    match: str,
) -> None:
    """A tool the SDK could cancel mid-effect, a misnamed idempotent tool, a string
    where names go (its letters would be read as tool names): UsageError."""
    agent = Agent(name="a", model=_model(provider, clients), tools=tools)
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        with pytest.raises(UsageError, match=match):
            await durable_run(agent, TASK, run_id=RUN, store=store, idempotent_tools=idempotent)
        assert await store.load(RUN) == []
    finally:
        await store.close()
    assert provider.billed() == 0


# -- approvals ---------------------------------------------------------------------------


def _asiento(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asiento", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _wire_money(sent: list[int], amount: int) -> tuple[agents.FunctionTool, tuple[Answer, ...]]:
    """A ``wire_money`` tool that needs approval, each real run appended to ``sent``, and
    the script that calls it once for ``amount``, then says "finished"."""

    @function_tool(needs_approval=True)
    def wire_money(amount: int) -> str:
        """Send money."""
        sent.append(amount)
        return "sent"

    script = (Answer(calls=(("wire_money", {"amount": amount}),)), Answer(text="finished"))
    return wire_money, script


@pytest.mark.parametrize("approved", [True, False], ids=["approved", "denied"])
async def test_needs_approval_waits_for_a_person_from_the_cli(
    tmp_path: Path, clients: list[openai.AsyncOpenAI], *, approved: bool
) -> None:
    """A tool with needs_approval suspends the run; approved from the CLI it runs exactly
    once, denied the model is told so; a closed run then runs nothing."""
    sent: list[int] = []
    wire_money, script = _wire_money(sent, 100)
    db = tmp_path / "runs.db"
    with FakeProvider(script) as provider:
        agent = Agent(name="payer", model=_model(provider, clients), tools=[wire_money])

        async def once() -> Any:
            store = SqliteCheckpointer(db)
            try:
                return await durable_run(agent, TASK, run_id=RUN, store=store)
            finally:
                await store.close()

        waiting = await once()
        assert (waiting.awaiting, sent) == ("m1.t1", [])
        assert (await once()).awaiting == "m1.t1"  # still waiting: nothing new is paid
        assert provider.billed() == 1
        verb = "approve" if approved else "deny"
        why = [] if approved else ["--reason", "not today"]
        decided = _asiento(verb, RUN, "m1.t1", "--by", "ana", *why, "--store", str(db))
        assert decided.returncode == 0, decided.stderr
        done = await once()
        again = await once()
        last_request = provider.requests[-1].body["messages"][-1]["content"]
    assert (done.final_output, again.replayed) == ("finished", True)
    assert sent == ([100] if approved else [])
    assert provider.billed() == 2
    assert ("sent" if approved else "not today") in last_request


def test_the_refund_example_runs_and_holds_its_counts() -> None:
    """examples/integrations/openai_agents_refund.py: 1/1 killed, 1/0 closed, 0/0 closed."""
    example = Path(__file__).resolve().parents[2] / "examples/integrations/openai_agents_refund.py"
    proc = subprocess.run(
        [sys.executable, str(example)], check=True, capture_output=True, text=True, timeout=300
    )
    rows = [line.split()[:3] for line in proc.stdout.splitlines()[1:4]]
    assert rows == [["1", "1", "1"], ["2", "1", "0"], ["3", "0", "0"]]
    assert "refunds made in all: 1" in proc.stdout


@pytest.mark.parametrize("idempotent", [True, False], ids=["idempotent", "not-idempotent"])
def test_parallel_calls_killed_mid_way(tmp_path: Path, *, idempotent: bool) -> None:
    """Two calls of one answer, killed once the first result is durable: on resume each
    step keeps its place in the answer, a step with a result never runs again, and a step
    submitted without one runs again only if the tool is idempotent (else UncertainEffect)."""
    calls = (("refund", {"order": 1, "amount": 1.0}), ("refund", {"order": 2, "amount": 2.0}))
    with FakeProvider((Answer(calls=calls), Answer(text="both done"))) as provider:
        url = provider.openai_url
        assert child(tmp_path, url, crash_at="after_result@1", idempotent=idempotent) is None
        first = asyncio.run(_tool_steps(tmp_path / "runs.db"))
        ran_first = _orders(tmp_path)
        resumed = child(tmp_path, url, idempotent=idempotent)
        assert provider.billed() == (2 if resumed and resumed["ended"] == "closed" else 1)
    assert first["intents"] == {"m1.t1": 1, "m1.t2": 2}
    done = first["results"]
    assert done, "the first result was durable before the kill"
    every = _orders(tmp_path)
    for step in done:  # recorded: ran once, in the first pass only
        assert every.count(first["intents"][step]) == 1
    open_steps = sorted(set(first["intents"]) - set(done))
    if not open_steps or idempotent:
        assert resumed == {"ended": "closed", "output": "both done", "replayed": False}
    else:
        assert resumed == {"ended": "uncertain", "step": open_steps[0]}
        assert every == ran_first  # nothing ran in the resumed pass


async def _tool_steps(db: Path) -> dict[str, Any]:
    store = SqliteCheckpointer(db)
    try:
        events = await store.load(RUN)
    finally:
        await store.close()
    intents = {e.step_id: e.payload["args"]["order"] for e in events if e.phase is Phase.INTENT}
    results = [e.step_id for e in events if e.phase is Phase.RESULT and e.step_id in intents]
    return {"intents": intents, "results": results}


def _orders(tmp_path: Path) -> list[int]:
    log = tmp_path / "tools.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return sorted(json.loads(line)["order"] for line in lines)


def test_the_overhead_bench_runs() -> None:
    """bench/openai_agents.py runs both paths on one workload and prints their figures."""
    bench = Path(__file__).resolve().parents[2] / "bench/openai_agents.py"
    proc = subprocess.run(
        [sys.executable, str(bench), "--runs", "1", "--turns", "2"],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    for row in ("Runner.run", "durable_run", "closed run (replay)", "overhead per model+tool step"):
        assert row in proc.stdout


async def test_a_queued_run_is_claimed_and_driven_under_the_claims_lease(
    provider: FakeProvider, tmp_path: Path, clients: list[openai.AsyncOpenAI]
) -> None:
    """A run queued with asiento.submit is claimed from the store like a native one and
    driven by durable_run under the claim's lease (the task from the claim); once closed,
    nobody claims it again."""
    clients.append(sdk(provider))
    agents_by_name = {"refunds": build_agent(clients[-1], tmp_path / "tools.log")}
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        await submit(store, RUN, TASK, agent="refunds")
        claim = await store.claim(Holder.here(), ttl=30.0)
        assert claim is not None
        agent = agents_by_name[claim.agent]
        result = await durable_run(
            agent, claim.task, run_id=claim.lease.run_id, store=store, lease=claim.lease
        )
        info = await store.run(RUN)
        again = await store.claim(Holder.here(), ttl=30.0)
    finally:
        await store.close()
    assert result.final_output == "all done"
    assert info is not None
    assert (info.status, info.lease_owner, info.task) == (RunStatus.CLOSED, None, TASK)
    assert again is None


class Refunded(pydantic.BaseModel):
    order: int
    refunded: bool


async def test_structured_output_is_recorded_and_given_back(
    tmp_path: Path, clients: list[openai.AsyncOpenAI]
) -> None:
    """An agent with output_type: the live pass returns the SDK's typed output, the closed
    run its recorded JSON, without asking the model."""
    script = (Answer(text='{"order": 42, "refunded": true}'),)
    with FakeProvider(script) as provider:
        agent = Agent(name="r", model=_model(provider, clients), output_type=Refunded)
        store = SqliteCheckpointer(tmp_path / "runs.db")
        try:
            live = await durable_run(agent, TASK, run_id=RUN, store=store)
            closed = await durable_run(agent, TASK, run_id=RUN, store=store)
        finally:
            await store.close()
        assert provider.billed() == 1
    assert live.final_output == Refunded(order=42, refunded=True)
    assert (closed.final_output, closed.replayed) == ({"order": 42, "refunded": True}, True)


async def test_an_abandoned_run_answers_abandoned(
    provider: FakeProvider, tmp_path: Path, clients: list[openai.AsyncOpenAI]
) -> None:
    """A run suspended for approval and abandoned from the CLI runs nothing more."""
    sent: list[int] = []

    @function_tool(needs_approval=True)
    def refund(order: int, amount: float) -> str:
        """Refund an order."""
        sent.append(order)
        return "ok"

    db = tmp_path / "runs.db"
    agent = Agent(name="r", model=_model(provider, clients), tools=[refund])
    store = SqliteCheckpointer(db)
    try:
        assert (await durable_run(agent, TASK, run_id=RUN, store=store)).awaiting == "m1.t1"
        gone = _asiento("abandon", RUN, "--by", "ana", "--reason", "duplicate", "--store", str(db))
        assert gone.returncode == 0, gone.stderr
        after = await durable_run(agent, TASK, run_id=RUN, store=store)
    finally:
        await store.close()
    assert (after.abandoned, after.replayed, sent, provider.billed()) == (True, True, [], 1)
    assert "duplicate" in after.final_output


async def test_a_model_named_by_string_goes_through_the_run_configs_provider(
    provider: FakeProvider, tmp_path: Path, clients: list[openai.AsyncOpenAI]
) -> None:
    """Agent(model="gpt-test") with RunConfig(model_provider=OpenAIProvider(...)) on the
    Responses API: the provider's models are journaled too (keys sent, closed run replayed)."""
    clients.append(sdk(provider))
    runs: list[int] = []

    @function_tool
    def refund(order: int, amount: float) -> str:
        """Refund an order."""
        runs.append(order)
        return "ok"

    agent = Agent(name="r", model="gpt-test", tools=[refund])
    config = RunConfig(model_provider=OpenAIProvider(openai_client=clients[-1], use_responses=True))
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        live = await durable_run(agent, TASK, run_id=RUN, store=store, run_config=config)
        closed = await durable_run(agent, TASK, run_id=RUN, store=store, run_config=config)
    finally:
        await store.close()
    assert (live.final_output, closed.replayed, runs) == ("all done", True, [42])
    assert {r.path for r in provider.requests} == {"/v1/responses"}
    assert billed_per_step(provider) == {"m1": 1, "m2": 1}


async def test_an_approval_given_while_the_pass_replays_is_not_overwritten(
    tmp_path: Path, clients: list[openai.AsyncOpenAI]
) -> None:
    """A person approves after the pass read the journal, before it reached the step: the
    pass does not mark the run suspended over the decision; it reads it and runs the tool."""
    sent: list[int] = []
    approve_now: list[bool] = []
    db = tmp_path / "runs.db"
    wire_money, script = _wire_money(sent, 5)

    async def instructions(ctx: Any, agent: Any) -> str:
        if approve_now:  # another person, another connection, mid-pass
            approve_now.clear()
            other = SqliteCheckpointer(db)
            try:
                await asiento.approve(other, RUN, "m1.t1", by="ana")
            finally:
                await other.close()
        return "You send money."

    with FakeProvider(script) as provider:
        agent = Agent(
            name="payer", instructions=instructions, model=_model(provider, clients),
            tools=[wire_money],
        )  # fmt: skip
        store = SqliteCheckpointer(db)
        try:
            assert (await durable_run(agent, TASK, run_id=RUN, store=store)).awaiting == "m1.t1"
            approve_now.append(True)
            done = await durable_run(agent, TASK, run_id=RUN, store=store)
            info = await store.run(RUN)
        finally:
            await store.close()
    assert (done.final_output, sent) == ("finished", [5])
    assert info is not None
    assert info.status is RunStatus.CLOSED


async def test_asiento_worker_drives_sdk_runs_submitted_and_suspended_on_an_approval(
    tmp_path: Path, clients: list[openai.AsyncOpenAI]
) -> None:
    """``App(agents={...: WorkerAgent(agent)})``: ``asiento.Worker`` claims a submitted SDK
    run; a run it left suspended on ``needs_approval`` is approved with the CLI and closed
    by the next claim, the tool run exactly once."""
    from asiento.integrations.openai_agents import WorkerAgent
    from asiento.testing import ScriptedGateway
    from asiento.worker import App, Worker

    sent: list[int] = []
    wire_money, script = _wire_money(sent, 100)
    db = tmp_path / "runs.db"
    with FakeProvider(script) as provider:
        agent = Agent(name="payer", model=_model(provider, clients), tools=[wire_money])
        app = App(agents={"payer": WorkerAgent(agent)}, gateway=ScriptedGateway([]), lease_ttl=5)
        store = SqliteCheckpointer(db)
        try:
            await submit(store, RUN, TASK, agent="payer")
            first = Worker(store, app, poll=0.05)
            await first.run(until_idle=True, max_seconds=60)
            suspended = await store.run(RUN)
            decided = await asyncio.to_thread(
                _asiento, "approve", RUN, "m1.t1", "--by", "ana", "--store", str(db)
            )
            second = Worker(store, app, poll=0.05)
            await second.run(until_idle=True, max_seconds=60)
            closed = await store.run(RUN)
        finally:
            await store.close()
    assert (first.stats.claimed, first.stats.suspended) == (1, 1)
    assert suspended is not None
    assert suspended.status is RunStatus.SUSPENDED
    assert decided.returncode == 0, decided.stderr
    assert (second.stats.claimed, second.stats.closed) == (1, 1)
    assert closed is not None
    assert closed.status is RunStatus.CLOSED
    assert sent == [100]
    assert provider.billed() == 2


def test_worker_agent_takes_only_an_sdk_agent() -> None:
    from asiento.integrations.openai_agents import WorkerAgent

    with pytest.raises(UsageError, match=r"agents\.Agent"):
        WorkerAgent(object())  # type: ignore[arg-type]


def _lookup_then_refund(
    looked: list[int], refunded: list[int]
) -> tuple[list[agents.FunctionTool], tuple[Answer, ...]]:
    """A plain ``lookup`` and a ``refund`` that needs approval, each real run appended to
    its list, and the script that calls ``lookup``, then ``refund``, then says "finished"."""

    @function_tool
    def lookup(order: int) -> str:
        """Read an order."""
        looked.append(order)
        return "order 42: 9.5"

    @function_tool(needs_approval=True)
    def refund(order: int, amount: float) -> str:
        """Refund an order."""
        refunded.append(order)
        return "refunded"

    script = (
        Answer(calls=(("lookup", {"order": 42}),)),
        Answer(calls=(REFUND,)),
        Answer(text="finished"),
    )
    return [lookup, refund], script


_PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}


@pytest.mark.parametrize("tracing", [False, True], ids=["untraced", "traced"])
@pytest.mark.parametrize("api", sorted(_PATHS))
async def test_an_approval_after_a_plain_tool_replays_exactly(
    tmp_path: Path, clients: list[openai.AsyncOpenAI], *, api: str, tracing: bool
) -> None:
    """lookup (no approval) in m1, then refund (needs approval) in m2: the pass after the
    person's approval replays m1, m1.t1 and m2 as recorded (no ReplayDivergence at m2:
    m1's function call, read back from the journal, is the item the SDK built live, no
    field set that was unset), runs the refund once and closes; lookup ran once, nothing
    is paid twice."""
    looked: list[int] = []
    refunded: list[int] = []
    tools, script = _lookup_then_refund(looked, refunded)
    with FakeProvider(script) as provider:
        config = None
        if api == "chat":
            agent = Agent(name="refunds", model=_model(provider, clients), tools=tools)
        else:
            clients.append(sdk(provider))
            agent = Agent(name="refunds", model="gpt-test", tools=tools)
            provided = OpenAIProvider(openai_client=clients[-1], use_responses=True)
            config = RunConfig(model_provider=provided)
        store = SqliteCheckpointer(tmp_path / "runs.db")

        async def once() -> Any:
            return await durable_run(
                agent, TASK, run_id=RUN, store=store, run_config=config, tracing=tracing
            )

        try:
            waiting = await once()
            assert (waiting.awaiting, looked, refunded) == ("m2.t1", [42], [])
            await asiento.approve(store, RUN, "m2.t1", by="ana")
            done = await once()
            again = await once()
        finally:
            await store.close()
        assert billed_per_step(provider) == {"m1": 1, "m2": 1, "m3": 1}
        assert {r.path for r in provider.requests} == {_PATHS[api]}
    assert (done.final_output, again.final_output, again.replayed) == ("finished",) * 2 + (True,)
    assert (looked, refunded) == ([42], [42])


async def test_a_prompt_changed_at_m2_after_the_approval_is_still_a_divergence(
    tmp_path: Path, clients: list[openai.AsyncOpenAI]
) -> None:
    """The same run, resumed after the approval with instructions that differ from m2 on
    (m1's are as recorded): ReplayDivergence names m2, and nothing runs or is paid."""
    looked: list[int] = []
    refunded: list[int] = []
    tools, script = _lookup_then_refund(looked, refunded)
    prompts = iter(["You refund.", "You refund.", "You refund.", "You refund generously."])

    async def instructions(ctx: Any, agent: Any) -> str:
        return next(prompts)

    with FakeProvider(script) as provider:
        model = _model(provider, clients)
        agent = Agent(name="refunds", instructions=instructions, model=model, tools=tools)
        store = SqliteCheckpointer(tmp_path / "runs.db")
        try:
            assert (await durable_run(agent, TASK, run_id=RUN, store=store)).awaiting == "m2.t1"
            await asiento.approve(store, RUN, "m2.t1", by="ana")
            with pytest.raises(ReplayDivergence, match="'m2'"):
                await durable_run(agent, TASK, run_id=RUN, store=store)
        finally:
            await store.close()
        assert provider.billed() == 2
    assert (looked, refunded) == ([42], [])


def test_a_recorded_answer_reads_back_as_the_objects_the_sdk_built() -> None:
    """dump_response/load_response keep which fields of an item were set, under their wire
    names: the replayed answer gives the SDK the very input items the live one gave."""
    from agents.items import ModelResponse as SdkResponse
    from agents.usage import Usage as SdkUsage
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage

    from asiento.integrations import _oa_wire as wire

    called = ResponseFunctionToolCall.model_validate(
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}",
         "async": True, "provider_data": {"model": "m"}}
    )  # fmt: skip
    said = ResponseOutputMessage.model_validate(
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "hi", "annotations": []}]}
    )  # fmt: skip
    live = SdkResponse(output=[said, called], usage=SdkUsage(), response_id="r1")
    replayed = wire.load_response(json.loads(json.dumps(wire.dump_response(live))))
    assert replayed.to_input_items() == live.to_input_items()
    set_fields = [[i.model_fields_set for i in r.output] for r in (replayed, live)]
    assert set_fields[0] == set_fields[1]
    assert replayed.output[1].async_ is True
    assert "caller" not in replayed.to_input_items()[1]
