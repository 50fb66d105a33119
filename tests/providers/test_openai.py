"""OpenAIGateway over real HTTP: mapping both ways, keys on every attempt, errors.

The official ``openai`` SDK talks to ``FakeProvider`` on 127.0.0.1. The other
provider tests import the shared helpers (script, tool, ``drive``, ``shape``)
from here.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from asiento import (
    Agent,
    FinalStep,
    Gateway,
    ModelResponse,
    Phase,
    Session,
    SqliteCheckpointer,
    Step,
    StepEvent,
    ToolCall,
    model_key,
    tool,
)
from asiento.gateways import (
    ModelRequestRejected,
    ModelResponseInvalid,
    ModelUnavailable,
    OpenAIGateway,
)
from asiento.testing import ScriptedGateway

from .fake_servers import Answer, FakeProvider

RUN = "run-1"
TASK = "read /x, /y and /z"
INSTRUCTIONS = "You read files when asked."
#: m1 asks for two tools at once, m2 for one more with some text, m3 closes.
SCRIPT = (
    Answer(calls=(("read", {"path": "/x"}), ("read", {"path": "/y"}))),
    Answer(text="one more", calls=(("read", {"path": "/z"}),)),
    Answer(text="done: x, y, z"),
)


@tool(idempotent=True)
def read(path: str) -> str:
    """Read a file."""
    return f"contents of {path}"


def agent(*extra: Any) -> Agent:
    return Agent(instructions=INSTRUCTIONS, tools=[read, *extra])


def scripted(script: Sequence[Answer]) -> ScriptedGateway:
    """The same script as ``ModelResponse`` objects, for the scripted reference run."""
    return ScriptedGateway(
        [
            ModelResponse(
                text=a.text, tool_calls=[ToolCall(name=n, arguments=args) for n, args in a.calls]
            )
            for a in script
        ]
    )


async def drive(
    gateway: Gateway, db: Path, *, run_id: str = RUN, ag: Agent | None = None
) -> list[Step]:
    """One pass of the run on the journal at ``db``; the steps it yielded."""
    store = SqliteCheckpointer(db)
    try:
        return [s async for s in (ag or agent()).run(TASK, session=Session(run_id, gateway, store))]
    finally:
        await store.close()


async def journal(db: Path, run_id: str = RUN) -> list[StepEvent]:
    store = SqliteCheckpointer(db)
    try:
        return await store.load(run_id)
    finally:
        await store.close()


def shape(events: Sequence[StepEvent]) -> list[tuple[Any, ...]]:
    """The journal without what a provider chooses (call ids, usage, request ids, fingerprints)."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        payload = dict(e.payload)
        if e.phase is Phase.RESULT and "response" in payload:
            response = payload["response"]
            calls = [(c["name"], c["arguments"]) for c in response.get("tool_calls", [])]
            payload = {"text": response["text"], "calls": calls}
        out.append((e.step_id, e.phase.value, e.decision, payload))
    return out


def model_results(events: Sequence[StepEvent]) -> dict[str, dict[str, Any]]:
    return {
        e.step_id: e.payload for e in events if e.phase is Phase.RESULT and "response" in e.payload
    }


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    """A scripted provider on 127.0.0.1 speaking every wire format."""
    with FakeProvider(SCRIPT) as p:
        yield p


@pytest.fixture
async def gateway(provider: FakeProvider) -> Any:
    """An OpenAIGateway (Chat Completions) on the official SDK, aimed at the provider."""
    async with OpenAIGateway("gpt-test", base_url=provider.openai_url, api_key="sk-test") as gw:
        yield gw


async def scripted_shape(tmp_path: Path) -> list[tuple[Any, ...]]:
    """The journal shape of the same run driven by ScriptedGateway."""
    await drive(scripted(SCRIPT), tmp_path / "scripted.db")
    return shape(await journal(tmp_path / "scripted.db"))


@pytest.fixture
async def reference(tmp_path: Path) -> list[tuple[Any, ...]]:
    """The journal shape of the same run driven by ScriptedGateway."""
    return await scripted_shape(tmp_path)


async def test_chat_multi_tool_run_has_the_scripted_journal_shape(
    gateway: OpenAIGateway, provider: FakeProvider, reference: list[Any], tmp_path: Path
) -> None:
    """A full multi-tool run over Chat Completions records what the scripted run records."""
    steps = await drive(gateway, tmp_path / "runs.db")
    assert isinstance(steps[-1], FinalStep)
    assert steps[-1].text == "done: x, y, z"
    assert shape(await journal(tmp_path / "runs.db")) == reference
    assert provider.problems == []
    assert provider.billed() == 3


