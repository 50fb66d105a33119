"""Prompt caching in the paid-call ledger, over real HTTP with the official SDKs.

Each API reports the prompt cache its own way: Anthropic leaves cache writes
and reads out of ``input_tokens``, OpenAI counts cache reads (and writes) inside
``prompt_tokens`` / ``input_tokens`` and itemises them. Every gateway records
the whole input, what of it was read from or written to a cache, and the cost
at the cache prices; a resumed run reports that cost as saved.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from asiento import (
    Agent,
    ModelResponse,
    ModelStep,
    Price,
    Session,
    SqliteCheckpointer,
    Step,
    Usage,
    tool,
)
from asiento.gateways import AnthropicGateway, OpenAIGateway

from .fake_servers import Answer, FakeProvider
from .test_openai import RUN, SCRIPT, TASK, agent, journal, model_results

#: Anthropic-like prices: cache reads at a tenth of the input price, writes at 1.25 times.
PRICE = Price(3.0, 15.0, cached_input_per_mtok=0.3, cache_write_per_mtok=3.75)
PRICES = {"claude-test": PRICE, "gpt-test": PRICE}
#: (kind of gateway, (tokens read from the cache, tokens written to it)) in every answer.
CACHES = [("anthropic", (40, 16)), ("chat", (40, 0)), ("responses", (40, 16))]


class Boom(BaseException):
    """Stands for the process dying inside a tool."""


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    """A scripted provider on 127.0.0.1 speaking every wire format."""
    with FakeProvider(SCRIPT) as p:
        yield p


def gateway_for(kind: str, provider: FakeProvider) -> OpenAIGateway | AnthropicGateway:
    if kind == "anthropic":
        return AnthropicGateway("claude-test", base_url=provider.anthropic_url, api_key="k")
    api = "chat" if kind == "chat" else "responses"
    return OpenAIGateway("gpt-test", api=api, base_url=provider.openai_url, api_key="sk-test")


async def priced_pass(
    gateway: OpenAIGateway | AnthropicGateway, db: Path, ag: Agent | None = None
) -> tuple[list[Step], Session]:
    """One pass of the run with ``PRICES``; its steps and its session."""
    store = SqliteCheckpointer(db)
    session = Session(RUN, gateway, store, prices=PRICES)
    steps: list[Step] = []
    try:
        async with gateway:
            steps.extend([s async for s in (ag or agent()).run(TASK, session=session)])
    finally:
        await store.close()
    return steps, session


def billed(provider: FakeProvider, n: int, cache: tuple[int, int]) -> Usage:
    """What the provider billed for its ``n``-th generation, as the ledger must record it."""
    answer = provider.script[n]
    read, written = cache
    total = provider.requests[n].size // 4
    assert total > read + written  # the fake's Anthropic input_tokens stays positive
    output = 5 + 10 * len(answer.calls) + len(answer.text) // 4
    return Usage(
        input_tokens=total,
        output_tokens=output,
        cached_input_tokens=read,
        cache_write_tokens=written,
    )


def priced(usage: Usage) -> float:
    """The cost of ``usage`` at ``PRICE``, each kind of token at its own price."""
    uncached = usage.input_tokens - usage.cached_input_tokens - usage.cache_write_tokens
    total = (
        uncached * 3.0
        + usage.cached_input_tokens * 0.3
        + usage.cache_write_tokens * 3.75
        + usage.output_tokens * 15.0
    )
    return total / 1e6


@pytest.mark.parametrize(("kind", "cache"), CACHES, ids=[k for k, _ in CACHES])
async def test_cached_and_written_tokens_are_recorded_and_priced(
    provider: FakeProvider, tmp_path: Path, kind: str, cache: tuple[int, int]
) -> None:
    """Each step records all input, its cache reads and writes, and their cost at cache prices."""
    provider.cache = cache
    db = tmp_path / "runs.db"
    steps, session = await priced_pass(gateway_for(kind, provider), db)
    expected = [billed(provider, n, cache) for n in range(3)]
    assert [s.response.usage for s in steps if isinstance(s, ModelStep)] == expected
    results = model_results(await journal(db))
    for n, step in enumerate(("m1", "m2", "m3")):
        recorded = results[step]
        assert recorded["response"]["cache"] == list(cache)
        assert ModelResponse.from_json(recorded["response"]).usage == expected[n]
        assert recorded["cost"] == pytest.approx(priced(expected[n]), abs=1e-10)
    assert session.stats.input_tokens == sum(u.input_tokens for u in expected)
    assert session.stats.cost == pytest.approx(sum(priced(u) for u in expected), abs=1e-9)
    store = SqliteCheckpointer(db)
    [info] = await store.runs()
    await store.close()
    assert (info.input_tokens, info.output_tokens) == (
        sum(u.input_tokens for u in expected),
        sum(u.output_tokens for u in expected),
    )
    assert info.cost == pytest.approx(sum(priced(u) for u in expected), abs=1e-9)


@pytest.mark.parametrize("kind", ["anthropic", "chat", "responses"])
async def test_without_a_cache_nothing_is_counted_as_cached(
    provider: FakeProvider, tmp_path: Path, kind: str
) -> None:
    """Answers with no (or null) cache figures record 0 cached tokens and no ``cache`` entry."""
    db = tmp_path / "runs.db"
    steps, _ = await priced_pass(gateway_for(kind, provider), db)
    usages = [s.response.usage for s in steps if isinstance(s, ModelStep)]
    assert [(u.cached_input_tokens, u.cache_write_tokens) for u in usages] == [(0, 0)] * 3
    assert usages[0] == billed(provider, 0, (0, 0))
    assert all("cache" not in r["response"] for r in model_results(await journal(db)).values())


NULL_FIGURES = {
    "anthropic": {
        "id": "msg_null",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": [{"type": "text", "text": "done"}],
        "stop_reason": "end_turn",
        "usage": {
            "input_tokens": 7,
            "output_tokens": 2,
            "cache_creation_input_tokens": None,
            "cache_read_input_tokens": None,
        },
    },
    "chat": {
        "id": "chatcmpl-null",
        "object": "chat.completion",
        "model": "gpt-test",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "done"}}],
        "usage": {
            "prompt_tokens": 7,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": None, "cache_write_tokens": None},
        },
    },
    "responses": {
        "id": "resp_null",
        "object": "response",
        "model": "gpt-test",
        "output": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "done"}],
            }
        ],
        "usage": {"input_tokens": 7, "output_tokens": 2, "input_tokens_details": None},
    },
}


@pytest.mark.parametrize("kind", sorted(NULL_FIGURES))
async def test_null_cache_figures_count_as_zero(
    provider: FakeProvider, tmp_path: Path, kind: str
) -> None:
    """Cache figures sent as null (or a null details object) are recorded as 0, never an error."""
    provider.garble_next(json.dumps(NULL_FIGURES[kind]).encode())
    steps, session = await priced_pass(gateway_for(kind, provider), tmp_path / "runs.db")
    [step] = [s for s in steps if isinstance(s, ModelStep)]
    assert step.response.usage == Usage(input_tokens=7, output_tokens=2)
    assert session.stats.cost == pytest.approx((7 * 3.0 + 2 * 15.0) / 1e6)


async def test_a_resumed_run_reports_the_cache_priced_cost_as_saved(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """A model step replayed after a crash saves all its input tokens and its cache-priced cost."""
    crashes = [True]

    @tool(idempotent=True)
    def crash() -> str:
        """Die once, then answer."""
        if crashes.pop() if crashes else False:
            raise Boom
        return "ok"

    provider.script = [Answer(calls=(("crash", {}),)), Answer(text="done")]
    provider.cache = (40, 16)
    db = tmp_path / "runs.db"
    with pytest.raises(Boom):
        await priced_pass(gateway_for("anthropic", provider), db, agent(crash))
    m1 = billed(provider, 0, (40, 16))
    _, second = await priced_pass(gateway_for("anthropic", provider), db, agent(crash))
    assert (second.stats.model_calls, second.stats.model_calls_replayed) == (1, 1)
    assert second.stats.input_tokens_saved == m1.input_tokens
    assert second.stats.cost_saved == pytest.approx(priced(m1), abs=1e-10)
    store = SqliteCheckpointer(db)
    [info] = await store.runs()
    await store.close()
    assert (info.replayed_calls, info.saved_input_tokens) == (1, m1.input_tokens)
    assert info.saved_cost == pytest.approx(priced(m1), abs=1e-10)
    assert provider.billed() == 2
