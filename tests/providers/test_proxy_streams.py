"""``asiento gateway`` records a keyed stream to its end and replays it to the same key.

The provider is ``FakeProvider`` on 127.0.0.1 streaming each API's own events;
the clients are the official ``openai`` and ``anthropic`` SDKs' streaming calls,
unchanged. A stream is billed once per key however many clients ask for it, go
away mid-stream or join it while it is still coming.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from .fake_servers import AsgiServer, FakeProvider
from .test_proxy import HELLO, make_proxy, provider, proxy, stats
from .test_proxy_leases import keys_kept, until

__all__ = ["make_proxy", "provider", "proxy"]  # fixtures, used by name

KINDS = ("chat", "responses", "anthropic")
TOOL = {"type": "object", "properties": {"path": {"type": "string"}}}


@contextlib.asynccontextmanager
async def open_stream(
    server: AsgiServer, kind: str, key: str | None, *, max_retries: int = 0
) -> AsyncIterator[Any]:
    """A ``stream=True`` call of ``kind`` with the official client (its raw response)."""
    headers = {"Idempotency-Key": key} if key else {}
    if kind == "anthropic":
        a = anthropic.AsyncAnthropic(api_key="k", base_url=server.url, max_retries=max_retries)
        async with a, a.messages.with_streaming_response.create(
            model="claude-test", max_tokens=64, messages=HELLO, stream=True, extra_headers=headers,
            tools=[{"name": "read", "description": "read", "input_schema": TOOL}],
        ) as response:  # fmt: skip
            yield response
        return
    o = openai.AsyncOpenAI(api_key="k", base_url=server.url + "/v1", max_retries=max_retries)
    if kind == "responses":
        async with o, o.responses.with_streaming_response.create(
            model="gpt-test", input=HELLO, stream=True, extra_headers=headers,
            tools=[{"type": "function", "name": "read", "parameters": TOOL, "strict": False}],
        ) as response:  # fmt: skip
            yield response
        return
    async with (
        o,
        o.chat.completions.with_streaming_response.create(
            model="gpt-test", messages=HELLO, stream=True, extra_headers=headers
        ) as response,
    ):
        yield response


async def events(server: AsgiServer, kind: str, key: str | None) -> tuple[Any, list[Any]]:
    """One streamed call read to its end: its headers and every event, as the SDK parsed it."""
    async with open_stream(server, kind, key) as response:
        return response.headers, [e.model_dump() async for e in await response.parse()]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_keyed_stream_is_recorded_and_replayed_as_the_same_events(
    proxy: AsgiServer, provider: FakeProvider, tmp_path: Path, kind: str
) -> None:
    first_headers, first = await events(proxy, kind, "k-stream")
    second_headers, second = await events(proxy, kind, "k-stream")
    assert provider.billed("k-stream") == 1
    assert second == first
    assert len(first) > 3  # a real stream, event by event
    assert first_headers["asiento-gateway"] == "recorded-stream"
    assert second_headers["idempotent-replayed"] == "true"
    assert "text/event-stream" in second_headers["content-type"]
    assert keys_kept(tmp_path / "keys.db") == [("k-stream", "done")]
    assert stats(proxy).streams_recorded == 1
    assert provider.problems == []


async def test_a_stream_without_a_key_is_passed_through_unrecorded(
    proxy: AsgiServer, provider: FakeProvider, tmp_path: Path
) -> None:
    first_headers, _ = await events(proxy, "chat", None)
    await events(proxy, "chat", None)
    assert first_headers["asiento-gateway"] == "passthrough-stream"
    assert provider.billed() == 2
    assert keys_kept(tmp_path / "keys.db") == []


async def test_the_client_sees_the_stream_while_upstream_still_generates_it(
    proxy: AsgiServer, provider: FakeProvider, tmp_path: Path
) -> None:
    """The first event arrives before upstream sends the rest; the key is claimed meanwhile."""
    go_on = provider.hold_stream()
    try:
        async with contextlib.AsyncExitStack() as stack:
            async with asyncio.timeout(15):  # upstream holds the rest for up to 30 s
                response = await stack.enter_async_context(open_stream(proxy, "chat", "k"))
                chunks = (await response.parse()).__aiter__()
                first = await chunks.__anext__()
            while_streaming = keys_kept(tmp_path / "keys.db")
            go_on.set()
            rest = [chunk async for chunk in chunks]
    finally:
        go_on.set()
    assert first.choices[0].delta.role == "assistant"
    assert while_streaming == [("k", "in_flight")]
    assert rest[-1].usage is not None
    await until(lambda: keys_kept(tmp_path / "keys.db") == [("k", "done")])


async def test_a_client_gone_mid_stream_does_not_stop_the_recording(
    proxy: AsgiServer, provider: FakeProvider
) -> None:
    go_on = provider.hold_stream()
    try:
        async with asyncio.timeout(15), open_stream(proxy, "anthropic", "k-gone") as response:
            stream = (await response.parse()).__aiter__()
            await stream.__anext__()  # one event, then the client goes away
    finally:
        go_on.set()
    await until(lambda: stats(proxy).streams_recorded == 1)
    headers, replayed = await events(proxy, "anthropic", "k-gone")
    assert headers["idempotent-replayed"] == "true"
    assert replayed[-1]["type"] == "message_stop"
    assert provider.billed("k-gone") == 1


async def test_a_request_for_a_stream_still_coming_attaches_to_it(
    proxy: AsgiServer, provider: FakeProvider
) -> None:
    """The second client gets the events so far at once, then the rest live; one generation."""
    go_on = provider.hold_stream()
    try:
        async with contextlib.AsyncExitStack() as stack:
            async with asyncio.timeout(15):
                one = await stack.enter_async_context(open_stream(proxy, "responses", "k-join"))
                first_stream = (await one.parse()).__aiter__()
                first_event = await first_stream.__anext__()
                two = await stack.enter_async_context(open_stream(proxy, "responses", "k-join"))
                second_stream = (await two.parse()).__aiter__()
                joined_event = await second_stream.__anext__()  # while upstream still holds
            go_on.set()
            first = [first_event] + [e async for e in first_stream]
            second = [joined_event] + [e async for e in second_stream]
    finally:
        go_on.set()
    assert two.headers["asiento-gateway"] == "attached-stream"
    assert [e.model_dump() for e in second] == [e.model_dump() for e in first]
    assert first[-1].type == "response.completed"
    assert provider.billed("k-join") == 1
    assert stats(proxy).streams_attached == 1


async def test_a_stream_cut_upstream_is_not_kept_and_a_retry_asks_again(
    proxy: AsgiServer, provider: FakeProvider, tmp_path: Path
) -> None:
    provider.cut_next_stream(before_event=3)
    with pytest.raises((httpx.HTTPError, openai.APIError)):
        await events(proxy, "chat", "k-cut")  # the client sees the cut, not an ended stream
    await until(lambda: keys_kept(tmp_path / "keys.db") == [])
    _, again = await events(proxy, "chat", "k-cut")
    assert again[-1]["usage"] is not None
    assert provider.billed("k-cut") == 2  # the cut generation was billed; nothing to replay


async def test_an_error_answer_to_a_stream_passes_through_and_releases_the_key(
    proxy: AsgiServer, provider: FakeProvider, tmp_path: Path
) -> None:
    provider.fail_next(1, 500)
    with pytest.raises(openai.InternalServerError):
        await events(proxy, "chat", "k-err")
    assert keys_kept(tmp_path / "keys.db") == []
    _, answer = await events(proxy, "chat", "k-err")
    assert answer[-1]["usage"] is not None


async def test_the_claim_of_a_stream_is_renewed_while_upstream_streams(
    make_proxy: Callable[..., AsgiServer], provider: FakeProvider
) -> None:
    """Past the claim's lease, a rival proxy on the same key store waits, then replays."""
    lease = 1.0
    one, rival = make_proxy(lease=lease), make_proxy(lease=lease)
    go_on = provider.hold_stream()
    release = threading.Timer(3 * lease, go_on.set)
    release.start()
    try:
        async with asyncio.timeout(30), open_stream(one, "chat", "k-long") as response:
            stream = (await response.parse()).__aiter__()
            await stream.__anext__()
            await asyncio.sleep(1.5 * lease)  # the claim's first lease is over; its holder lives
            rival_headers, rival_events = await events(rival, "chat", "k-long")
            first = [e async for e in stream]
    finally:
        release.cancel()
        go_on.set()
    assert provider.billed("k-long") == 1
    assert rival_headers["idempotent-replayed"] == "true"
    assert rival_events[-1]["usage"] == first[-1].model_dump()["usage"]


