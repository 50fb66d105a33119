"""Quota: one object shared by many gateways limits what reaches a real server.

Requests in flight, requests per minute and tokens per minute, counted by the
server (``CountingProvider`` on 127.0.0.1) that the official clients talk to.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from asiento import (
    Agent,
    FinalStep,
    ModelRequest,
    Quota,
    RunStatus,
    Session,
    SqliteCheckpointer,
    UsageError,
    shutdown,
)
from asiento.gateways import AnthropicGateway, OpenAIGateway
from asiento.gateways.quota import estimate_tokens
from asiento.model import Message

from .fake_servers import CountingProvider

CALLS = 200
CAP = 8
GRACE = 0.3  # seconds a held request is given to show up at the server if it wrongly could
REQUEST = ModelRequest(messages=(Message(role="user", content="hi"),))


@pytest.fixture
def server() -> Iterator[CountingProvider]:
    with CountingProvider(crowd=CAP) as s:
        yield s


def _client(kind: str, url: str) -> Any:
    """One SDK client for the burst (making 200 clients costs seconds, not what is tested)."""
    if kind == "openai":
        import openai

        return openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    import anthropic

    return anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)


def _gateway(kind: str, client: Any, quota: Quota | None, **options: Any) -> Any:
    if kind == "openai":
        return OpenAIGateway("m", client=client, quota=quota, options=options)
    return AnthropicGateway("m", client=client, quota=quota, **options)


async def _burst(kind: str, url: str, quota: Quota | None, calls: int = CALLS, **kw: Any) -> None:
    """``calls`` requests at once, each through its own gateway (factories make one per run)."""
    client = _client(kind, url)
    gateways = [_gateway(kind, client, quota, **kw) for _ in range(calls)]
    try:
        await asyncio.gather(
            *(g.complete(REQUEST, idempotency_key=f"r{i}:m1:f") for i, g in enumerate(gateways))
        )
    finally:
        await client.close()


async def _until(condition: Any, timeout: float = 20.0) -> None:
    """Wait on the loop (bounded) until ``condition()`` holds."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_one_quota_caps_requests_in_flight_across_gateways(
    server: CountingProvider, kind: str
) -> None:
    """200 gateways sharing Quota(max_concurrent=8) never have more than 8 at the server."""
    await _burst(kind, server.url, Quota(max_concurrent=CAP))
    assert server.served == CALLS
    assert server.most <= CAP


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_without_a_quota_the_burst_exceeds_the_cap(
    server: CountingProvider, kind: str
) -> None:
    """The control: without a quota the same burst puts more than 8 in flight."""
    await _burst(kind, server.url, None)
    assert server.served == CALLS
    assert server.most > CAP


def test_one_quota_serves_event_loops_one_after_another(server: CountingProvider) -> None:
    """A quota made once serves every event loop the process runs in turn."""
    quota = Quota(max_concurrent=CAP)
    for _ in range(2):
        asyncio.run(_burst("openai", server.url, quota, calls=40))
    assert server.served == 2 * 40
    assert server.most <= CAP


# -- requests per minute ------------------------------------------------------------------


async def _runs(kind: str, url: str, quota: Quota, db: Path, n: int) -> AsyncIterator[Any]:
    """``n`` runs at once on one SQLite journal, each with its own gateway; yields the tasks."""
    client = _client(kind, url)
    store = SqliteCheckpointer(db)
    agent = Agent(instructions="answer")

    async def one(i: int) -> list[Any]:
        session = Session(f"run-{i}", _gateway(kind, client, quota), store)
        return [step async for step in agent.run("hi", session=session)]

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    try:
        yield tasks
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await store.close()
        await client.close()


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_requests_per_minute_hold_the_runs_past_the_limit_without_blocking_the_loop(
    server: CountingProvider, kind: str, tmp_path: Path
) -> None:
    """12 runs sharing requests_per_minute=5: exactly 5 reach the server this minute, the
    other 7 wait on the loop (which keeps running) and, cancelled, never send anything."""
    quota = Quota(requests_per_minute=5)
    runs = _runs(kind, server.url, quota, tmp_path / "runs.db", 12)
    tasks = await anext(runs)
    try:
        await _until(lambda: sum(t.done() for t in tasks) == 5)
        ticks = 0
        for _ in range(int(GRACE / 0.01)):  # the loop turns while seven runs wait
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == int(GRACE / 0.01)
        assert server.arrived() == 5
        assert all(isinstance(t.result()[-1], FinalStep) for t in tasks if t.done())
        assert sum(not t.done() for t in tasks) == 7
    finally:
        await runs.aclose()
    await asyncio.sleep(GRACE)
    assert server.arrived() == 5  # the cancelled waiters sent nothing


async def test_requests_per_minute_are_counted_over_a_sliding_window(
    server: CountingProvider,
) -> None:
    """requests_per_minute=120 over window=1.5 s admits 3 per window: 9 calls arrive in
    groups, no 4 of them closer than half a window (the server's own clock)."""
    await _burst("openai", server.url, Quota(requests_per_minute=120, window=1.5), calls=9)
    assert server.served == 9
    times = [t for t, _, _ in server.arrivals]
    assert all(later - first >= 0.75 for first, later in zip(times, times[3:], strict=False))


