"""A pass's model steps: each answer read back from the journal, or asked for once.

A recorded answer whose request fingerprint still matches is handed back (counted as
saved); a changed request is ``ReplayDivergence``. A new one is checked against the
budget (``_Pass.check_budget``), asked under the step's idempotency key, checked,
counted and recorded with the pass's next commit. Streamed, its deltas are shown as
they come, and the attempt's marker is written beside the stream, never before a delta.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from . import budget as budgets
from . import step_ids
from ._canonical import fingerprint, model_key
from .errors import AsientoError, DuplicateRecord, ReplayDivergence
from .events import ModelStep, Phase, StepEvent
from .ledger import cost_of
from .model import ConversationPrefix, Message, ModelRequest, ModelResponse, check_response
from .payloads import ModelResult, StreamAttempt
from .replay import tool_drift
from .streaming import (
    Delta,
    StreamEvent,
    StreamingGateway,
    StreamRestart,
    TextPart,
    ToolCallPart,
    whole_parts,
)
from .tools import Tool

if TYPE_CHECKING:
    from .agent import _Pass

log = logging.getLogger("asiento")


class ModelSteps:
    """The model steps of one pass (``_Pass``), on its conversation, journal and trace."""

    def __init__(self, pass_: _Pass, *, streaming: bool = False) -> None:
        self.pass_ = pass_
        self.streaming = streaming
        self.restarted = False  # whether this pass announced its first asked step
        self.budget_noted = False  # this pass recorded its budget in force (``ModelResult``)

    async def _model_step(self, step_id: str) -> ModelResponse:
        fp = self.pass_.chain.value[:32]
        recorded = self.pass_.journal.get(step_id, {}).get(Phase.RESULT)
        if recorded is not None:
            response = self._replay_model(step_id, fp, recorded)
        else:
            budget = await self.pass_.check_budget(step_id)
            response = await self._call_model(step_id, fp, budget)
        self.pass_.add(
            Message(role="assistant", content=response.text, tool_calls=response.tool_calls)
        )
        return response

    async def answer(self, step_id: str) -> AsyncGenerator[StreamEvent | ModelResponse, None]:
        """The model step's answer, last; streamed, its deltas before it."""
        if self.streaming:
            async with contextlib.aclosing(self._streamed_model_step(step_id)) as streamed:
                async for item in streamed:
                    yield item
        else:
            yield await self._model_step(step_id)

    async def _streamed_model_step(
        self, step_id: str
    ) -> AsyncGenerator[StreamEvent | ModelResponse, None]:
        """``_model_step`` showing the answer as it comes; the response last.

        A recorded answer is shown whole, marked replayed. Nothing is written before
        the first delta: the step is durable only when its complete answer is.
        """
        fp = self.pass_.chain.value[:32]
        recorded = self.pass_.journal.get(step_id, {}).get(Phase.RESULT)
        attempt = self._attempt()
        if recorded is not None:
            response = self._replay_model(step_id, fp, recorded)
            for part in whole_parts(response):
                yield Delta(
                    run_id=self.pass_.run_id,
                    step_id=step_id,
                    attempt=attempt,
                    part=part,
                    replayed=True,
                )
        else:
            budget = await self.pass_.check_budget(step_id)
            if attempt > 1 and not self.restarted:  # an earlier pass may have been cut here
                self.restarted = True
                yield StreamRestart(run_id=self.pass_.run_id, step_id=step_id, attempt=attempt)
            key, request = self._request(step_id, fp)
            gateway = self.pass_.session.gateway
            with self.pass_.trace.asking(step_id, gateway, request):
                if isinstance(gateway, StreamingGateway):
                    answer: object = None
                    marking = _Marker(self.pass_, step_id, attempt)
                    stream = gateway.stream(request, idempotency_key=key)
                    try:
                        async for item in stream:
                            if isinstance(item, TextPart | ToolCallPart):
                                yield Delta(
                                    run_id=self.pass_.run_id,
                                    step_id=step_id,
                                    attempt=attempt,
                                    part=item,
                                )
                                marking.start()  # after the delta is shown: never before it
                            else:
                                answer = item
                    finally:
                        await _closed(stream)  # a cut read closes the provider's stream now
                        await marking.done()
                    response = self._took(step_id, fp, key, answer, budget)
                else:  # a gateway that cannot stream: its whole answer is one delta per part
                    answer = await gateway.complete(request, idempotency_key=key)
                    response = self._took(step_id, fp, key, answer, budget)
            if not isinstance(gateway, StreamingGateway):
                for part in whole_parts(response):
                    yield Delta(
                        run_id=self.pass_.run_id, step_id=step_id, attempt=attempt, part=part
                    )
        self.pass_.add(
            Message(role="assistant", content=response.text, tool_calls=response.tool_calls)
        )
        yield response

    def _replay_model(self, step_id: str, fp: str, recorded: StepEvent) -> ModelResponse:
        result = ModelResult.from_json(recorded.payload)
        if result.fp != fp:
            drift = None
            if result.tools is not None:
                drift = tool_drift(result.tools, digests(self.pass_.agent.tools.values()))
            raise ReplayDivergence(
                self.pass_.run_id,
                step_id,
                drift
                or f"the recorded request has fingerprint {result.fp[:12]}…, "
                f"the resumed run would send {fp[:12]}…",
            )
        response = result.response
        self.pass_.spent.add(result)
        if self.pass_.first_time(step_id):  # a second walk replays what this pass counted
            stats = self.pass_.stats
            stats.model_calls_replayed += 1
            stats.input_tokens_saved += response.usage.input_tokens
            stats.output_tokens_saved += response.usage.output_tokens
            stats.cost_saved += result.cost or 0.0
        return response

    async def _call_model(
        self, step_id: str, fp: str, budget: budgets.Budget | None
    ) -> ModelResponse:
        key, request = self._request(step_id, fp)
        gateway = self.pass_.session.gateway
        with self.pass_.trace.asking(step_id, gateway, request):
            answer = await gateway.complete(request, idempotency_key=key)
            return self._took(step_id, fp, key, answer, budget)

    def _request(self, step_id: str, fp: str) -> tuple[str, ModelRequest]:
        """The step's idempotency key and the request the model is asked."""
        key = model_key(self.pass_.run_id, step_id, fp)
        messages = ConversationPrefix(self.pass_.messages, len(self.pass_.messages))  # never copied
        request = ModelRequest(
            instructions=self.pass_.agent.instructions,
            messages=messages,
            tools=self.pass_.agent.schemas,
        )
        return key, request

    def _where(self, step_id: str) -> str:
        return f"run {self.pass_.run_id!r} step {step_id!r}"

    def _took(
        self, step_id: str, fp: str, key: str, answer: object, budget: budgets.Budget | None
    ) -> ModelResponse:
        """Count and record what the gateway answered (checked: garbage is a UsageError)."""
        response = _with_call_ids(check_response(answer, where=self._where(step_id)), step_id)
        self.pass_.counted.add(step_id)
        stats = self.pass_.stats
        stats.model_calls += 1
        stats.input_tokens += response.usage.input_tokens
        stats.output_tokens += response.usage.output_tokens
        cost = cost_of(response.usage, response.model, self.pass_.session.prices)
        stats.cost += cost or 0.0
        repaid = 0 if response.kept else len(self.cut_attempts(step_id))
        stats.model_calls_repaid += repaid
        tools = self.pass_.agent.digests if step_id == step_ids.model(1) else None
        noted = None if budget is None or self.budget_noted else budget.limits()
        self.budget_noted = self.budget_noted or noted is not None
        result = ModelResult(
            fp=fp, response=response, cost=cost, repaid=repaid, tools=tools, budget=noted
        )
        self.pass_.spent.add(result)
        self.pass_.trace.answered(result)
        self.pass_.record(step_id, Phase.RESULT, result)
        self.pass_.waiting.append(
            ModelStep(
                run_id=self.pass_.run_id, step_id=step_id, response=response, idempotency_key=key
            )
        )
        return response

    def cut_attempts(self, step_id: str) -> list[str]:
        """Earlier passes' streamed attempts of ``step_id``: each a generation paid and cut."""
        mine = step_ids.streamed(step_id, self._attempt())
        return [a for a in self.pass_.cuts.get(step_id, ()) if a != mine]

    def _attempt(self) -> int:
        """This pass's attempt at a streamed step: its lease's fence (0 without one)."""
        lease = self.pass_.lease
        return 0 if lease is None else lease.token


