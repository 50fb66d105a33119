"""Tool-call arguments JSON cannot carry (``NaN``, ``Infinity``, 5,000 digits): recorded once.

``FakeProvider`` on 127.0.0.1 answers with the argument text byte for byte,
in each wire format (Chat Completions, Responses, Anthropic Messages), to the
official SDKs behind ``OpenAIGateway`` / ``AnthropicGateway``, directly and
through ``asiento gateway``. The model's answer is recorded with the call's
problem, the step's outcome says what was wrong and is fed to the model, the
tool never runs, and no step is asked for (nor paid) twice.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from asiento import (
    Agent,
    ApprovalStep,
    FinalStep,
    Session,
    SqliteCheckpointer,
    Step,
    approve,
    require_approval_for,
    tool,
)
from asiento.gateways import AnthropicGateway, ModelResponseInvalid, OpenAIGateway
from asiento.proxy import create_app

from .fake_servers import Answer, AsgiServer, FakeProvider, Raw
from .test_openai import journal, model_results
from .test_proxy import finish, start_child

RUN = "run-1"  # the crash child's run id too
DIGITS = "7" * 5000
LIMIT = "which exceeds Python's limit of 4300 digits for int/str conversion"
#: id: (the argument text the model sends, what the step's recorded outcome says)
UNFIT = {
    "nan": ('{"amount": NaN}', "argument 'amount' holds NaN, which JSON cannot carry"),
    "infinity": (
        '{"amount": Infinity}',
        "argument 'amount' holds Infinity, which JSON cannot carry",
    ),
    "minus-infinity": (
        '{"amount": -Infinity}',
        "argument 'amount' holds -Infinity, which JSON cannot carry",
    ),
    "5000-digits": (
        '{"amount": ' + DIGITS + "}",
        f"argument 'amount' holds an integer with 5000 digits, {LIMIT}",
    ),
    "nan-in-a-list-of-objects": (
        '{"amount": 1, "lines": [{"qty": 2}, {"qty": NaN}]}',
        "argument 'lines' holds NaN (at lines[1].qty), which JSON cannot carry",
    ),
    "digits-in-an-object-in-a-list": (
        '{"amount": 1, "meta": {"ids": [1, -' + DIGITS + "]}}",
        f"argument 'meta' holds an integer with 5000 digits (at meta.ids[1]), {LIMIT}",
    ),
}
KINDS = ["chat", "responses", "anthropic"]


class Tools:
    """A non-idempotent ``bill`` the bad call names, and ``send``, which needs approval."""

    def __init__(self) -> None:
        self.billed: list[Any] = []
        self.sent: list[str] = []

    def agent(self) -> Agent:
        @tool
        def bill(
            amount: float,
            lines: list[dict[str, int]] | None = None,
            meta: dict[str, Any] | None = None,
        ) -> str:
            """Bill an amount."""
            self.billed.append(amount)
            return "billed"

        @tool
        def send(text: str) -> str:
            """Send a message."""
            self.sent.append(text)
            return "sent"

        return Agent(tools=[bill, send], policy=require_approval_for("send"))


def gateway(kind: str, url: str) -> OpenAIGateway | AnthropicGateway:
    """The gateway for one wire format on the official SDK; ``url`` is the server's root."""
    if kind == "anthropic":
        return AnthropicGateway("claude-test", base_url=url, api_key="sk-ant", max_retries=0)
    api = "chat" if kind == "chat" else "responses"
    return OpenAIGateway("gpt-test", api=api, base_url=url + "/v1", api_key="sk", max_retries=0)


async def drive(tools: Tools, kind: str, url: str, db: Path) -> list[Step]:
    """One pass of the run on the journal at ``db``, with a fresh gateway."""
    store = SqliteCheckpointer(db)
    try:
        async with gateway(kind, url) as gw:
            session = Session(RUN, gw, store)
            return [s async for s in tools.agent().run("bill and tell", session=session)]
    finally:
        await store.close()


def billed_per_step(provider: FakeProvider) -> Counter[str]:
    return Counter(key.split(":")[1] for key in provider.generations if key)


def strict(text: str) -> Any:
    """``json.loads`` that refuses NaN and Infinity, as strict JSON does."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} in a journal record")

    return json.loads(text, parse_constant=refuse)


def recorded(db: Path) -> dict[tuple[str, str], Any]:
    """Every record's payload, read from the file as text and parsed as strict JSON."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT step_id, phase, payload FROM journal").fetchall()
    return {(step, phase): strict(payload) for step, phase, payload in rows}


@pytest.fixture
def provider(request: pytest.FixtureRequest) -> Iterator[FakeProvider]:
    """m1 asks for ``bill`` with unfit arguments, m2 for ``send`` (needs approval), m3 ends."""
    raw, _ = UNFIT[request.param]
    script = [
        Answer(calls=(("bill", Raw(raw)),)),
        Answer(text="could not bill", calls=(("send", {"text": "sorry"}),)),
        Answer(text="done"),
    ]
    with FakeProvider(script) as p:
        yield p