async def test_chat_request_carries_instructions_tools_calls_and_results(
    gateway: OpenAIGateway, provider: FakeProvider, tmp_path: Path
) -> None:
    """Instructions become the system message; calls and results travel with their ids."""
    await drive(gateway, tmp_path / "runs.db")
    last = provider.requests[-1].body
    messages = last["messages"]
    assert messages[0] == {"role": "system", "content": INSTRUCTIONS}
    assert messages[1] == {"role": "user", "content": TASK}
    first = messages[2]
    assert [c["id"] for c in first["tool_calls"]] == ["call_1_1", "call_1_2"]
    assert json.loads(first["tool_calls"][1]["function"]["arguments"]) == {"path": "/y"}
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1_1", "content": "contents of /x"}
    assert messages[4]["tool_call_id"] == "call_1_2"
    assert messages[5]["content"] == "one more"
    assert last["tools"][0]["function"]["name"] == "read"
    assert last["tools"][0]["function"]["parameters"]["properties"]["path"]["type"] == "string"


async def test_usage_model_and_request_id_are_recorded(
    gateway: OpenAIGateway, provider: FakeProvider, tmp_path: Path
) -> None:
    """Every model step records the tokens the provider reported, its model and request id."""
    await drive(gateway, tmp_path / "runs.db")
    results = model_results(await journal(tmp_path / "runs.db"))
    for n, step in enumerate(("m1", "m2", "m3"), 1):
        response = results[step]["response"]
        sent = provider.requests[n - 1]
        answer = SCRIPT[n - 1]
        expected_out = 5 + 10 * len(answer.calls) + len(answer.text) // 4
        assert response["usage"] == [sent.size // 4, expected_out]
        assert response["model"] == "gpt-test"
        assert response["request_id"] == f"req_{n}"


async def test_responses_api_run_has_the_scripted_journal_shape(
    provider: FakeProvider, reference: list[Any], tmp_path: Path
) -> None:
    """The Responses API maps calls, outputs and instructions both ways to the same journal."""
    async with OpenAIGateway(
        "gpt-test", api="responses", base_url=provider.openai_url, api_key="sk-test"
    ) as gw:
        await drive(gw, tmp_path / "runs.db")
    events = await journal(tmp_path / "runs.db")
    assert shape(events) == reference
    assert provider.problems == []
    last = provider.requests[-1].body
    assert last["instructions"] == INSTRUCTIONS
    assert last["store"] is False
    kinds = [item.get("type", item.get("role")) for item in last["input"]]
    assert kinds == [
        "user", "function_call", "function_call", "function_call_output", "function_call_output",
        "assistant", "function_call", "function_call_output",
    ]  # fmt: skip
    assert model_results(events)["m3"]["response"]["usage"][1] == 5 + len("done: x, y, z") // 4


async def test_every_attempt_carries_the_step_key_sdk_retries_included(
    gateway: OpenAIGateway, provider: FakeProvider, tmp_path: Path
) -> None:
    """Server errors are retried by the SDK with backoff, each attempt with the same key.

    (A 429 is asiento's to retry: tests/providers/test_rate_limits.py.)
    """
    provider.fail_next(2, 500)
    await drive(gateway, tmp_path / "runs.db")
    first = provider.requests[:3]
    keys = {r.key for r in first}
    assert len(keys) == 1
    (key,) = keys
    assert key is not None
    assert key.startswith(f"{RUN}:m1:")
    assert [r.headers["x-stainless-retry-count"] for r in first] == ["0", "1", "2"]
    assert provider.billed(key) == 1
    recorded = model_results(await journal(tmp_path / "runs.db"))["m1"]["fp"]
    assert key == model_key(RUN, "m1", recorded)


def arming(provider: FakeProvider, status: int, n: int) -> Any:
    """A tool that, when it runs (between m1 and m2), makes the next ``n`` requests fail."""

    @tool(idempotent=True, name="arm")
    def arm() -> str:
        """Arm the provider's failure knob."""
        provider.fail_next(n, status)
        return "armed"

    return arm


ARMED_SCRIPT = (Answer(calls=(("arm", {}),)), Answer(text="done"))


async def test_5xx_past_the_retries_is_unavailable_and_the_run_resumes(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """Server errors outlasting the retries raise ModelUnavailable for the step; resume works."""
    provider.script = list(ARMED_SCRIPT)
    db = tmp_path / "runs.db"
    async with OpenAIGateway(
        "gpt-test", base_url=provider.openai_url, api_key="sk-test", max_retries=1
    ) as gw:
        with pytest.raises(ModelUnavailable) as caught:
            await drive(gw, db, ag=agent(arming(provider, 500, 2)))
    assert (caught.value.run_id, caught.value.step_id, caught.value.status) == (RUN, "m2", 500)
    assert "m2" in str(caught.value)
    assert "m2" not in model_results(await journal(db))
    async with OpenAIGateway("gpt-test", base_url=provider.openai_url, api_key="sk-test") as gw:
        steps = await drive(gw, db, ag=agent(arming(provider, 500, 0)))
    assert isinstance(steps[-1], FinalStep)
    assert Counter(k.split(":")[1] for k in provider.generations if k) == {"m1": 1, "m2": 1}


async def test_a_400_is_rejected_naming_the_step_without_retries_and_resumable(
    provider: FakeProvider, gateway: OpenAIGateway, tmp_path: Path
) -> None:
    """A 4xx is ModelRequestRejected for that step, not retried; the fixed run resumes there."""
    provider.script = list(ARMED_SCRIPT)
    db = tmp_path / "runs.db"
    with pytest.raises(ModelRequestRejected) as caught:
        await drive(gateway, db, ag=agent(arming(provider, 400, 1)))
    assert (caught.value.step_id, caught.value.status) == ("m2", 400)
    assert "resume" in str(caught.value)
    m2_requests = [r for r in provider.requests if r.key and ":m2:" in r.key]
    assert len(m2_requests) == 1
    steps = await drive(gateway, db, ag=agent(arming(provider, 400, 0)))
    assert isinstance(steps[-1], FinalStep)
    assert provider.billed() == 2


BAD_TOOL_ARGS = {
    "id": "chatcmpl-x",
    "model": "gpt-test",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "read", "arguments": '{"pa'},
                    }
                ],
            },
        }
    ],
}


