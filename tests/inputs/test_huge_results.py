"""A tool result too large for one record is the step's recorded failure, whatever the source.

2.9 million emoji are 11.6 MB of UTF-8 but 34.8 MB of the journal's JSON (each one
``\\ud83d\\ude00``): over the 32 MiB a record holds. Refused at the append, the
effect that ran would be left uncertain; recorded as a failure, the model is told,
the run goes on, and a resume replays the failure instead of running the tool again.
Native tools, Pydantic AI's and the OpenAI Agents SDK's, each against a real
journal (and the frameworks against a real HTTP provider on 127.0.0.1).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from asiento import (
    Agent,
    FinalStep,
    ModelResponse,
    Phase,
    Session,
    SqliteCheckpointer,
    ToolCall,
    ToolStep,
    tool,
)
from asiento.journal.base import MAX_RECORD_BYTES
from asiento.testing import ScriptedGateway
from providers.fake_servers import Answer, FakeProvider

HUGE = "\U0001f600" * 2_900_000  # 34.8 MB of JSON, 11.6 MB of UTF-8
RUN = "huge-1"
TOLD = "the tool's result cannot be recorded"


def test_the_result_is_over_the_limit_only_as_the_journal_writes_it() -> None:
    assert len(HUGE.encode()) < MAX_RECORD_BYTES < len(HUGE) * 12


async def _result(db: Path, step_id: str) -> dict[str, Any]:
    store = SqliteCheckpointer(db)
    try:
        [result] = [e for e in await store.load_step(RUN, step_id) if e.phase is Phase.RESULT]
        return result.payload
    finally:
        await store.close()


async def test_a_native_tool(tmp_path: Path) -> None:
    ran: list[int] = []

    @tool
    def dump() -> str:
        """Return a lot (not idempotent: it ran, it must not run again)."""
        ran.append(1)
        return HUGE

    script = [
        ModelResponse(tool_calls=[ToolCall(name="dump", arguments={})]),
        ModelResponse(text="ok"),
    ]
    db = tmp_path / "runs.db"
    passes = []
    for _ in range(2):  # the second pass replays the recorded failure
        store = SqliteCheckpointer(db)
        gateway = ScriptedGateway(script)
        try:
            session = Session(RUN, gateway, store)
            steps = [s async for s in Agent(tools=[dump]).run("t", session=session)]
        finally:
            await store.close()
        assert isinstance(steps[-1], FinalStep)
        passes.append(steps)
    [step] = [s for s in passes[0] if isinstance(s, ToolStep)]
    assert step.status == "error"
    assert ran == [1]
    payload = await _result(db, "m1.t1")
    assert payload["status"] == "error"
    assert payload["error"].startswith(f"{TOLD} (34,8")


async def test_a_pydantic_ai_tool(tmp_path: Path) -> None:
    pytest.importorskip("pydantic_ai")
    import openai
    from pydantic_ai import Agent as PydanticAgent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from asiento.integrations.pydantic_ai import durable_run

    ran: list[int] = []
    script = (Answer(calls=(("dump", {}),)), Answer(text="told"))
    with FakeProvider(script) as provider:
        async with openai.AsyncOpenAI(base_url=provider.openai_url, api_key="sk") as client:
            model = OpenAIChatModel("gpt-test", provider=OpenAIProvider(openai_client=client))
            agent = PydanticAgent(model)

            @agent.tool_plain
            def dump() -> str:
                """Return a lot."""
                ran.append(1)
                return HUGE

            store = SqliteCheckpointer(tmp_path / "runs.db")
            try:
                done = await durable_run(agent, "dump it", run_id=RUN, store=store)
            finally:
                await store.close()
        sent = provider.requests[1].raw
    assert done.output == "told"
    assert ran == [1]
    assert TOLD.encode() in sent  # the model was told, not handed 34.8 MB
    assert len(sent) < 1_000_000
    payload = await _result(tmp_path / "runs.db", "m1.t1")
    assert payload["status"] == "error"
    assert payload["error"].startswith(TOLD)


async def test_an_openai_agents_tool(tmp_path: Path) -> None:
    agents = pytest.importorskip("agents")
    import openai

    from asiento.integrations.openai_agents import durable_run

    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    agents.set_tracing_disabled(True)
    ran: list[int] = []

    @agents.function_tool
    def dump() -> str:
        """Return a lot."""
        ran.append(1)
        return HUGE

    script = (Answer(calls=(("dump", {}),)), Answer(text="told"))
    with FakeProvider(script) as provider:
        client = openai.AsyncOpenAI(api_key="sk", base_url=provider.openai_url, max_retries=0)
        model = agents.OpenAIChatCompletionsModel(model="gpt-test", openai_client=client)
        agent = agents.Agent(name="dumper", model=model, tools=[dump])
        store = SqliteCheckpointer(tmp_path / "runs.db")
        try:
            result = await durable_run(agent, "dump it", run_id=RUN, store=store)
        finally:
            await store.close()
            await client.close()
        sent = provider.requests[1].raw
    assert result.final_output == "told"
    assert ran == [1]
    assert TOLD.encode() in sent
    payload = await _result(tmp_path / "runs.db", "m1.t1")
    assert payload["status"] == "error"
    assert payload["error"].startswith(TOLD)