@pytest.mark.parametrize("via", ["direct", "proxy"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("provider", list(UNFIT), indirect=True)
async def test_an_answer_with_unfit_arguments_is_recorded_fed_back_and_never_asked_again(
    provider: FakeProvider, tmp_path: Path, kind: str, via: str, request: pytest.FixtureRequest
) -> None:
    """The answer is recorded with the call's problem, the tool's outcome says it, once."""
    raw, said = UNFIT[request.node.callspec.params["provider"]]
    tools, db = Tools(), tmp_path / "runs.db"
    with ExitStack() as stack:
        url = provider.anthropic_url
        if via == "proxy":
            app = create_app(provider.openai_url, db=tmp_path / "keys.db")
            url = stack.enter_context(AsgiServer(app)).url
        first = await drive(tools, kind, url, db)
        assert isinstance(first[-1], ApprovalStep)
        records = recorded(db)
        [call] = records[("m1", "result")]["response"]["tool_calls"]
        assert (call["name"], call["arguments"]) == ("bill", {})
        assert (call["raw_arguments"], call["problem"]) == (raw, said)
        assert records[("m1.t1", "result")] == {"status": "error", "error": said}
        fed = json.dumps(provider.requests[1].body)
        assert json.dumps(f"error: {said}") in fed, "the outcome is fed to the model"

        store = SqliteCheckpointer(db)
        await approve(store, RUN, "m2.t1", by="ana")
        await store.close()
        second = await drive(tools, kind, url, db)
    assert isinstance(second[-1], FinalStep)
    assert (tools.billed, tools.sent) == ([], ["sorry"])
    assert billed_per_step(provider) == {"m1": 1, "m2": 1, "m3": 1}
    assert provider.problems == [], "every request held a conversation the API accepts"


# -- killed with SIGKILL, resumed ------------------------------------------------------------


@pytest.fixture
def nan_provider() -> Iterator[FakeProvider]:
    """What the crash child is answered: ``read`` with a NaN path, then done."""
    with FakeProvider([Answer(calls=(("read", Raw('{"path": NaN}')),)), Answer(text="done")]) as p:
        yield p


def test_killed_before_the_answer_was_recorded_the_proxy_replays_it_and_it_is_recorded(
    nan_provider: FakeProvider, tmp_path: Path
) -> None:
    """The proxy keeps the answer the gateway accepts: the resumed pass records it, unpaid."""
    db = tmp_path / "runs.db"
    with AsgiServer(create_app(nan_provider.openai_url, db=tmp_path / "keys.db")) as server:
        url = server.url + "/v1"
        assert finish(start_child(db, url, crash_at="inside_model_call@1")) is None
        resumed = finish(start_child(db, url))
    assert resumed == {"ended": "closed", "model_calls": 2, "replayed": 0}
    assert billed_per_step(nan_provider) == {"m1": 1, "m2": 1}
    records = recorded(db)
    assert records[("m1.t1", "result")]["error"] == (
        "argument 'path' holds NaN, which JSON cannot carry"
    )


def test_killed_after_the_answer_was_recorded_the_resumed_pass_does_not_ask_again(
    nan_provider: FakeProvider, tmp_path: Path
) -> None:
    """Direct to the provider: the recorded answer is replayed, m1 is paid for once."""
    db = tmp_path / "runs.db"
    url = nan_provider.openai_url
    assert finish(start_child(db, url, crash_at="after_model_result@1")) is None
    assert "m1" in model_results(asyncio.run(journal(db)))
    resumed = finish(start_child(db, url))
    assert resumed == {"ended": "closed", "model_calls": 1, "replayed": 1}
    assert billed_per_step(nan_provider) == {"m1": 1, "m2": 1}


# -- answers the gateways refuse are not kept -----------------------------------------------


def _chat_body(function: dict[str, Any]) -> bytes:
    """A Chat Completion whose one tool call has this ``function``."""
    call = {"id": "call_1", "type": "function", "function": function}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
    body = {"id": "chatcmpl-bad", "object": "chat.completion", "model": "gpt-test"}
    return json.dumps(body | {"choices": [choice]}).encode()


REFUSED = {
    "no-tool-name": (_chat_body({"name": "", "arguments": "{}"}), "non-empty str name"),
    "cut-short": (_chat_body({"name": "bill", "arguments": '{"amount": 1'}), "cut short?"),
}


@pytest.fixture
def plain_provider() -> Iterator[FakeProvider]:
    """A provider whose model bills nothing and ends at once (after any garbled answer)."""
    with FakeProvider([Answer(text="done")]) as p:
        yield p


@pytest.mark.parametrize("case", list(REFUSED))
async def test_an_answer_the_gateway_refuses_is_the_models_fault_and_the_proxy_does_not_keep_it(
    plain_provider: FakeProvider, tmp_path: Path, case: str
) -> None:
    """ModelResponseInvalid (not UsageError), nothing recorded; the proxy lets the key go."""
    body, said = REFUSED[case]
    plain_provider.garble_next(body)
    tools, db = Tools(), tmp_path / "runs.db"
    with AsgiServer(create_app(plain_provider.openai_url, db=tmp_path / "keys.db")) as server:
        with pytest.raises(ModelResponseInvalid, match=said) as caught:
            await drive(tools, "chat", server.url, db)
        assert caught.value.step_id == "m1"
        assert recorded(db) == {}
        again = await drive(tools, "chat", server.url, db)
    assert isinstance(again[-1], FinalStep)
    assert billed_per_step(plain_provider) == {"m1": 2}, "the proxy called upstream again"
