"""What a durable Pydantic AI run refuses rather than run at-least-once, and records nothing for.

The agent's model is Pydantic AI's in-process ``FunctionModel``, the journal a real
SQLite file.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent
from pydantic_ai.capabilities import ProcessEventStream
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from asiento import SqliteCheckpointer, UsageError
from asiento.integrations.pydantic_ai import durable_run


async def test_a_model_request_the_agent_would_stream_is_refused(tmp_path: Path) -> None:
    """An event-stream capability makes ``agent.run`` stream its model requests: a
    streamed answer is not journaled, so the run is refused before the model is asked."""
    streamed: list[str] = []

    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(parts=[TextPart("hello")])

    async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
        streamed.append("asked")
        yield "hel"
        yield "lo"

    async def watch(ctx: Any, events: AsyncIterable[Any]) -> None:
        async for _ in events:
            pass

    agent: Agent[None, str] = Agent(
        FunctionModel(answer, stream_function=stream), capabilities=[ProcessEventStream(watch)]
    )
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        with pytest.raises(UsageError, match="does not stream its model requests"):
            await durable_run(agent, "hi", run_id="streamed", store=store)
        assert streamed == []  # the model was never asked
        assert await store.load("streamed") == []
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ({"idempotent": "lookup"}, r"idempotent=\.\.\.\) takes names .*got str 'lookup'"),
        ({"trusted_mcp": "bank"}, r"trusted_mcp=\.\.\.\) takes names .*got str 'bank'"),
        ({"idempotent": ["lookup", None]}, r"non-empty str names, got None"),
        ({"model": 5}, r"model=\.\.\.\) takes a Pydantic AI Model or a model name"),
        ({"lease_ttl": 0}, r"durable_run\(lease_ttl=\.\.\.\) must be a finite number"),
    ],
    ids=["idempotent-string", "trusted-string", "not-a-name", "not-a-model", "no-lease"],
)
async def test_options_that_are_not_what_they_name_are_refused(
    tmp_path: Path, given: dict[str, Any], match: str
) -> None:
    """``idempotent="lookup"`` would be read letter by letter (a tool named ``o`` run again
    after a crash), a model that is not one failed inside the pass with a bare TypeError:
    refused before the model is asked, nothing recorded."""
    asked: list[str] = []

    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked.append("asked")
        return ModelResponse(parts=[TextPart("hello")])

    agent: Agent[None, str] = Agent(FunctionModel(answer))
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        with pytest.raises(UsageError, match=match):
            await durable_run(agent, "hi", run_id="named", store=store, **given)
        assert asked == []
        assert await store.load("named") == []
    finally:
        await store.close()
