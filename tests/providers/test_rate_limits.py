"""asiento's 429 policy over real HTTP, with the official clients and a real SQLite journal.

A 429 is retried by asiento (not the SDK) after what ``retry-after`` says, with
the same key and the same bytes; the retries are counted in the model step's
record and shown by ``asiento show``; spent, they are ``RateLimited`` with
nothing recorded or paid; each retry takes its place in the ``Quota`` again.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asiento import (
    FinalStep,
    ModelRequest,
    ModelResponse,
    Quota,
    RateLimited,
    RateLimitPolicy,
    UsageError,
    shutdown,
)
from asiento.gateways import AnthropicGateway, ModelUnavailable, OpenAIGateway
from asiento.gateways.rate_limit import retry_after
from asiento.model import Message

from .fake_servers import Answer, FakeProvider
from .test_openai import RUN, drive, journal, model_results

SCRIPT = (Answer(text="done"),)
FAST = RateLimitPolicy(retries=3, backoff=0.01)
REQUEST = ModelRequest(messages=(Message(role="user", content="hi"),))


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    with FakeProvider(SCRIPT) as p:
        yield p


def make(kind: str, provider: FakeProvider, **options: Any) -> Any:
    """A gateway of ``kind`` whose SDK would itself retry a 429 twice (``max_retries=2``)."""
    if kind == "openai":
        return OpenAIGateway("gpt-test", base_url=provider.openai_url, api_key="k", **options)
    return AnthropicGateway("claude-test", base_url=provider.anthropic_url, api_key="k", **options)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_a_429_is_retried_with_the_same_key_and_bytes_and_counted_in_the_step(
    kind: str, provider: FakeProvider, tmp_path: Path
) -> None:
    """Three 429s (one more than the SDK's max_retries=2) are retried by asiento: four
    requests, one key, byte-identical bodies, each a first try for the SDK; the step's
    record says 3, and ``asiento show`` says so."""
    provider.fail_next(3, 429)
    async with make(kind, provider, rate_limits=FAST) as gw:
        steps = await drive(gw, tmp_path / "runs.db")
    assert isinstance(steps[-1], FinalStep)
    tried = provider.requests
    assert len(tried) == 4
    assert len({r.key for r in tried}) == 1
    assert len({r.raw for r in tried}) == 1
    assert {r.headers.get("x-stainless-retry-count") for r in tried} == {"0"}
    assert provider.billed() == 1
    recorded = model_results(await journal(tmp_path / "runs.db"))["m1"]
    assert recorded["response"]["rate_limited"] == 3
    shown = subprocess.run(
        [sys.executable, "-m", "asiento", "show", RUN, "--store", str(tmp_path / "runs.db")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=os.environ | {"COLUMNS": "200"},
    )
    assert shown.returncode == 0, shown.stderr
    assert "3 retried after 429" in shown.stdout


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_spent_retries_are_rate_limited_with_nothing_recorded_or_paid(
    kind: str, provider: FakeProvider, tmp_path: Path
) -> None:
    """retries=2 and 429s without end: three requests, then RateLimited (a ModelUnavailable,
    status 429); m1 has no record and nothing was billed; resumed later, it is answered under
    the same key, with no retries counted."""
    provider.fail_next(10, 429)
    policy = RateLimitPolicy(retries=2, backoff=0.01)
    async with make(kind, provider, rate_limits=policy) as gw:
        with pytest.raises(RateLimited) as caught:
            await drive(gw, tmp_path / "runs.db")
        assert isinstance(caught.value, ModelUnavailable)
        assert caught.value.status == 429
        assert caught.value.retries == 2
        assert "429" in str(caught.value)
        assert RUN in str(caught.value)
        assert len(provider.requests) == 3
        assert provider.billed() == 0
        assert "m1" not in model_results(await journal(tmp_path / "runs.db"))
        provider._knobs.failures.clear()
        steps = await drive(gw, tmp_path / "runs.db")
    assert isinstance(steps[-1], FinalStep)
    assert len({r.key for r in provider.requests}) == 1
    recorded = model_results(await journal(tmp_path / "runs.db"))["m1"]
    assert "rate_limited" not in recorded["response"]


async def test_retry_after_is_waited_for(provider: FakeProvider) -> None:
    """``retry-after: 1`` (seconds): the retry reaches the server no sooner (its clock)."""
    provider.fail_next(1, 429, {"retry-after": "1"})
    async with make("openai", provider, rate_limits=FAST) as gw:
        answer = await gw.complete(REQUEST, idempotency_key="run:m1:f")
    assert answer.rate_limited == 1
    first, second = provider.requests
    assert second.at - first.at >= 0.9


async def test_a_shutdown_ends_the_wait_before_a_429s_retry(provider: FakeProvider) -> None:
    """The provider refused the request and asked for 60 s: nothing is in flight, so a
    shutdown ends the wait at once, and the refused request is not sent again."""
    provider.fail_next(1, 429, {"retry-after": "60"})
    shutdown.reset()
    try:
        async with make("openai", provider, rate_limits=FAST) as gw:
            asking = asyncio.create_task(gw.complete(REQUEST, idempotency_key="run:m1:f"))
            async with asyncio.timeout(10):
                while len(provider.requests) < 1:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            shutdown.request()
            async with asyncio.timeout(10):  # before the fix: the whole 60 s
                with pytest.raises(shutdown.ShutdownRequested, match="retry a 429"):
                    await asking
    finally:
        shutdown.reset()
    assert len(provider.requests) == 1


def test_the_wait_follows_retry_after_ms_then_retry_after_and_is_capped() -> None:
    """retry-after-ms wins, then retry-after (seconds or a date); never past max_wait;
    without either, the back-off doubles (with jitter)."""
    policy = RateLimitPolicy(max_wait=30.0, backoff=1.0)
    assert policy.wait(0, {"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert policy.wait(0, {"retry-after": "3"}) == 3.0
    assert policy.wait(0, {"retry-after": "3600"}) == 30.0
    assert 0.75 <= policy.wait(0, {}) <= 1.0
    assert 1.5 <= policy.wait(1, {}) <= 2.0
    assert policy.wait(9, {}) == 30.0
    assert retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) is not None
    assert retry_after({"retry-after": "soon"}) is None


async def test_a_retried_429_waits_for_the_quota_like_a_first_request(
    provider: FakeProvider,
) -> None:
    """requests_per_minute=2: a request refused twice does not send a third time this
    minute; the retry waits in the quota (and, cancelled there, sends nothing)."""
    provider.fail_next(5, 429)
    async with make("openai", provider, rate_limits=FAST, quota=Quota(requests_per_minute=2)) as gw:
        call = asyncio.create_task(gw.complete(REQUEST, idempotency_key="run:m1:f"))
        async with asyncio.timeout(20):
            while len(provider.requests) < 2:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert len(provider.requests) == 2
        assert not call.done()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call


def test_the_record_of_a_step_without_the_field_reads_as_no_retries() -> None:
    """Records written before the field existed read as 0, and 0 is not written."""
    old = ModelResponse.from_json({"text": "hi", "usage": [3, 4]})
    assert old.rate_limited == 0
    assert "rate_limited" not in old.to_json()
    assert ModelResponse.from_json({"text": "hi", "rate_limited": 2}).rate_limited == 2


@pytest.mark.parametrize(
    "bad", [{"retries": -1}, {"retries": 1.5}, {"backoff": 0}, {"max_wait": -1.0}]
)
def test_a_bad_policy_is_a_usage_error_that_names_it(bad: dict[str, Any]) -> None:
    """Each bad value is refused with the parameter's name in the message."""
    (name,) = bad
    with pytest.raises(UsageError, match=name):
        RateLimitPolicy(**bad)