# -- tokens per minute ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "output_limit"),
    [("openai", {"max_completion_tokens": 1000}), ("anthropic", {"max_tokens": 1000})],
)
async def test_tokens_per_minute_reserve_the_estimate_and_keep_the_usage(
    kind: str, output_limit: dict[str, int]
) -> None:
    """tokens_per_minute=2500 with requests reckoned at ~1020 tokens: never 3 in flight
    (3 estimates do not fit), yet all 30 are served within the minute, because each answer
    corrects its reservation to the 2 tokens the server billed."""
    with CountingProvider(crowd=2, hold=0.05) as server:
        await _burst(kind, server.url, Quota(tokens_per_minute=2500), calls=30, **output_limit)
    assert server.served == 30
    assert server.most <= 2


def test_the_estimate_is_the_body_over_four_plus_the_most_output() -> None:
    """The documented rule: characters of the JSON body / 4 (rounded up), plus the largest
    output limit the request sets."""
    params: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x" * 401}]}

    def chars(p: dict[str, Any]) -> int:
        return -(-len(json.dumps(p)) // 4)

    assert estimate_tokens(params) == chars(params)
    both = params | {"max_tokens": 1000, "max_completion_tokens": 10}
    assert estimate_tokens(both) == chars(both) + 1000
    responses = params | {"max_output_tokens": 500}
    assert estimate_tokens(responses) == chars(responses) + 500


async def test_a_cancelled_waiter_takes_no_tokens_and_a_settled_answer_gives_them_back() -> None:
    """A waiter cancelled in the queue holds nothing; a settle wakes the next waiter at once
    (without either, the last reservation would wait the rest of the minute)."""
    quota = Quota(tokens_per_minute=300)

    async def reserve(tokens: int) -> Any:
        async with quota.slot(tokens) as reservation:
            return reservation

    first = await reserve(200)
    cancelled = asyncio.create_task(reserve(200))
    waiting = asyncio.create_task(reserve(250))
    await asyncio.sleep(0.05)
    assert not cancelled.done()
    cancelled.cancel()
    await asyncio.sleep(0.05)  # the 250 is first in the queue now, and 200 + 250 > 300
    assert not waiting.done()
    first.settle(0)  # the answer cost nothing: 300 free again, and 250 fits
    async with asyncio.timeout(10):  # the window is 60 s: only the settle lets it in
        await waiting


@pytest.mark.parametrize(
    "bad",
    [
        {"max_concurrent": 0},
        {"max_concurrent": 1.5},
        {"max_concurrent": True},
        {"max_concurrent": "8"},
        {"requests_per_minute": 0},
        {"requests_per_minute": -5},
        {"tokens_per_minute": 2.5},
        {"tokens_per_minute": False},
        {"window": 0},
        {"window": "60"},
    ],
)
def test_a_bad_limit_is_a_usage_error_that_names_it(bad: dict[str, Any]) -> None:
    """Each bad value is refused with the parameter's name in the message."""
    (name,) = bad
    with pytest.raises(UsageError, match=name):
        Quota(**bad)


# -- shutdown -----------------------------------------------------------------------------


@pytest.fixture
def clean_shutdown() -> Iterator[None]:
    shutdown.reset()
    yield
    shutdown.reset()


@pytest.mark.parametrize("limit", [{"max_concurrent": 1}, {"requests_per_minute": 30, "window": 2}])
async def test_runs_waiting_in_a_quota_stop_at_a_shutdown_and_resume_later(
    server: CountingProvider, tmp_path: Path, limit: dict[str, Any], clean_shutdown: None
) -> None:
    """A wait in a quota started nothing, so it is not a step in flight: a shutdown
    ends it at once (``ShutdownRequested``), nothing reaches the server, the lease is
    given back, and the run resumes later and is answered once."""
    quota = Quota(**limit)
    client = _client("openai", server.url)
    store = SqliteCheckpointer(tmp_path / "runs.db")
    agent = Agent(instructions="answer")

    async def run() -> list[Any]:
        session = Session("waiting", _gateway("openai", client, quota), store)
        return [step async for step in agent.run("hi", session=session)]

    try:
        async with quota.slot():  # another run holds the only place this minute
            waiting = asyncio.create_task(run())
            await asyncio.sleep(GRACE)
            assert not waiting.done()
            shutdown.request()
            async with asyncio.timeout(10):  # before the fix: waits for the place, forever
                with pytest.raises(shutdown.ShutdownRequested, match="waiting in a Quota"):
                    await waiting
        assert server.arrived() == 0
        info = await store.run("waiting")
        assert info is not None
        assert info.status is RunStatus.RUNNING
        assert info.lease_owner is None  # given back: any worker may resume it
        shutdown.reset()
        resumed = await asyncio.wait_for(run(), 30)  # the window (2 s) may hold it still
        assert isinstance(resumed[-1], FinalStep)
        assert server.arrived() == 1
    finally:
        await store.close()
        await client.close()