class _Marker:
    """Writes a streamed attempt's marker while the stream goes on, never before a delta.

    The append runs beside the stream; it is awaited when the stream ends (however
    it ends), so the next record of the pass comes after it. A marker lost with the
    process (killed before it was durable) only makes a re-paid call go uncounted.
    """

    def __init__(self, run: _Pass, step_id: str, attempt: int) -> None:
        self.run, self.step_id, self.attempt = run, step_id, attempt
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.task is not None:
            return
        event = StepEvent(
            run_id=self.run.run_id,
            step_id=step_ids.streamed(self.step_id, self.attempt),
            phase=Phase.SUBMITTED,
            payload=StreamAttempt(attempt=self.attempt).to_json(),
        )
        self.task = asyncio.create_task(self.run.store.append(event, lease=self.run.lease))

    async def done(self) -> None:
        if self.task is None:
            return
        try:
            await asyncio.shield(self.task)
        except DuplicateRecord:
            pass  # the marker of this very pass, written by an earlier walk of it
        except AsientoError as exc:  # the stream's own outcome decides what happens next
            log.warning(
                "run %r: could not mark the streamed %s: %s", self.run.run_id, self.step_id, exc
            )


def digests(tools: Iterable[Tool]) -> dict[str, str]:
    """Each tool's name and a digest of its schema and source: what m1 records of them."""
    return {t.name: fingerprint([t.schema.to_json(), t.source])[:16] for t in tools}


def _with_call_ids(response: ModelResponse, step_id: str) -> ModelResponse:
    """Give every tool call an id, so tool results can name the call they answer."""
    if all(c.id for c in response.tool_calls):
        return response
    calls = [
        c if c.id else replace(c, id=step_ids.tool(step_id, i))
        for i, c in enumerate(response.tool_calls, 1)
    ]
    return replace(response, tool_calls=calls)


async def _closed(stream: AsyncIterator[object]) -> None:
    """Close a gateway's stream (an async generator, or any iterator with ``aclose``)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
