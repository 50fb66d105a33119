"""A durable Pydantic AI run commits like a native one: a model answer rides with what follows.

The agent's model is Pydantic AI's in-process ``FunctionModel``: what is counted is the
COMMIT statements of a real SQLite file, not a provider's traffic.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent, ModelRetry
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from asiento import Phase, RecordTooLarge, RunStatus, SqliteCheckpointer
from asiento.integrations.pydantic_ai import durable_run
from sqlite_files import record_commits

BENCH = Path(__file__).resolve().parents[2] / "bench" / "pydantic_ai_overhead.py"
asked: list[int] = []


def _bench_agent() -> Agent[None, str]:
    """The agent ``bench/pydantic_ai_overhead.py`` measures: one refund call, then text."""
    spec = importlib.util.spec_from_file_location("pydantic_ai_overhead", BENCH)
    assert spec is not None
    assert spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    agent: Agent[None, str] = bench._agent()
    return agent


async def test_a_model_and_tool_step_costs_two_commits(tmp_path: Path) -> None:
    """m1's answer is committed with m1.t1's intent and submitted, and m2's with the
    final record: three commits for the run's six records, and the last gives the
    lease up (no release of its own)."""
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        commits = record_commits(store, every=True)
        result = await durable_run(_bench_agent(), "refund A1", run_id="r1", store=store)
        assert result.output == "refunded A1"
        records = [(e.step_id, e.phase) for e in await store.load("r1")]
        assert records == [
            ("m1", Phase.RESULT),
            ("m1.t1", Phase.INTENT),
            ("m1.t1", Phase.SUBMITTED),
            ("m1.t1", Phase.RESULT),
            ("m2", Phase.RESULT),
            ("final", Phase.RESULT),
        ]
        # the lease taken, (m1, intent, submitted), the result, (m2, final) with the release
        assert commits == [0, 3, 1, 2]
        info = await store.run("r1")
        assert info is not None
        assert (info.status, info.lease_owner) == (RunStatus.CLOSED, None)
    finally:
        await store.close()


async def test_an_answer_no_commit_took_is_kept_when_the_pass_fails(tmp_path: Path) -> None:
    """The output validator fails the pass after m1's answer, before anything follows
    it: the answer is recorded all the same, and the next pass does not ask again."""
    asked.clear()

    def text_only(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked.append(len(messages))
        return ModelResponse(parts=[TextPart("done")])

    failing: Agent[None, str] = Agent(FunctionModel(text_only), instructions="Say done.")

    @failing.output_validator
    def _refuse(output: str) -> str:
        raise RuntimeError("the validator's own bug")

    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        with pytest.raises(RuntimeError, match="validator's own bug"):
            await durable_run(failing, "finish", run_id="r2", store=store)
        assert [(e.step_id, e.phase) for e in await store.load("r2")] == [("m1", Phase.RESULT)]
        fixed: Agent[None, str] = Agent(FunctionModel(text_only), instructions="Say done.")
        result = await durable_run(fixed, "finish", run_id="r2", store=store)
        assert result.output == "done"
        assert len(asked) == 1  # paid once, replayed on the second pass
        assert result.stats.model_calls_replayed == 1
    finally:
        await store.close()


async def test_a_retried_output_commits_the_first_answer_before_asking_again(
    tmp_path: Path,
) -> None:
    """A validator's ``ModelRetry`` asks the model again with no tool between: the
    first answer is durable before the second request goes out."""
    seen_at_second_ask: list[list[str]] = []
    store = SqliteCheckpointer(tmp_path / "runs.db")

    async def answers(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) > 1:
            seen_at_second_ask.append([e.step_id for e in await store.load("r3")])
            return ModelResponse(parts=[TextPart("better")])
        return ModelResponse(parts=[TextPart("first")])

    agent: Agent[None, str] = Agent(FunctionModel(answers), instructions="Answer.")

    @agent.output_validator
    def _once(output: str) -> str:
        if output == "first":
            raise ModelRetry("try again")
        return output

    try:
        result = await durable_run(agent, "answer", run_id="r3", store=store)
        assert result.output == "better"
        assert seen_at_second_ask == [["m1"]]
    finally:
        await store.close()


async def test_a_final_record_too_large_keeps_the_last_answer_it_would_have_carried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final record (the output and the whole conversation) is over the journal's
    limit though each step's record is not: the pass fails with RecordTooLarge, and
    the last answer, which was to ride that commit, is recorded alone, so the next
    pass fails the same way without paying for the answer again."""
    monkeypatch.setattr("asiento.journal.base.MAX_RECORD_BYTES", 60_000)
    asked.clear()
    long_text = "x" * 25_000

    def reads_then_answers(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked.append(len(messages))
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("read", {})])
        return ModelResponse(parts=[TextPart(long_text)])

    agent: Agent[None, str] = Agent(FunctionModel(reads_then_answers), instructions="Read.")

    @agent.tool_plain
    def read() -> str:
        """Read the file."""
        return "y" * 30_000

    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        for passes in (1, 2):
            with pytest.raises(RecordTooLarge, match="final"):
                await durable_run(agent, "read it", run_id="r3", store=store, idempotent=["read"])
            records = [(e.step_id, e.phase) for e in await store.load("r3")]
            assert records[-1] == ("m2", Phase.RESULT), passes
            assert len(asked) == 2, passes  # m1 and m2, each paid once
    finally:
        await store.close()