@pytest.mark.parametrize(
    "garbage",
    [
        b"<html>gateway hiccup</html>",
        b'{"object": "chat.completion"}',
        json.dumps(BAD_TOOL_ARGS).encode(),
    ],
    ids=["not-json", "no-choices", "cut-arguments"],
)
async def test_an_unparseable_answer_is_never_recorded(
    gateway: OpenAIGateway, provider: FakeProvider, tmp_path: Path, garbage: bytes
) -> None:
    """An answer that cannot be parsed raises ModelResponseInvalid and leaves no record."""
    provider.garble_next(garbage)
    db = tmp_path / "runs.db"
    with pytest.raises(ModelResponseInvalid) as caught:
        await drive(gateway, db)
    assert caught.value.step_id == "m1"
    assert await journal(db) == []
    steps = await drive(gateway, db)
    assert isinstance(steps[-1], FinalStep)


async def test_a_run_id_outside_ascii_travels_percent_encoded_and_stable(
    gateway: OpenAIGateway, provider: FakeProvider, tmp_path: Path
) -> None:
    """A run id with spaces or accents still gives a valid, deterministic key header."""
    run_id = "informe ñandú\u20ac"
    await drive(gateway, tmp_path / "runs.db", run_id=run_id)
    events = await journal(tmp_path / "runs.db", run_id)
    fp = model_results(events)["m1"]["fp"]
    key = model_key(run_id, "m1", fp)
    assert provider.requests[0].key == quote(key, safe="!#$&'()*+,./:;=?@[]^_`{|}~-")
    assert provider.requests[0].key.isascii()


async def test_http_effect_publishes_under_a_run_id_outside_ascii() -> None:
    """Core bug shown here: HttpEffect must send the key of a run id like 'informe-ñandú' too.

    ``check_id`` accepts any Unicode run id, ``idem_key`` puts it in the key, and
    ``HttpEffect.publish`` sends the key raw as a header, which httpx refuses
    (UnicodeEncodeError) before anything leaves: the step stays submitted and
    every reconcile fails the same way. The model gateways percent-encode it.
    """
    from asiento import idem_key
    from asiento.effects import HttpEffect
    from asiento.testing.invoices import InvoiceServer

    class PublishInvoice(HttpEffect):
        def prepare(self, number: str) -> dict[str, Any]:
            """Publish an invoice."""
            return {"customer": "ACME", "amount": 100, "number": number}

    payload = {"customer": "ACME", "amount": 100, "number": "F-1"}
    with InvoiceServer(honour_keys=True) as server:
        published = await PublishInvoice(server.invoices_url).publish(
            payload, idem_key("informe-ñandú", "m1.t1", payload)
        )
        assert published.remote_id
        assert len(server.invoices) == 1
