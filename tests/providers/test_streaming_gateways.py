"""OpenAIGateway and AnthropicGateway stream through the official clients' streaming calls.

``FakeProvider`` on 127.0.0.1 streams each API's own events. A streamed answer,
assembled, is the answer of the same call made without streaming; the parts reach
the caller while the provider still generates. The crash tests SIGKILL a child
process mid-stream and resume it, through ``asiento gateway`` and without it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from asiento import (
    Delta,
    ModelResponse,
    Session,
    SqliteCheckpointer,
    TextPart,
    ToolCallPart,
    step_ids,
)
from asiento.gateways import AnthropicGateway, ModelUnavailable, OpenAIGateway
from asiento.model import Message, ModelRequest, ToolSchema
from asiento.proxy import create_app

from .fake_servers import Answer, AsgiServer, FakeProvider
from .test_openai import INSTRUCTIONS, SCRIPT, TASK, agent, drive, journal, shape

KINDS = ("chat", "responses", "anthropic")
SCHEMA = ToolSchema(
    name="read",
    description="Read a file.",
    parameters={"type": "object", "properties": {"path": {"type": "string"}}},
)
REQUEST = ModelRequest(
    instructions=INSTRUCTIONS, messages=[Message(role="user", content="hi")], tools=[SCHEMA]
)
LONG = Answer(
    text="a long answer, streamed in many small pieces " * 3, calls=(("read", {"path": "/x"}),)
)


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    with FakeProvider([LONG, *SCRIPT]) as p:
        yield p


def gateway(kind: str, url: str, **options: Any) -> Any:
    if kind == "anthropic":
        return AnthropicGateway(
            "claude-test", base_url=url.removesuffix("/v1"), api_key="k", **options
        )
    return OpenAIGateway("gpt-test", api=kind, base_url=url, api_key="k", **options)  # type: ignore[arg-type]


def essence(r: ModelResponse) -> tuple[Any, ...]:
    """An answer without what the fake numbers per generation (ids; input from body size)."""
    u = r.usage
    calls = [(c.name, dict(c.arguments)) for c in r.tool_calls]
    return r.text, calls, r.model, u.output_tokens, u.cached_input_tokens, u.cache_write_tokens


async def streamed(gw: Any, key: str) -> tuple[list[Any], ModelResponse]:
    items = [item async for item in gw.stream(REQUEST, idempotency_key=key)]
    assert isinstance(items[-1], ModelResponse)
    return items[:-1], items[-1]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_streamed_answer_is_the_plain_answer(provider: FakeProvider, kind: str) -> None:
    provider.cache = (3, 2)  # cached tokens come in the stream's last events too
    async with gateway(kind, provider.openai_url) as gw:
        parts, answer = await streamed(gw, "run-1:m1:aaaa")
        plain = await gw.complete(REQUEST, idempotency_key="run-1:m1:bbbb")
    assert essence(answer) == essence(plain)
    assert answer.usage.cached_input_tokens == plain.usage.cached_input_tokens > 0
    assert answer.usage.input_tokens > 0
    assert "".join(p.text for p in parts if isinstance(p, TextPart)) == answer.text
    assert len([p for p in parts if isinstance(p, TextPart)]) > 3  # in pieces, as sent
    calls = [p for p in parts if isinstance(p, ToolCallPart)]
    assert calls[0].name == "read"
    assert calls[0].call_id == answer.tool_calls[0].id
    assert json.loads("".join(p.arguments for p in calls)) == {"path": "/x"}
    assert [r.key for r in provider.requests] == ["run-1:m1:aaaa", "run-1:m1:bbbb"]
    assert provider.requests[0].body["stream"] is True
    assert provider.problems == []


@pytest.mark.parametrize("kind", KINDS)
async def test_parts_arrive_while_the_provider_still_generates(
    provider: FakeProvider, kind: str
) -> None:
    # the stream stops after its first event that carries a part, until set
    go_on = provider.hold_stream(after={"chat": 1, "responses": 3, "anthropic": 2}[kind])
    try:
        async with gateway(kind, provider.openai_url) as gw:
            stream = gw.stream(REQUEST, idempotency_key="run-1:m1:cccc").__aiter__()
            async with asyncio.timeout(15):
                first = await stream.__anext__()  # the first part, while upstream waits
            held = provider.billed()
            go_on.set()
            rest = [item async for item in stream]
    finally:
        go_on.set()
    assert isinstance(first, TextPart | ToolCallPart)
    assert held == 1
    assert isinstance(rest[-1], ModelResponse)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_cut_stream_is_model_unavailable_and_returns_no_answer(
    provider: FakeProvider, kind: str
) -> None:
    provider.cut_next_stream(before_event=4)
    async with gateway(kind, provider.openai_url) as gw:
        seen: list[Any] = []

        async def read() -> None:
            async for item in gw.stream(REQUEST, idempotency_key="run-1:m1:dddd"):
                seen.append(item)

        with pytest.raises(ModelUnavailable):
            await read()
    assert seen  # parts came before the cut
    assert not any(isinstance(item, ModelResponse) for item in seen)


async def test_a_429_opening_a_stream_is_retried_with_the_same_key(provider: FakeProvider) -> None:
    from asiento.gateways import RateLimitPolicy

    provider.fail_next(1, 429)
    policy = RateLimitPolicy(retries=2, backoff=0.01)
    async with gateway("chat", provider.openai_url, rate_limits=policy) as gw:
        _, answer = await streamed(gw, "run-1:m1:eeee")
    assert [r.key for r in provider.requests] == ["run-1:m1:eeee"] * 2
    assert provider.requests[0].body == provider.requests[1].body
    assert answer.rate_limited == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_a_streamed_run_journals_what_a_plain_run_journals(tmp_path: Path, kind: str) -> None:
    with FakeProvider(SCRIPT) as one, FakeProvider(SCRIPT) as two:
        async with gateway(kind, one.openai_url) as gw:
            store = SqliteCheckpointer(tmp_path / "streamed.db")
            session = Session("run-1", gw, store)
            items = [i async for i in agent().run(TASK, session=session, stream=True)]
            await store.close()
        async with gateway(kind, two.openai_url) as gw:
            await drive(gw, tmp_path / "plain.db")
    streamed_events = await journal(tmp_path / "streamed.db")
    kept = [e for e in streamed_events if not step_ids.is_streamed(e.step_id)]
    assert shape(kept) == shape(await journal(tmp_path / "plain.db"))
    assert len(kept) < len(streamed_events)  # and one marker per streamed model step
    assert any(isinstance(i, Delta) and not i.replayed for i in items)


# -- a real process killed mid-stream ----------------------------------------------------

CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from asiento import Delta, Session, SqliteCheckpointer, StreamRestart, step_ids
    from asiento.gateways import OpenAIGateway
    from providers.test_openai import TASK, agent

    async def marked(db):
        # the streamed attempt's marker is written beside the stream: wait until it is
        # durable (read by another connection), so the kill cuts a marked attempt
        other = SqliteCheckpointer(db)
        for _ in range(250):
            if any(step_ids.is_streamed(e.step_id) for e in await other.load("run-1")):
                break
            await asyncio.sleep(0.02)
        await other.close()

    async def main(db, url, kill_after):
        async with OpenAIGateway("gpt-test", base_url=url, api_key="k", max_retries=0) as gw:
            store = SqliteCheckpointer(db)
            seen = 0
            async for item in agent().run(TASK, session=Session("run-1", gw, store), stream=True):
                if isinstance(item, StreamRestart):
                    print("restart", item.step_id, flush=True)
                if isinstance(item, Delta) and item.step_id == "m1" and item.text:
                    print("text", repr(item.text), flush=True)
                    seen += 1
                    if seen == kill_after:
                        await marked(db)
                        os.kill(os.getpid(), signal.SIGKILL)
            await store.close()
            print("closed", flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    """
)


