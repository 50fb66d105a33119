"""A real ``pydantic_ai.Agent`` run durably: killed with SIGKILL, resumed, counted.

The agent talks to ``FakeProvider`` on 127.0.0.1 through Pydantic AI's
``OpenAIChatModel`` and the official ``openai`` client. Each pass runs in its own
process (``pydantic_ai_child.py``); the fake counts billable generations by their
``Idempotency-Key`` and the tool counts its effects in a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pydantic_ai")

from pydantic_ai import RunContext  # the tools' annotations name it

from asiento import Phase, RunStatus, SqliteCheckpointer, idem_key
from asiento.proxy import create_app
from asiento.testing import ENV_VAR
from providers.fake_servers import Answer, AsgiServer, FakeProvider

CHILD = Path(__file__).with_name("pydantic_ai_child.py")
KILLED = -signal.SIGKILL
RUN = "refund-1"
SCRIPT = (Answer(calls=(("refund", {"order": "A1"}),)), Answer(text="refunded A1"))


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    with FakeProvider(SCRIPT) as p:
        yield p


def pass_argv(tmp_path: Path, base_url: str, *extra: str) -> list[str]:
    """The command line of one pass of run ``RUN`` (``pydantic_ai_child.py``)."""
    return [
        sys.executable, str(CHILD), str(tmp_path / "runs.db"), RUN, base_url,
        str(tmp_path / "effects.log"), *extra,
    ]  # fmt: skip


def pass_env(**extra: str) -> dict[str, str]:
    """This process's environment without a crash point, plus ``extra``."""
    return {k: v for k, v in os.environ.items() if k != ENV_VAR} | extra


def until(condition: Callable[[], object], child: subprocess.Popen[Any]) -> None:
    """Wait (30 s at most) until ``condition()`` holds or ``child`` has exited."""
    for _ in range(1500):
        if condition() or child.poll() is not None:
            return
        threading.Event().wait(0.02)


def run_pass(
    tmp_path: Path,
    base_url: str,
    *extra: str,
    crash_at: str | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any] | None:
    """One pass in a new process (``env``: more variables); its JSON outcome, or None
    when it was killed."""
    env = pass_env(**(env or {}), **({ENV_VAR: crash_at} if crash_at else {}))
    argv = pass_argv(tmp_path, base_url, *extra)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        assert proc.returncode == KILLED, proc.stderr
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def effects(tmp_path: Path) -> list[str]:
    log = tmp_path / "effects.log"
    return log.read_text().split() if log.exists() else []


def billed_per_step(provider: FakeProvider) -> Counter[str]:
    return Counter(key.split(":")[1] for key in provider.generations if key)


async def _status(db: Path) -> RunStatus:
    store = SqliteCheckpointer(db)
    try:
        info = await store.run(RUN)
        assert info is not None
        return info.status
    finally:
        await store.close()


@pytest.mark.parametrize("client", ["openai", "anthropic"])
def test_the_three_pass_count(provider: FakeProvider, tmp_path: Path, client: str) -> None:
    """Killed after the tool's result: model x1, tool x1; then model x1, tool x0; then x0.

    Through the official openai client (``OpenAIChatModel``) and anthropic client
    (``AnthropicModel``): the integration wraps whichever model the agent has."""
    extra = ("--anthropic",) if client == "anthropic" else ()
    assert run_pass(tmp_path, provider.openai_url, *extra, crash_at="after_result") is None
    assert provider.billed() == 1
    assert effects(tmp_path) == ["A1"]

    second = run_pass(tmp_path, provider.openai_url, *extra)
    assert second == {
        "ended": "closed", "output": "refunded A1", "model_calls": 1, "replayed": 1,
        "tool_calls": 0, "tools_replayed": 1,
    }  # fmt: skip
    assert provider.billed() == 2
    assert effects(tmp_path) == ["A1"]

    third = run_pass(tmp_path, provider.openai_url, *extra)
    assert third is not None
    assert third["ended"] == "already closed"
    assert third["output"] == "refunded A1"
    assert provider.billed() == 2
    assert billed_per_step(provider) == {"m1": 1, "m2": 1}
    path = "/v1/messages" if client == "anthropic" else "/v1/chat/completions"
    assert {r.path for r in provider.requests} == {path}
    assert provider.problems == []
    assert asyncio.run(_status(tmp_path / "runs.db")) is RunStatus.CLOSED


def test_every_request_carries_its_step_key(provider: FakeProvider, tmp_path: Path) -> None:
    """The Idempotency-Key is asiento's (run, step, request fingerprint), the same on resume."""
    assert run_pass(tmp_path, provider.openai_url, crash_at="inside_model_call") is None
    assert run_pass(tmp_path, provider.openai_url) is not None
    keys = [r.key for r in provider.requests]
    assert len(keys) == 3
    assert keys[0] == keys[1]  # m1 asked again after the kill: the very same key
    assert [k.split(":")[:2] for k in keys if k] == [[RUN, "m1"], [RUN, "m1"], [RUN, "m2"]]


