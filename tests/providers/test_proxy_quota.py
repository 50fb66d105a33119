"""``asiento gateway`` with limits: what it relays upstream, every client together, is capped.

The upstream is ``CountingProvider`` on 127.0.0.1; the clients are the official
SDKs, each with its own API key (so its own key scope in the proxy).
"""

from __future__ import annotations

import asyncio
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asiento import Quota
from asiento.proxy import create_app

from .fake_servers import Answer, AsgiServer, CountingProvider, FakeProvider

CLIENTS = 4
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture
def upstream() -> Iterator[CountingProvider]:
    with CountingProvider(crowd=2, hold=0.05) as server:
        yield server


async def _through(url: str, calls: int, **params: Any) -> None:
    """``calls`` keyed requests at once from ``CLIENTS`` SDK clients (tenants) via the proxy."""
    import openai

    clients = [
        openai.AsyncOpenAI(base_url=url, api_key=f"sk-{i}", max_retries=0) for i in range(CLIENTS)
    ]
    try:
        await asyncio.gather(
            *(
                clients[i % CLIENTS].chat.completions.create(
                    model="m",
                    messages=HELLO,  # type: ignore[arg-type]
                    extra_headers={"Idempotency-Key": f"k{i}"},
                    **params,
                )
                for i in range(calls)
            )
        )
    finally:
        for client in clients:
            await client.close()


@pytest.mark.parametrize(("quota", "capped"), [(Quota(max_concurrent=2), True), (None, False)])
async def test_the_proxy_caps_requests_in_flight_upstream_across_clients(
    upstream: CountingProvider, tmp_path: Path, quota: Quota | None, capped: bool
) -> None:
    """40 requests from 4 tenants at once: with max_concurrent=2 upstream never holds more
    than 2; without limits (the control) it does."""
    app = create_app(upstream.url + "/v1", db=tmp_path / "keys.db", quota=quota)
    with AsgiServer(app) as proxy:
        await _through(proxy.url + "/v1", 40)
    assert upstream.served == 40
    assert (upstream.most <= 2) is capped


async def test_the_proxy_paces_requests_per_minute_over_its_window(
    upstream: CountingProvider, tmp_path: Path
) -> None:
    """requests_per_minute=120 over window=1.5 s: 3 per window reach upstream, no 4 of
    them closer than half a window (upstream's clock)."""
    quota = Quota(requests_per_minute=120, window=1.5)
    app = create_app(upstream.url + "/v1", db=tmp_path / "keys.db", quota=quota)
    with AsgiServer(app) as proxy:
        await _through(proxy.url + "/v1", 9)
    assert upstream.served == 9
    times = [t for t, _, _ in upstream.arrivals]
    assert all(later - first >= 0.75 for first, later in zip(times, times[3:], strict=False))


async def test_the_proxy_reserves_estimated_tokens_and_keeps_the_usage(
    upstream: CountingProvider, tmp_path: Path
) -> None:
    """tokens_per_minute=2500, requests reckoned at ~1020 tokens (max_tokens=1000): never 3
    upstream at once, yet all 30 within the minute, each corrected to its billed usage."""
    quota = Quota(tokens_per_minute=2500)
    app = create_app(upstream.url + "/v1", db=tmp_path / "keys.db", quota=quota)
    with AsgiServer(app) as proxy:
        await _through(proxy.url + "/v1", 30, max_tokens=1000)
    assert upstream.served == 30
    assert upstream.most <= 2


def test_asiento_gateway_takes_the_limits_on_its_command_line(
    upstream: CountingProvider, tmp_path: Path
) -> None:
    """``asiento gateway --max-concurrent 2`` (a real process) caps what it sends upstream."""
    argv = [sys.executable, "-m", "asiento", "gateway", "--upstream", upstream.url + "/v1"]
    argv += ["--db", str(tmp_path / "keys.db"), "--port", "0", "--max-concurrent", "2"]
    argv += ["--requests-per-minute", "100000", "--tokens-per-minute", "100000000"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        ready, _, _ = select.select([proc.stderr], [], [], 30)
        line = proc.stderr.readline() if ready else ""
        assert "asiento gateway: http://" in line, line
        assert "max_concurrent=2" in line
        asyncio.run(_through(line.split()[2], 20))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    assert upstream.served == 20
    assert upstream.most <= 2


@pytest.mark.parametrize("option", ["--max-concurrent", "--requests-per-minute"])
def test_a_bad_limit_on_the_command_line_names_the_option(option: str, tmp_path: Path) -> None:
    """``--max-concurrent 0``: a usage error naming the option; no proxy starts."""
    argv = [sys.executable, "-m", "asiento", "gateway", "--db", str(tmp_path / "k.db")]
    proc = subprocess.run(
        [*argv, option, "0"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode != 0
    assert f"Invalid value for '{option}'" in proc.stderr
    assert not (tmp_path / "k.db").exists()


@pytest.mark.parametrize("stream_key", [None, "k-stream"])  # passed through, or recorded
async def test_a_stream_holds_its_place_in_flight_until_it_ends(
    tmp_path: Path, stream_key: str | None
) -> None:
    """max_concurrent=1: while a stream is open, a second request does not go upstream;
    once the stream ends, its place is given back and the request goes."""
    import openai

    with FakeProvider((Answer(text="streamed"), Answer(text="after"))) as provider:
        app = create_app(provider.openai_url, db=tmp_path / "keys.db", quota=Quota(1))
        go_on = provider.hold_stream()
        try:
            with AsgiServer(app) as proxy:
                client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k")
                async with client:
                    stream = await client.chat.completions.create(
                        model="m",
                        messages=HELLO,
                        stream=True,  # type: ignore[arg-type]
                        extra_headers={"Idempotency-Key": stream_key} if stream_key else None,
                    )
                    chunks = stream.__aiter__()
                    async with asyncio.timeout(15):
                        await chunks.__anext__()  # the stream is open, upstream holds the rest
                    waiting = asyncio.create_task(
                        client.chat.completions.create(
                            model="m",
                            messages=HELLO,  # type: ignore[arg-type]
                            extra_headers={"Idempotency-Key": "k-after"},
                        )
                    )
                    await asyncio.sleep(0.3)
                    assert len(provider.requests) == 1
                    assert not waiting.done()
                    go_on.set()
                    _ = [chunk async for chunk in chunks]
                    async with asyncio.timeout(15):
                        answer = await waiting
        finally:
            go_on.set()
    assert len(provider.requests) == 2
    assert answer.choices[0].message.content == "streamed"  # turn 0 again: a fresh request