def child(db: Path, url: str, kill_after: int) -> subprocess.CompletedProcess[str]:
    tests = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(db), url, str(kill_after)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip


def texts(out: str) -> str:
    return "".join(eval(line[5:]) for line in out.splitlines() if line.startswith("text "))


@pytest.fixture
def long_first() -> Iterator[FakeProvider]:
    """m1 streams a long text (and a tool call), then the usual script."""
    with FakeProvider([LONG, *SCRIPT[1:]]) as p:
        yield p


def test_killed_mid_stream_and_resumed_through_the_proxy_the_step_is_billed_once(
    long_first: FakeProvider, tmp_path: Path
) -> None:
    with ExitStack() as stack:
        proxy = stack.enter_context(
            AsgiServer(create_app(long_first.openai_url, db=tmp_path / "keys.db"))
        )
        url = proxy.url + "/v1"
        cut = child(tmp_path / "runs.db", url, kill_after=2)
        assert cut.returncode == -signal.SIGKILL, cut.stderr
        shown = texts(cut.stdout)
        resumed = child(tmp_path / "runs.db", url, kill_after=0)
        assert resumed.returncode == 0, resumed.stderr
    m1 = [k for k in long_first.generations if k and ":m1:" in k]
    assert len(m1) == 1  # the proxy read the cut stream to its end; the resume got it again
    assert resumed.stdout.splitlines()[0] == "restart m1"
    assert texts(resumed.stdout) == LONG.text  # the billed generation, whole
    assert LONG.text.startswith(shown)
    m1_result = asyncio.run(result_of(tmp_path / "runs.db", "m1"))
    assert m1_result["response"]["kept"] is True  # the proxy's kept generation
    assert "repaid" not in m1_result  # nothing was paid again