def test_a_non_idempotent_tool_killed_before_its_result_is_uncertain(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """Killed between the tool's effect and its record: never run again, UncertainEffect."""
    assert run_pass(tmp_path, provider.openai_url, crash_at="after_tool") is None
    assert effects(tmp_path) == ["A1"]
    resumed = run_pass(tmp_path, provider.openai_url)
    assert resumed == {"ended": "uncertain", "step": "m1.t1"}
    assert effects(tmp_path) == ["A1"]
    assert provider.billed() == 1
    assert asyncio.run(_status(tmp_path / "runs.db")) is RunStatus.UNCERTAIN


def test_a_person_resolves_the_uncertain_tool_with_the_cli(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """``asiento resolve --happened`` on the framework's run: it goes on, the effect once."""
    assert run_pass(tmp_path, provider.openai_url, crash_at="after_tool") is None
    assert run_pass(tmp_path, provider.openai_url) == {"ended": "uncertain", "step": "m1.t1"}
    db = str(tmp_path / "runs.db")
    cli = [sys.executable, "-m", "asiento"]
    shown = subprocess.run(
        [*cli, "runs", "--store", db], capture_output=True, text=True, timeout=60, check=True
    )
    assert RUN in shown.stdout
    subprocess.run(
        [*cli, "resolve", RUN, "m1.t1", "--happened", "--by", "ops", "--store", db],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    resumed = run_pass(tmp_path, provider.openai_url)
    assert resumed is not None
    assert resumed["ended"] == "closed"
    assert effects(tmp_path) == ["A1"]
    assert billed_per_step(provider) == {"m1": 1, "m2": 1}


def test_an_idempotent_tool_killed_before_its_result_runs_again(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """Declared idempotent, the same kill re-runs the tool (a new attempt) and closes."""
    assert run_pass(tmp_path, provider.openai_url, "--idempotent", crash_at="after_tool") is None
    resumed = run_pass(tmp_path, provider.openai_url, "--idempotent")
    assert resumed is not None
    assert resumed["ended"] == "closed"
    assert resumed["tool_calls"] == 1
    assert effects(tmp_path) == ["A1", "A1"]


@pytest.mark.parametrize("client", ["openai", "anthropic"])
def test_a_crash_inside_a_model_call_through_the_gateway_is_billed_once(
    provider: FakeProvider, tmp_path: Path, client: str
) -> None:
    """Killed after the answer came, before it was recorded: ``asiento gateway`` keeps it."""
    extra = ("--anthropic",) if client == "anthropic" else ()
    app = create_app(provider.openai_url, db=tmp_path / "keys.db")
    with AsgiServer(app) as gateway:
        url = gateway.url + "/v1"
        assert run_pass(tmp_path, url, *extra, crash_at="inside_model_call") is None
        resumed = run_pass(tmp_path, url, *extra)
    assert resumed is not None
    assert resumed["ended"] == "closed"
    assert billed_per_step(provider) == {"m1": 1, "m2": 1}


def test_without_the_gateway_the_same_crash_pays_twice(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """The negative control of the test above: direct to the provider, m1 is paid again."""
    assert run_pass(tmp_path, provider.openai_url, crash_at="inside_model_call") is None
    assert run_pass(tmp_path, provider.openai_url) is not None
    assert billed_per_step(provider) == {"m1": 2, "m2": 1}


def test_changed_instructions_are_a_divergence(provider: FakeProvider, tmp_path: Path) -> None:
    """Resumed with other instructions, the recorded m1 was asked something else."""
    assert run_pass(tmp_path, provider.openai_url, crash_at="after_result") is None
    changed = run_pass(tmp_path, provider.openai_url, "--instructions", "Refund nothing.")
    assert changed == {"ended": "divergence", "step": "m1"}
    assert provider.billed() == 1
    assert effects(tmp_path) == ["A1"]


PARALLEL = (
    Answer(calls=(("refund", {"order": "A1"}), ("refund", {"order": "B2"}))),
    Answer(text="refunded both"),
)


def test_parallel_tool_calls_killed_mid_way_keep_their_ids_and_run_once(tmp_path: Path) -> None:
    """Two calls in one answer run concurrently; killed after the first result, whichever
    it was: the ids come from the answer, a call left in flight is uncertain (a person
    says what happened), and in the end each refund happened exactly once."""
    prompt = ("--prompt", "refund A1 and B2")
    with FakeProvider(PARALLEL) as provider:
        url = provider.openai_url
        assert run_pass(tmp_path, url, *prompt, crash_at="after_result") is None
        resumed = run_pass(tmp_path, url, *prompt)
        assert resumed is not None
        if resumed["ended"] == "uncertain":  # the other call was submitted when it died
            step = resumed["step"]
            order = asyncio.run(_intent(tmp_path / "runs.db", step))["order"]
            found = "--happened" if order in effects(tmp_path) else "--not-happened"
            db = str(tmp_path / "runs.db")
            subprocess.run(
                [sys.executable, "-m", "asiento", "resolve", RUN, step, found, "--by", "ops",
                 "--store", db],
                capture_output=True, text=True, timeout=60, check=True,
            )  # fmt: skip
            resumed = run_pass(tmp_path, url, *prompt)
            assert resumed is not None
        assert resumed["ended"] == "closed"
        assert billed_per_step(provider) == {"m1": 1, "m2": 1}
    assert sorted(effects(tmp_path)) == ["A1", "B2"]
    assert asyncio.run(_intent(tmp_path / "runs.db", "m1.t1")) == {"order": "A1"}
    assert asyncio.run(_intent(tmp_path / "runs.db", "m1.t2")) == {"order": "B2"}


def test_an_uncertain_call_lets_its_running_sibling_finish_and_record(tmp_path: Path) -> None:
    """Resumed, the refund is uncertain while its sibling (a slow lookup) runs: the pass
    stops only once the lookup has ended and its result is recorded, never cutting it
    mid-way (a payment cut there would be one more uncertain step)."""
    script = (
        Answer(calls=(("refund", {"order": "A1"}), ("lookup", {"order": "B2"}))),
        Answer(text="done"),
    )
    extra = ("--prompt", "refund A1, look up B2", "--slow-lookup", "0.5")
    with FakeProvider(script) as provider:
        url = provider.openai_url
        assert run_pass(tmp_path, url, *extra, crash_at="after_tool") is None  # the refund's
        assert effects(tmp_path) == ["A1"]
        resumed = run_pass(tmp_path, url, *extra)
        assert resumed == {"ended": "uncertain", "step": "m1.t1"}
    lookups = (tmp_path / "effects.log.lookup").read_text().splitlines()
    assert lookups == ["start B2", "start B2", "done B2"]  # pass 1's was cut by the kill
    store_events = asyncio.run(_phases(tmp_path / "runs.db", "m1.t2"))
    assert "result" in store_events  # recorded before the pass stopped
    assert effects(tmp_path) == ["A1"]


async def _phases(db: Path, step_id: str) -> list[str]:
    store = SqliteCheckpointer(db)
    try:
        return [e.phase.value for e in await store.load(RUN) if e.step_id.startswith(step_id)]
    finally:
        await store.close()


async def _intent(db: Path, step_id: str) -> dict[str, Any]:
    store = SqliteCheckpointer(db)
    try:
        events = await store.load_step(RUN, step_id)
    finally:
        await store.close()
    return dict(next(e.payload["args"] for e in events if e.phase.value == "intent"))


# -- Pydantic AI's approvals, as asiento approvals ------------------------------------------


def asiento_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asiento", *args], capture_output=True, text=True, timeout=60,
        check=True,
    )  # fmt: skip


def test_requires_approval_waits_for_the_cli_then_runs_exactly_once(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """A ``requires_approval`` tool is an asiento step awaiting approval: suspended, shown
    by ``asiento show``, approved with ``asiento approve``, run once, closed once."""
    db = str(tmp_path / "runs.db")
    first = run_pass(tmp_path, provider.openai_url, "--approval")
    assert first == {"ended": "awaiting", "steps": ["m1.t1"], "model_calls": 1}
    assert effects(tmp_path) == []
    assert asyncio.run(_status(tmp_path / "runs.db")) is RunStatus.SUSPENDED
    again = run_pass(tmp_path, provider.openai_url, "--approval")  # nobody decided yet
    assert again == {"ended": "awaiting", "steps": ["m1.t1"], "model_calls": 0}
    assert "m1.t1" in asiento_cli("show", RUN, "--store", db).stdout
    asiento_cli("approve", RUN, "m1.t1", "--by", "ops", "--store", db)
    approved = run_pass(tmp_path, provider.openai_url, "--approval")
    assert approved is not None
    assert approved["ended"] == "closed"
    assert approved["tool_calls"] == 1
    assert effects(tmp_path) == ["A1"]
    closed = run_pass(tmp_path, provider.openai_url, "--approval")
    assert closed is not None
    assert closed["ended"] == "already closed"
    assert effects(tmp_path) == ["A1"]
    assert billed_per_step(provider) == {"m1": 1, "m2": 1}


def test_an_approved_tool_killed_before_its_result_is_not_run_again_on_the_approval(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """The approval approves one run of the tool: a crash after it ran is uncertain, the
    approval is not re-used as a flag for a second run (pydantic-ai#5536)."""
    db = str(tmp_path / "runs.db")
    assert run_pass(tmp_path, provider.openai_url, "--approval") is not None
    asiento_cli("approve", RUN, "m1.t1", "--by", "ops", "--store", db)
    assert run_pass(tmp_path, provider.openai_url, "--approval", crash_at="after_tool") is None
    resumed = run_pass(tmp_path, provider.openai_url, "--approval")
    assert resumed == {"ended": "uncertain", "step": "m1.t1"}
    assert effects(tmp_path) == ["A1"]


def test_a_denied_tool_never_runs_and_the_model_is_told(
    provider: FakeProvider, tmp_path: Path
) -> None:
    db = str(tmp_path / "runs.db")
    assert run_pass(tmp_path, provider.openai_url, "--approval") is not None
    asiento_cli("deny", RUN, "m1.t1", "--by", "ops", "--reason", "not this one", "--store", db)
    resumed = run_pass(tmp_path, provider.openai_url, "--approval")
    assert resumed is not None
    assert resumed["ended"] == "closed"
    assert effects(tmp_path) == []
    told = json.dumps(provider.requests[-1].body["messages"])
    assert "not this one" in told


def test_the_refund_example_runs_and_prints_what_it_measured() -> None:
    """examples/integrations/pydantic_ai_refund.py: the three-pass count, one refund."""
    example = Path(__file__).resolve().parents[2] / "examples/integrations/pydantic_ai_refund.py"
    proc = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=300, check=True
    )
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert rows[1][:3] == ["1", "1", "1"]
    assert " ".join(rows[1][3:]) == "killed by SIGKILL"
    assert rows[2] == ["2", "1", "0", "closed"]
    assert rows[3] == ["3", "0", "0", "already", "closed"]
    assert "generations billed: 2" in proc.stdout
    assert "refunds made: 1" in proc.stdout


# -- in one process: divergence on other tools --------------------------------------


@pytest.fixture
async def client(provider: FakeProvider) -> AsyncIterator[Any]:
    """The official client on the fake provider, closed after the test."""
    import openai

    async with openai.AsyncOpenAI(base_url=provider.openai_url, api_key="sk-test") as c:
        yield c


def _agent(client: Any, **options: Any) -> Any:
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("gpt-test", provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, output_type=[str, DeferredToolRequests], **options)

    @agent.tool_plain(requires_approval=True)
    def refund(order: str) -> str:
        """Refund an order."""
        return f"refunded {order}"

    return agent


async def test_other_tools_on_resume_are_a_divergence(
    provider: FakeProvider, client: Any, tmp_path: Path
) -> None:
    """Suspended on an approval, resumed by an agent with one more tool: ReplayDivergence
    at m1, and the model is not asked again."""
    from asiento import ReplayDivergence
    from asiento.integrations.pydantic_ai import durable_run

    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        first = await durable_run(_agent(client), "refund A1", run_id=RUN, store=store)
        assert first.awaiting == ("m1.t1",)
        changed = _agent(client)

        @changed.tool_plain
        def lookup(order: str) -> str:
            """Look an order up."""
            return order

        with pytest.raises(ReplayDivergence) as caught:
            await durable_run(changed, "refund A1", run_id=RUN, store=store)
        assert caught.value.step_id == "m1"
        assert "new: 'lookup'" in str(caught.value)
        assert provider.billed() == 1
    finally:
        await store.close()


# -- MCP toolsets: the MCP table decides idempotency ----------------------------------------

MCP_SERVER = Path(__file__).resolve().parents[1] / "mcp_tools" / "server.py"
LOOKUP = (Answer(calls=(("lookup", {"city": "Paris"}),)), Answer(text="sunny"))


def lookups(tmp_path: Path) -> int:
    log = tmp_path / "effects.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(1 for line in lines if line.startswith("lookup "))


@pytest.mark.parametrize(
    ("trusted", "ended", "runs"), [(True, "closed", 2), (False, "uncertain", 1)],
    ids=["trusted-read-only-reruns", "untrusted-is-uncertain"],
)  # fmt: skip
def test_an_mcp_tool_killed_before_its_result_follows_the_mcp_table(
    tmp_path: Path, trusted: bool, ended: str, runs: int
) -> None:
    """A read-only MCP tool (pydantic-ai's MCPServerStdio, a real mcp SDK server) killed
    after it ran: re-run when its server is trusted, UncertainEffect when it is not."""
    options = ("--mcp", str(MCP_SERVER), "--prompt", "weather in Paris")
    options += ("--trusted",) if trusted else ()
    with FakeProvider(LOOKUP) as provider:
        assert run_pass(tmp_path, provider.openai_url, *options, crash_at="after_tool") is None
        assert lookups(tmp_path) == 1
        resumed = run_pass(tmp_path, provider.openai_url, *options)
    assert resumed is not None
    assert resumed["ended"] == ended
    assert lookups(tmp_path) == runs
    # Every call carried the step's key, the very same on the resumed call.
    sent = [line.split()[1] for line in ledger(tmp_path) if line.startswith("lookup ")]
    assert sent == [idem_key(RUN, "m1.t1", {"city": "Paris"})] * runs


def test_an_mcp_result_that_is_not_mcp_is_an_asiento_error_and_the_step_stays_submitted(
    tmp_path: Path,
) -> None:
    """The server applies the call, then answers a result no client can read: Pydantic AI
    would hand the model its ValidationError as if the arguments were wrong and go on,
    the step left submitted under a closed run. The pass stops with ToolAnswerLost naming
    the toolset and the tool; the resume follows the replay table (untrusted: uncertain)."""
    options = ("--mcp", str(MCP_SERVER), "--prompt", "weather in Paris")
    hostile = {"MCP_MALFORMED": "lookup"}
    with FakeProvider(LOOKUP) as provider:
        first = run_pass(tmp_path, provider.openai_url, *options, env=hostile)
        assert first is not None
        assert first["ended"] == "ToolAnswerLost"
        assert "MCP toolset 'notes'" in first["why"]
        assert "tool 'lookup'" in first["why"]
        assert "validation error" in first["why"]
        resumed = run_pass(tmp_path, provider.openai_url, *options, env=hostile)
        assert resumed == {"ended": "uncertain", "step": "m1.t1"}
        assert provider.billed() == 1  # the model was never told anything
    assert lookups(tmp_path) == 1


async def test_a_validation_error_of_a_tool_is_a_recorded_retry(tmp_path: Path) -> None:
    """A function tool whose own code raises pydantic's ValidationError: Pydantic AI tells
    the model to retry; the step records that retry (it was left without an outcome),
    so the run that closed has every step settled."""
    import openai
    import pydantic
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from asiento.integrations.pydantic_ai import durable_run

    class Order(pydantic.BaseModel):
        amount: int

    script = (Answer(calls=(("check", {"raw": "lots"}),)), Answer(text="told"))
    with FakeProvider(script) as provider:
        async with openai.AsyncOpenAI(base_url=provider.openai_url, api_key="sk") as client:
            model = OpenAIChatModel("gpt-test", provider=OpenAIProvider(openai_client=client))
            agent = Agent(model)

            @agent.tool_plain
            def check(raw: str) -> int:
                """Check an order."""
                return Order.model_validate({"amount": raw}).amount

            store = SqliteCheckpointer(tmp_path / "runs.db")
            try:
                done = await durable_run(agent, "check", run_id=RUN, store=store)
                events = await store.load(RUN)
            finally:
                await store.close()
    assert done.output == "told"
    [result] = [e for e in events if e.step_id == "m1.t1" and e.phase is Phase.RESULT]
    assert result.payload["status"] == "error"
    assert "validation error" in result.payload["error"]


# -- MCP toolsets whose servers deduplicate by the key: reconcile, not UncertainEffect ----

TRANSFER = (Answer(calls=(("bank_transfer", {"amount": 5}),)), Answer(text="moved it"))


def ledger(tmp_path: Path) -> list[str]:
    log = tmp_path / "effects.log"
    return log.read_text().splitlines() if log.exists() else []


def transfers(tmp_path: Path) -> list[str]:
    return [line for line in ledger(tmp_path) if line.startswith("transfer ")]


async def _recorded(db: Path, step_id: str) -> dict[Phase, Any]:
    store = SqliteCheckpointer(db)
    try:
        return {e.phase: e.payload for e in await store.load(RUN) if e.step_id == step_id}
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("declared", "why"),
    [(None, "is not declared to deduplicate by key"), ("0", "idempotency key is")],
    ids=["not-declared-is-uncertain", "expired-key-is-uncertain"],
)
def test_an_mcp_call_killed_before_its_result_is_uncertain_unless_its_key_is_honoured(
    tmp_path: Path, declared: str | None, why: str
) -> None:
    """A non-idempotent MCP tool (behind a prefixed toolset) killed after the server did
    it: on a toolset not declared to honour keys, or whose key has expired (TTL 0), the
    resumed run raises UncertainEffect naming why, and nothing is called again."""
    options = ("--mcp", str(MCP_SERVER), "--prefix", "bank", "--prompt", "move 5", "--why")
    options += () if declared is None else ("--honours", declared)
    with FakeProvider(TRANSFER) as provider:
        assert run_pass(tmp_path, provider.openai_url, *options, crash_at="after_tool") is None
        resumed = run_pass(tmp_path, provider.openai_url, *options)
    assert resumed is not None
    assert resumed["ended"] == "uncertain"
    assert resumed["step"] == "m1.t1"
    assert why in resumed["why"]
    assert len(transfers(tmp_path)) == 1


def test_a_declared_key_honouring_mcp_call_killed_before_its_result_is_reconciled(
    tmp_path: Path,
) -> None:
    """The same crash on a toolset declared ``honours_keys``: the resumed run asks the
    server again under the same key, the server answers from its record (the transfer
    happened once), and that answer is the step's outcome: the run closes."""
    options = ("--mcp", str(MCP_SERVER), "--prefix", "bank", "--prompt", "move 5", "--why")
    options += ("--honours", "3600", "--hook", "--spans", str(tmp_path / "spans.jsonl"))
    with FakeProvider(TRANSFER) as provider:
        assert run_pass(tmp_path, provider.openai_url, *options, crash_at="after_tool") is None
        resumed = run_pass(tmp_path, provider.openai_url, *options)
        assert resumed is not None
        assert resumed["ended"] == "closed", resumed
        assert (resumed["tool_calls"], resumed["tools_replayed"]) == (0, 1)
        told = json.dumps(provider.requests[-1].body)
    key = idem_key(RUN, "m1.t1", {"amount": 5})
    assert transfers(tmp_path) == [f'transfer {key} tag=from-hook {{"amount": 5}}']
    records = asyncio.run(_recorded(tmp_path / "runs.db", "m1.t1"))
    assert records[Phase.INTENT]["idem_key"] == key  # what ``asiento show`` displays
    assert records[Phase.RESULT]["value"] == "moved 5"
    assert "moved 5" in told  # the model was handed the server's recorded answer
    # The user's own hook ran on the first call and on the reconcile (its _meta merged).
    assert (tmp_path / "effects.log.hook").read_text().split() == ["transfer", "transfer"]
    # Traced: the first call's span (applied), then the call sent again, a span of its own
    # (not the first's id) saying the server answered from its record.
    from asiento.testing._files import read_lines

    tools = [
        (s["context"]["span_id"], s["attributes"])
        for s in read_lines(tmp_path / "spans.jsonl")
        if s["name"] == "execute_tool bank_transfer"
    ]
    assert [(a["asiento.step.id"], a["asiento.outcome"]) for _, a in tools] == [
        ("m1.t1", "applied"),
        ("m1.t1", "reconciled"),
    ]
    assert [a.get("asiento.resent") for _, a in tools] == [None, True]
    assert tools[0][0] != tools[1][0]


def test_the_users_process_tool_call_hook_runs_and_its_metadata_is_merged(
    tmp_path: Path,
) -> None:
    """A toolset with its own ``process_tool_call``: the hook runs, and the server gets
    the hook's ``_meta`` and the step's key in one request."""
    options = ("--mcp", str(MCP_SERVER), "--prefix", "bank", "--prompt", "move 5", "--hook")
    with FakeProvider(TRANSFER) as provider:
        done = run_pass(tmp_path, provider.openai_url, *options)
    assert done is not None
    assert done["ended"] == "closed"
    key = idem_key(RUN, "m1.t1", {"amount": 5})
    assert transfers(tmp_path) == [f'transfer {key} tag=from-hook {{"amount": 5}}']
    assert (tmp_path / "effects.log.hook").read_text().split() == ["transfer"]


# -- structured output and message history, as Pydantic AI documents them --------------------


async def test_structured_output_is_handed_back_typed_by_a_closed_run(tmp_path: Path) -> None:
    """``output_type`` a pydantic model: the run's output, and the closed run's, are one."""
    import openai
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, UserPromptPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from asiento.integrations.pydantic_ai import durable_run

    class Refund(BaseModel):
        order: str
        amount: int

    # The fake answers turn N (assistant turns in the request): the history holds one.
    script = (
        Answer(text="unused"),
        Answer(calls=(("final_result", {"order": "A1", "amount": 5}),)),
    )
    earlier = [
        ModelRequest(parts=[UserPromptPart("hello")]),
        ModelResponse(parts=[TextPart("hello, how can I help?")]),
    ]
    store = SqliteCheckpointer(tmp_path / "runs.db")
    with FakeProvider(script) as provider:
        async with openai.AsyncOpenAI(base_url=provider.openai_url, api_key="sk") as client:
            model = OpenAIChatModel("gpt-test", provider=OpenAIProvider(openai_client=client))
            agent = Agent(model, output_type=Refund)
            try:
                first = await durable_run(
                    agent, "refund A1", run_id=RUN, store=store, message_history=earlier
                )
                again = await durable_run(
                    agent, "refund A1", run_id=RUN, store=store, message_history=earlier
                )
            finally:
                await store.close()
        asked = json.dumps(provider.requests[0].body["messages"])
    assert first.output == Refund(order="A1", amount=5)
    assert again.replayed
    assert again.output == first.output
    assert isinstance(again.output, Refund)
    assert "how can I help" in asked  # the history was sent as the framework sends it
    assert [type(m).__name__ for m in again.messages] == [type(m).__name__ for m in first.messages]
    assert provider.billed() == 1


def test_the_overhead_bench_runs_and_counts_its_records(tmp_path: Path) -> None:
    """bench/pydantic_ai_overhead.py --quick: both modes ran; six records per durable run
    (its times are figures, not checks)."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "pydantic_ai_overhead.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--quick", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[1:3]}
    assert rows["pydantic-ai"][1] == "20"
    assert rows["asiento"][1:2] == ["20"]
    assert rows["asiento"][3:] == ["3", "6"]
    assert "overhead per step:" in done.stdout


# -- asiento's workers drive Pydantic AI runs -------------------------------------------------


async def test_a_worker_drives_a_submitted_run_and_one_suspended_on_an_approval(
    provider: FakeProvider, client: Any, tmp_path: Path
) -> None:
    """``App(agents={...: WorkerAgent(agent)})``: a submitted run is claimed and closed; a run
    a worker left suspended is approved with the CLI and closed by the next claim."""
    from asiento.gateways.scripted import ScriptedGateway
    from asiento.integrations.pydantic_ai import WorkerAgent
    from asiento.worker import App, Worker, submit

    agent = _agent(client)
    app = App(agents={"refunds": WorkerAgent(agent)}, gateway=ScriptedGateway([]), lease_ttl=5)
    db = tmp_path / "runs.db"
    store = SqliteCheckpointer(db)
    try:
        await submit(store, RUN, "refund A1", agent="refunds")
        first = Worker(store, app, poll=0.05)
        await first.run(until_idle=True, max_seconds=60)
        assert (first.stats.claimed, first.stats.suspended) == (1, 1)
        assert (await store.run(RUN)).status is RunStatus.SUSPENDED  # type: ignore[union-attr]
        await asyncio.to_thread(
            asiento_cli, "approve", RUN, "m1.t1", "--by", "ops", "--store", str(db)
        )
        second = Worker(store, app, poll=0.05)
        await second.run(until_idle=True, max_seconds=60)
        assert (second.stats.claimed, second.stats.closed) == (1, 1)
        assert (await store.run(RUN)).status is RunStatus.CLOSED  # type: ignore[union-attr]
    finally:
        await store.close()
    assert billed_per_step(provider) == {"m1": 1, "m2": 1}


RETRIED = (
    Answer(calls=(("refund", {"order": "A1"}),)),
    Answer(calls=(("refund", {"order": "A1"}),)),
    Answer(text="refunded A1"),
)


def test_a_model_retry_is_recorded_and_replayed_as_one(tmp_path: Path) -> None:
    """The tool's ModelRetry is m1.t1's recorded outcome: the resume replays it (the retry
    prompt is the same, so m2 is replayed too), and the refund happened once."""
    with FakeProvider(RETRIED) as provider:
        url = provider.openai_url
        assert run_pass(tmp_path, url, "--retry-once", crash_at="after_result") is None
        assert effects(tmp_path) == ["retried", "A1"]
        resumed = run_pass(tmp_path, url, "--retry-once")
        assert resumed is not None
        assert (resumed["ended"], resumed["replayed"], resumed["tools_replayed"]) == (
            "closed",
            2,
            2,
        )
        assert billed_per_step(provider) == {"m1": 1, "m2": 1, "m3": 1}
    assert effects(tmp_path) == ["retried", "A1"]


async def test_an_abandoned_run_does_nothing_when_resumed(
    provider: FakeProvider, client: Any, tmp_path: Path
) -> None:
    """``asiento abandon`` on a suspended Pydantic AI run: resuming it runs nothing."""
    from asiento.integrations.pydantic_ai import durable_run

    db = tmp_path / "runs.db"
    store = SqliteCheckpointer(db)
    try:
        first = await durable_run(_agent(client), "refund A1", run_id=RUN, store=store)
        assert first.awaiting == ("m1.t1",)
        await asyncio.to_thread(
            asiento_cli,
            "abandon",
            RUN,
            "--by",
            "ops",
            "--reason",
            "wrong order",
            "--store",
            str(db),
        )
        resumed = await durable_run(_agent(client), "refund A1", run_id=RUN, store=store)
    finally:
        await store.close()
    assert (resumed.abandoned, resumed.replayed, resumed.output) == (True, True, None)
    assert provider.billed() == 1


async def test_a_run_abandoned_while_its_tool_runs_stops_with_run_abandoned(
    provider: FakeProvider, client: Any, tmp_path: Path
) -> None:
    """A person abandons the run while its tool runs: the pass cannot record the result
    and stops with RunAbandoned; resuming it runs nothing."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from asiento import RunAbandoned
    from asiento.integrations.pydantic_ai import durable_run

    db = tmp_path / "runs.db"
    model = OpenAIChatModel("gpt-test", provider=OpenAIProvider(openai_client=client))
    agent = Agent(model)

    @agent.tool_plain
    def refund(order: str) -> str:
        """Refund an order (a person abandons the run meanwhile)."""
        asiento_cli("abandon", RUN, "--by", "ops", "--reason", "stop", "--store", str(db))
        return f"refunded {order}"

    store = SqliteCheckpointer(db)
    try:
        with pytest.raises(RunAbandoned):
            await durable_run(agent, "refund A1", run_id=RUN, store=store)
        resumed = await durable_run(agent, "refund A1", run_id=RUN, store=store)
    finally:
        await store.close()
    assert resumed.abandoned
    assert provider.billed() == 1


async def test_a_requested_shutdown_stops_between_steps_and_the_run_resumes(
    provider: FakeProvider, client: Any, tmp_path: Path
) -> None:
    """``asiento.shutdown.request()`` (a worker's SIGTERM) while the tool runs: the pass
    records its result and stops before m2; the next pass finishes from the journal."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from asiento import shutdown
    from asiento.integrations.pydantic_ai import durable_run

    model = OpenAIChatModel("gpt-test", provider=OpenAIProvider(openai_client=client))
    agent = Agent(model)
    ran: list[str] = []

    @agent.tool_plain
    def refund(order: str) -> str:
        """Refund an order (a shutdown is requested meanwhile)."""
        ran.append(order)
        shutdown.request()
        return f"refunded {order}"

    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        with pytest.raises(shutdown.ShutdownRequested, match="before m2"):
            await durable_run(agent, "refund A1", run_id=RUN, store=store)
        shutdown.reset()
        resumed = await durable_run(agent, "refund A1", run_id=RUN, store=store)
    finally:
        shutdown.reset()
        await store.close()
    assert resumed.output == "refunded A1"
    assert (resumed.stats.tool_calls_replayed, ran) == (1, ["A1"])
    assert billed_per_step(provider) == {"m1": 1, "m2": 1}


async def test_runs_sharing_one_agent_each_send_their_own_key(tmp_path: Path) -> None:
    """Three runs of one agent at once, its MCP toolset nested (filtered, prefixed) and
    with a hook of its own: each call carries its own run's key, and the agent's
    toolset is left as it was (the key travels in a contextvar, not in the toolset)."""
    import openai
    from fastmcp.client.transports import StdioTransport
    from pydantic_ai import Agent
    from pydantic_ai.mcp import MCPToolset
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from asiento.integrations.pydantic_ai import durable_run

    async def hook(ctx: Any, call_tool: Any, name: str, tool_args: dict[str, Any]) -> Any:
        return await call_tool(name, tool_args, metadata={"test/tag": "shared"})

    env = {**os.environ, "MCP_LEDGER": str(tmp_path / "effects.log")}
    env["MCP_DEDUP"] = str(tmp_path / "keys.db")
    server = StdioTransport(command=sys.executable, args=[str(MCP_SERVER), "stdio"], env=env)
    mcp = MCPToolset(server, id="notes", process_tool_call=hook)
    nested = mcp.prefixed("bank").filtered(lambda ctx, tool: tool.name == "bank_transfer")
    store = SqliteCheckpointer(tmp_path / "runs.db")
    runs = ["r1", "r2", "r3"]
    with FakeProvider(TRANSFER) as provider:
        async with openai.AsyncOpenAI(base_url=provider.openai_url, api_key="sk") as client:
            model = OpenAIChatModel("gpt-test", provider=OpenAIProvider(openai_client=client))
            agent = Agent(model, toolsets=[nested])
            try:
                async with agent:  # one MCP session, shared by the runs
                    done = await asyncio.gather(
                        *(durable_run(agent, "move 5", run_id=r, store=store) for r in runs)
                    )
            finally:
                await store.close()
    assert [d.output for d in done] == ["moved it"] * 3
    sent = sorted(transfers(tmp_path))
    expected = sorted(
        f'transfer {idem_key(r, "m1.t1", {"amount": 5})} tag=shared {{"amount": 5}}' for r in runs
    )
    assert sent == expected
    assert mcp.process_tool_call is hook


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_a_server_that_died_during_the_call_is_uncertain_even_when_declared(
    tmp_path: Path,
) -> None:
    """The agent and its MCP server killed while the server runs the call: the server
    cannot know the call's outcome and says so (``asiento/outcome: unknown``); the
    declared toolset's resume raises UncertainEffect naming that, and nothing runs again."""
    options = ("--mcp", str(MCP_SERVER), "--prefix", "bank", "--prompt", "move 5", "--why")
    options += ("--honours", "3600")
    env = pass_env(MCP_HOLD="transfer", MCP_GATE=str(tmp_path / "never"))
    with FakeProvider(TRANSFER) as provider:
        argv = pass_argv(tmp_path, provider.openai_url, *options)
        errors = (tmp_path / "stderr").open("w")
        child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=errors)
        try:
            until(lambda: transfers(tmp_path), child)  # the server applied it and holds it
            assert transfers(tmp_path), (tmp_path / "stderr").read_text()
            for pid in _children(child.pid):
                os.kill(pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait(timeout=30)
            errors.close()
        resumed = run_pass(tmp_path, provider.openai_url, *options)
    assert resumed is not None
    assert resumed["ended"] == "uncertain", resumed
    assert "cannot know the outcome of the first call" in resumed["why"]
    assert len(transfers(tmp_path)) == 1


def test_a_hook_that_sends_a_key_of_its_own_is_a_usage_error(tmp_path: Path) -> None:
    """The user's ``process_tool_call`` hook puts another key under
    ``_meta["asiento/idempotency-key"]``: a UsageError naming the hook and both keys,
    and the call is never sent (the server saw no call, the transfer never ran)."""
    options = ("--mcp", str(MCP_SERVER), "--prefix", "bank", "--prompt", "move 5")
    options += ("--hook", "--hook-key", "mine-1")
    with FakeProvider(TRANSFER) as provider:
        done = run_pass(
            tmp_path, provider.openai_url, *options, env={"MCP_SEEN": str(tmp_path / "seen")}
        )
    assert done is not None  # not killed; run_pass asserts any other failure
    assert done["ended"] == "UsageError", done
    key = idem_key(RUN, "m1.t1", {"amount": 5})
    assert "process_tool_call hook" in done["why"]
    assert "'mine-1'" in done["why"]
    assert repr(key) in done["why"]
    assert (tmp_path / "effects.log.hook").read_text().split() == ["transfer"]  # it ran
    assert not (tmp_path / "seen").exists()  # and no call reached the server
    assert transfers(tmp_path) == []


async def _call_transfer(tmp_path: Path, key: str, amount: int) -> Any:
    """A transfer under ``key`` from a client of the test's own, on the run's server."""
    from fastmcp import Client
    from fastmcp.client.transports import StdioTransport

    env = {**os.environ, "MCP_LEDGER": str(tmp_path / "effects.log")}
    env["MCP_DEDUP"] = str(tmp_path / "effects.log.keys")  # the child's server's key file
    server = StdioTransport(command=sys.executable, args=[str(MCP_SERVER), "stdio"], env=env)
    async with Client(server) as client:
        return await client.call_tool(
            "transfer", {"amount": amount}, meta={"asiento/idempotency-key": key}
        )


def test_a_reconcile_the_server_answers_conflict_is_an_idempotency_key_conflict(
    tmp_path: Path,
) -> None:
    """Killed after the step was submitted, before its call was sent; meanwhile the
    step's key was used on the server for another transfer (other arguments). The
    reconcile gets ``asiento/outcome: conflict``: IdempotencyKeyConflict, and the
    step's own transfer is not made."""
    options = ("--mcp", str(MCP_SERVER), "--prefix", "bank", "--prompt", "move 5")
    options += ("--honours", "3600")
    key = idem_key(RUN, "m1.t1", {"amount": 5})
    with FakeProvider(TRANSFER) as provider:
        crashed = run_pass(tmp_path, provider.openai_url, *options, crash_at="after_submitted")
        assert crashed is None
        assert transfers(tmp_path) == []
        other = asyncio.run(_call_transfer(tmp_path, key, 7))
        assert not other.is_error
        resumed = run_pass(tmp_path, provider.openai_url, *options)
    assert resumed is not None
    assert resumed["ended"] == "IdempotencyKeyConflict", resumed
    assert "first used with other arguments" in resumed["why"]
    assert repr(key) in resumed["why"]
    assert transfers(tmp_path) == [f'transfer {key} {{"amount": 7}}']  # only the other one
    records = asyncio.run(_recorded(tmp_path / "runs.db", "m1.t1"))
    assert Phase.RESULT not in records  # nothing settled: a person must look


def test_a_reconcile_waits_while_the_first_call_still_runs_then_takes_its_answer(
    tmp_path: Path,
) -> None:
    """The agent killed while its server still runs the transfer (the server goes on):
    the resumed run's reconcile hears ``in-progress``, polls, and once the first call
    finishes takes the server's recorded answer; the transfer happened once."""
    options = ("--mcp", str(MCP_SERVER), "--prefix", "bank", "--prompt", "move 5")
    options += ("--honours", "3600")
    gate, seen = tmp_path / "gate", tmp_path / "seen"
    env = pass_env(MCP_HOLD="transfer", MCP_GATE=str(gate), MCP_SEEN=str(seen))
    key = idem_key(RUN, "m1.t1", {"amount": 5})
    servers: list[int] = []
    with FakeProvider(TRANSFER) as provider:
        argv = pass_argv(tmp_path, provider.openai_url, *options)
        errors = (tmp_path / "stderr").open("w")
        first = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=errors)
        resumed: subprocess.Popen[str] | None = None
        try:
            until(lambda: transfers(tmp_path), first)  # the server applied it and holds it
            assert transfers(tmp_path), (tmp_path / "stderr").read_text()
            servers = _children(first.pid)
            first.kill()  # the agent only: its server goes on with the transfer
            first.wait(timeout=30)
            resumed = subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=errors, text=True
            )
            waiting = f"transfer {key} in-progress"

            def answered() -> list[str]:
                return seen.read_text().splitlines() if seen.exists() else []

            until(lambda: waiting in answered(), resumed)  # the server said in-progress
            assert waiting in answered(), (tmp_path / "stderr").read_text()
            gate.touch()  # the first call finishes
            out, _ = resumed.communicate(timeout=60)
        finally:
            for process in (first, resumed):
                if process is not None and process.poll() is None:
                    process.kill()
                    process.wait(timeout=30)
            for pid in servers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            errors.close()
        told = json.dumps(provider.requests[-1].body)
    assert resumed.returncode == 0, (tmp_path / "stderr").read_text()
    done = json.loads(out.strip().splitlines()[-1])
    assert done["ended"] == "closed", done
    assert (done["tool_calls"], done["tools_replayed"]) == (0, 1)
    assert transfers(tmp_path) == [f'transfer {key} {{"amount": 5}}']
    answers = seen.read_text().splitlines()  # asked again until the server had the result
    assert answers[0] == waiting
    assert answers[-1] == f"transfer {key} -"
    records = asyncio.run(_recorded(tmp_path / "runs.db", "m1.t1"))
    assert records[Phase.RESULT]["value"] == "moved 5"
    assert "moved 5" in told


async def test_a_tool_that_asks_for_approval_itself_is_refused_never_approved_unasked(
    provider: FakeProvider, client: Any, tmp_path: Path
) -> None:
    """A tool that raises ``ApprovalRequired`` itself did nothing: its step is recorded as
    not having happened, and the run stops with a UsageError saying how to declare the
    approval, every pass; never the approved call run without a person. (The branch that
    recorded it could not be reached: the step was left submitted with no outcome and
    the next pass stopped as uncertain; recorded, Pydantic AI's approved re-call ran.)"""
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.exceptions import ApprovalRequired
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from asiento import UsageError
    from asiento.integrations.pydantic_ai import durable_run

    refunds: list[str] = []
    model = OpenAIChatModel("gpt-test", provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, output_type=[str, DeferredToolRequests])

    @agent.tool
    def refund(ctx: RunContext[None], order: str) -> str:
        """Refund an order (a person agrees first)."""
        if not ctx.tool_call_approved:
            raise ApprovalRequired
        refunds.append(order)
        return f"refunded {order}"

    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        for _ in range(2):
            with pytest.raises(UsageError, match=r"tool 'refund' asked for approval itself"):
                await durable_run(agent, "refund A1", run_id=RUN, store=store)
            records = [(e.step_id, e.phase) for e in await store.load(RUN)]
            assert ("m1.t1", Phase.RESOLUTION) in records  # it did not happen
            assert refunds == []
    finally:
        await store.close()
    assert billed_per_step(provider) == {"m1": 1}  # the second pass replayed m1
