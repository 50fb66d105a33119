"""AnthropicGateway over real HTTP: Messages mapping both ways, keys on every attempt, errors.

The official ``anthropic`` SDK talks to ``FakeProvider`` on 127.0.0.1, which
refuses what the real API refuses (broken alternation, tool_use ids without a
tool_result in the next user message, empty text blocks).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from asiento import FinalStep, UsageError, model_key
from asiento.gateways import AnthropicGateway, ModelRequestRejected, ModelResponseInvalid

from .fake_servers import FakeProvider
from .test_openai import (
    ARMED_SCRIPT,
    INSTRUCTIONS,
    RUN,
    SCRIPT,
    TASK,
    agent,
    arming,
    drive,
    journal,
    model_results,
    scripted,
    scripted_shape,
    shape,
)

CUT_TOOL_USE = {
    "id": "msg_cut",
    "type": "message",
    "role": "assistant",
    "model": "claude-test",
    "content": [{"type": "tool_use", "id": "toolu_cut", "name": "read", "input": {"pa": 1}}],
    "stop_reason": "max_tokens",
    "usage": {"input_tokens": 10, "output_tokens": 4096},
}


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    """A scripted provider on 127.0.0.1 speaking every wire format."""
    with FakeProvider(SCRIPT) as p:
        yield p


@pytest.fixture
async def reference(tmp_path: Path) -> list[Any]:
    """The journal shape of the same run driven by ScriptedGateway."""
    return await scripted_shape(tmp_path)


@pytest.fixture
async def gateway(provider: FakeProvider) -> AsyncIterator[AnthropicGateway]:
    """An AnthropicGateway on the official SDK, aimed at the provider."""
    async with AnthropicGateway(
        "claude-test", base_url=provider.anthropic_url, api_key="sk-ant-test"
    ) as gw:
        yield gw


async def test_messages_multi_tool_run_has_the_scripted_journal_shape(
    gateway: AnthropicGateway, provider: FakeProvider, reference: list[Any], tmp_path: Path
) -> None:
    """A full multi-tool run over Messages records what the scripted run records."""
    steps = await drive(gateway, tmp_path / "runs.db")
    assert isinstance(steps[-1], FinalStep)
    assert shape(await journal(tmp_path / "runs.db")) == reference
    assert provider.problems == []
    assert provider.billed() == 3


async def test_request_has_system_tools_and_grouped_tool_results(
    gateway: AnthropicGateway, provider: FakeProvider, tmp_path: Path
) -> None:
    """Instructions go in system; the two results of one turn travel in one user message."""
    await drive(gateway, tmp_path / "runs.db")
    last = provider.requests[-1].body
    assert last["system"] == INSTRUCTIONS
    assert last["max_tokens"] == 4096
    assert last["tools"][0]["name"] == "read"
    assert last["tools"][0]["input_schema"]["type"] == "object"
    user, first, results, second = last["messages"][:4]
    assert user == {"role": "user", "content": TASK}
    assert [b["id"] for b in first["content"]] == ["toolu_1_1", "toolu_1_2"]
    assert results["role"] == "user"
    assert [(b["type"], b["tool_use_id"], b["content"]) for b in results["content"]] == [
        ("tool_result", "toolu_1_1", "contents of /x"),
        ("tool_result", "toolu_1_2", "contents of /y"),
    ]
    assert second["content"][0] == {"type": "text", "text": "one more"}
    assert [m["role"] for m in last["messages"]] == ["user", "assistant"] * 2 + ["user"]


async def test_usage_model_and_request_id_are_recorded(
    gateway: AnthropicGateway, provider: FakeProvider, tmp_path: Path
) -> None:
    """Every model step records input/output tokens as reported, the model and request-id."""
    await drive(gateway, tmp_path / "runs.db")
    results = model_results(await journal(tmp_path / "runs.db"))
    for n, step in enumerate(("m1", "m2", "m3"), 1):
        response = results[step]["response"]
        answer = SCRIPT[n - 1]
        expected = [
            provider.requests[n - 1].size // 4,
            5 + 10 * len(answer.calls) + len(answer.text) // 4,
        ]
        assert response["usage"] == expected
        assert (response["model"], response["request_id"]) == ("claude-test", f"req_{n}")


async def test_every_attempt_carries_the_step_key_sdk_retries_included(
    gateway: AnthropicGateway, provider: FakeProvider, tmp_path: Path
) -> None:
    """Overloaded (529) and 500 answers are retried by the SDK with the same key each time."""
    provider.fail_next(1, 529)
    provider.fail_next(1, 500)
    await drive(gateway, tmp_path / "runs.db")
    first = provider.requests[:3]
    fp = model_results(await journal(tmp_path / "runs.db"))["m1"]["fp"]
    assert [r.key for r in first] == [model_key(RUN, "m1", fp)] * 3
    assert [r.headers["x-stainless-retry-count"] for r in first] == ["0", "1", "2"]
    assert provider.billed() == 3


async def test_a_400_is_rejected_naming_the_step_and_resumable(
    gateway: AnthropicGateway, provider: FakeProvider, tmp_path: Path
) -> None:
    """A 4xx is ModelRequestRejected naming the step; after the fix the run resumes there."""
    provider.script = list(ARMED_SCRIPT)
    db = tmp_path / "runs.db"
    with pytest.raises(ModelRequestRejected) as caught:
        await drive(gateway, db, ag=agent(arming(provider, 400, 1)))
    assert (caught.value.run_id, caught.value.step_id) == (RUN, "m2")
    steps = await drive(gateway, db, ag=agent(arming(provider, 400, 0)))
    assert isinstance(steps[-1], FinalStep)
    assert provider.billed() == 2


async def test_a_tool_use_cut_by_max_tokens_is_never_recorded(
    gateway: AnthropicGateway, provider: FakeProvider, tmp_path: Path
) -> None:
    """A tool_use cut short by max_tokens raises ModelResponseInvalid and records nothing."""
    provider.garble_next(json.dumps(CUT_TOOL_USE).encode())
    db = tmp_path / "runs.db"
    with pytest.raises(ModelResponseInvalid, match="max_tokens"):
        await drive(gateway, db)
    assert await journal(db) == []


async def test_call_ids_the_api_would_refuse_are_made_safe_both_ways(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """Tool-call ids from another provider (``m1.t1``) are sent as ids Anthropic accepts."""
    db = tmp_path / "runs.db"
    with pytest.raises(UsageError, match="turn 1"):
        await drive(
            scripted(SCRIPT[:1]), db
        )  # m1 recorded with ids m1.t1, m1.t2; the script ends there
    async with AnthropicGateway("claude-test", base_url=provider.anthropic_url, api_key="k") as gw:
        steps = await drive(gw, db)
    assert isinstance(steps[-1], FinalStep)
    assert provider.problems == []
    sent = provider.requests[0].body["messages"][1]["content"]
    assert [b["id"] for b in sent] == ["m1_t1", "m1_t2"]