def test_killed_mid_stream_without_the_proxy_the_step_is_asked_again_after_a_restart(
    long_first: FakeProvider, tmp_path: Path
) -> None:
    cut = child(tmp_path / "runs.db", long_first.openai_url, kill_after=2)
    assert cut.returncode == -signal.SIGKILL, cut.stderr
    resumed = child(tmp_path / "runs.db", long_first.openai_url, kill_after=0)
    assert resumed.returncode == 0, resumed.stderr
    lines = resumed.stdout.splitlines()
    assert lines[0] == "restart m1"  # before the new attempt's first delta
    assert texts(resumed.stdout) == LONG.text
    m1 = [k for k in long_first.generations if k and ":m1:" in k]
    assert len(m1) == 2  # the cut generation was paid, and the step paid again
    assert m1[0] == m1[1]  # with the same key: a key-honouring provider would bill once
    assert asyncio.run(result_of(tmp_path / "runs.db", "m1"))["repaid"] == 1  # counted


async def result_of(db: Path, step_id: str) -> Any:
    """The payload of a model step's result record."""
    events = await journal(db)
    return next(e.payload for e in events if e.step_id == step_id and e.phase.value == "result")


# -- through asiento gateway, streamed or not is the same request ----------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("first", ["stream", "plain"])
async def test_through_the_proxy_a_streamed_and_a_plain_ask_of_one_key_pay_once(
    provider: FakeProvider, tmp_path: Path, kind: str, first: str
) -> None:
    """A run streamed by one process and resumed by one that does not (or the other way)."""
    with AsgiServer(create_app(provider.openai_url, db=tmp_path / "keys.db")) as proxy:
        async with gateway(kind, proxy.url + "/v1") as gw:
            key = "run-1:m1:ffff"
            if first == "stream":
                parts, one = await streamed(gw, key)
                two = await gw.complete(REQUEST, idempotency_key=key)
            else:
                one = await gw.complete(REQUEST, idempotency_key=key)
                parts, two = await streamed(gw, key)
    assert provider.billed(key) == 1
    assert essence(one) == essence(two)
    assert one.tool_calls[0].id == two.tool_calls[0].id  # the same generation, not a second
    assert "".join(p.text for p in parts if isinstance(p, TextPart)) == one.text
    assert provider.problems == []
