"""Quota: one object shared by many gateways caps requests in flight at a real server."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from asiento import ModelRequest, Quota, UsageError
from asiento.gateways import AnthropicGateway, OpenAIGateway
from asiento.model import Message

CALLS = 200
CAP = 8
HOLD = 0.02  # seconds a request waits for more company before answering (bounded)


class _Server(ThreadingHTTPServer):
    request_queue_size = 512  # a burst of CALLS connections is not refused by the backlog
    daemon_threads = True


class CountingServer:
    """Answers chat and messages requests; records the most requests it held at once."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.most = 0
        self.served = 0
        self._cond = threading.Condition()
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def enter(self) -> None:
        with self._cond:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            self._cond.notify_all()
            # wait (bounded) until more than CAP are in flight, so an uncapped burst shows
            self._cond.wait_for(lambda: self.in_flight > CAP, timeout=HOLD)

    def leave(self) -> None:
        with self._cond:
            self.in_flight -= 1
            self.served += 1


def _handler(server: CountingServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", "0")))
            server.enter()
            try:
                body = json.dumps(_answer(self.path)).encode()
            finally:
                server.leave()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def _answer(path: str) -> dict[str, Any]:
    if path.endswith("/messages"):
        return {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
    return {
        "id": "c1",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


@pytest.fixture
def server() -> Iterator[CountingServer]:
    s = CountingServer()
    s.thread.start()
    yield s
    s.server.shutdown()
    s.server.server_close()


def _client(kind: str, url: str) -> Any:
    """One SDK client for the burst (making 200 clients costs seconds, not what is tested)."""
    if kind == "openai":
        import openai

        return openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    import anthropic

    return anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)


async def _burst(kind: str, url: str, quota: Quota | None, calls: int = CALLS) -> None:
    """``calls`` requests at once, each through its own gateway (factories make one per run)."""
    client = _client(kind, url)
    make = OpenAIGateway if kind == "openai" else AnthropicGateway
    gateways = [make("m", client=client, quota=quota) for _ in range(calls)]
    request = ModelRequest(messages=(Message(role="user", content="hi"),))
    try:
        await asyncio.gather(
            *(g.complete(request, idempotency_key=f"k{i}") for i, g in enumerate(gateways))
        )
    finally:
        await client.close()


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_one_quota_caps_requests_in_flight_across_gateways(
    server: CountingServer, kind: str
) -> None:
    await _burst(kind, server.url, Quota(max_concurrent=CAP))
    assert server.served == CALLS
    assert server.most <= CAP


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_without_a_quota_the_burst_exceeds_the_cap(server: CountingServer, kind: str) -> None:
    await _burst(kind, server.url, None)
    assert server.served == CALLS
    assert server.most > CAP


def test_one_quota_serves_event_loops_one_after_another(server: CountingServer) -> None:
    quota = Quota(max_concurrent=CAP)
    for _ in range(2):
        asyncio.run(_burst("openai", server.url, quota, calls=40))
    assert server.served == 2 * 40
    assert server.most <= CAP


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_a_bad_max_concurrent_is_a_usage_error(bad: Any) -> None:
    with pytest.raises(UsageError, match="max_concurrent"):
        Quota(max_concurrent=bad)


async def test_a_429_is_retried_with_the_same_key_and_body_and_exhausted_is_unavailable() -> None:
    """Today's 429 policy (the SDK's retries, honouring retry-after-ms) under a quota."""
    from asiento.gateways import ModelUnavailable

    from .fake_servers import Answer, FakeProvider

    request = ModelRequest(messages=(Message(role="user", content="hi"),))
    with FakeProvider([Answer(text="ok"), Answer(text="ok")]) as provider:
        async with OpenAIGateway(
            "m", base_url=provider.openai_url, api_key="k", max_retries=2, quota=Quota(1)
        ) as gw:
            provider.fail_next(2, 429)
            await gw.complete(request, idempotency_key="run:m1:abc")
            tried = provider.requests[:3]
            assert {r.key for r in tried} == {"run:m1:abc"}
            assert len({json.dumps(r.body, sort_keys=True) for r in tried}) == 1
            assert len({r.size for r in tried}) == 1
            provider.fail_next(3, 429)
            with pytest.raises(ModelUnavailable) as caught:
                await gw.complete(request, idempotency_key="run:m2:def")
    assert caught.value.status == 429