_CHUNK = b'data: {"id":"c1","object":"chat.completion.chunk","model":"gpt-test","choices":'
ILL_FORMED = {
    "no finish reason": _CHUNK + b'[{"index":0,"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n',
    "an event that is not JSON": _CHUNK + b'[{"index":0,"delta":{"content":"hi"},'
    b'"finish_reason":"stop"}]}\n\ndata: {"choices": [\n\ndata: [DONE]\n\n',
    "the end marker inside the text": _CHUNK + b'[{"index":0,"delta":{"content":"a\\n\\n'
    b'data: [DONE]\\n\\n"}}]}\n\ndata: [DONE]\n\n',
}


@pytest.mark.parametrize("body", list(ILL_FORMED.values()), ids=list(ILL_FORMED))
async def test_a_stream_the_gateways_would_refuse_is_not_kept(
    proxy: AsgiServer, provider: FakeProvider, tmp_path: Path, body: bytes
) -> None:
    """Upstream ends with [DONE] but no gateway could record the answer: the key is
    released, not kept for its lifetime, and the retry asks upstream again."""
    provider.garble_next(body)
    async with open_stream(proxy, "chat", "k-ill") as response:
        await response.read()
    await until(lambda: keys_kept(tmp_path / "keys.db") == [])
    _, again = await events(proxy, "chat", "k-ill")
    assert again[-1]["usage"] is not None
    assert provider.billed("k-ill") == 2
