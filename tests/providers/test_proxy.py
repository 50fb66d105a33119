"""``asiento gateway``: the idempotency proxy, and crashes in the paid-but-not-recorded window.

The proxy runs with uvicorn on 127.0.0.1 in front of ``FakeProvider``; clients
are the official SDKs, unchanged. The crash tests run the agent in a child
process (``fake_servers.py child``) that is killed with SIGKILL after its model
request left and before its answer was recorded, then resumed by a new child.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from asiento.gateways import AnthropicGateway, ModelRequestRejected, OpenAIGateway
from asiento.model import Message, ModelRequest
from asiento.proxy import create_app
from asiento.testing import ENV_VAR

from .fake_servers import CHILD_SCRIPT, AsgiServer, FakeProvider, wait_until
from .test_openai import RUN, SCRIPT, journal, model_results

CHILD = Path(__file__).with_name("fake_servers.py")
KILLED = -signal.SIGKILL
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    """A scripted provider on 127.0.0.1 speaking every wire format."""
    with FakeProvider(SCRIPT) as p:
        yield p


@pytest.fixture
def make_proxy(provider: FakeProvider, tmp_path: Path) -> Iterator[Callable[..., AsgiServer]]:
    """Start idempotency proxies in front of the provider (all on one key store by default)."""
    with ExitStack() as stack:

        def make(**options: Any) -> AsgiServer:
            options.setdefault("db", tmp_path / "keys.db")
            return stack.enter_context(AsgiServer(create_app(provider.openai_url, **options)))

        yield make


@pytest.fixture
def proxy(make_proxy: Callable[..., AsgiServer]) -> AsgiServer:
    """One idempotency proxy with the default settings."""
    return make_proxy()


def sdk(
    server: AsgiServer, *, api_key: str = "sk-test", max_retries: int = 2
) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key=api_key, base_url=server.url + "/v1", max_retries=max_retries)


async def ask(
    client: openai.AsyncOpenAI, key: str | None, messages: Any = HELLO, model: str = "gpt-test"
) -> Any:
    """One Chat Completions call with the official client; the raw response (headers too)."""
    headers = {"Idempotency-Key": key} if key else None
    return await client.chat.completions.with_raw_response.create(
        model=model, messages=messages, extra_headers=headers
    )


def stats(server: AsgiServer) -> Any:
    return server.app.state.proxy.stats


# -- deduplication -------------------------------------------------------------------------


async def test_a_stored_answer_is_replayed_without_calling_the_provider(
    proxy: AsgiServer, provider: FakeProvider
) -> None:
    """The same key again gets the stored answer and request id; the provider is not called."""
    async with sdk(proxy) as client:
        first = await ask(client, "run-1:m1:abc")
        again = await ask(client, "run-1:m1:abc")
    assert provider.billed() == 1
    assert again.parse().model_dump() == first.parse().model_dump()
    assert again.headers["x-request-id"] == first.headers["x-request-id"] == "req_1"
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert provider.requests[0].headers["idempotency-key"] == "run-1:m1:abc"


async def test_a_key_in_flight_waits_for_its_answer(
    proxy: AsgiServer, provider: FakeProvider
) -> None:
    """A request whose key is in flight waits for that answer instead of calling again."""
    provider.delay_turn(0, 0.5)
    async with sdk(proxy) as client:
        one, two = await asyncio.gather(ask(client, "k-flight"), ask(client, "k-flight"))
    assert provider.billed() == 1
    assert one.parse().id == two.parse().id == "chatcmpl-1"
    assert {one.headers.get("idempotent-replayed"), two.headers.get("idempotent-replayed")} == {
        None,
        "true",
    }


async def test_waiting_for_a_key_in_flight_is_bounded(
    make_proxy: Callable[..., AsgiServer], provider: FakeProvider
) -> None:
    """Past the wait bound the proxy answers 409 with Retry-After; the first answer still lands."""
    server = make_proxy(wait=0.3)
    provider.delay_turn(0, 1.5)
    async with sdk(server) as client, sdk(server, max_retries=0) as impatient:
        first = asyncio.create_task(ask(client, "k-slow"))
        await asyncio.sleep(0.2)
        with pytest.raises(openai.ConflictError, match="in flight"):
            await ask(impatient, "k-slow")
        assert (await first).parse().id == "chatcmpl-1"
        assert (await ask(impatient, "k-slow")).headers["idempotent-replayed"] == "true"
    assert provider.billed() == 1


async def test_the_same_key_with_another_body_is_refused(
    proxy: AsgiServer, provider: FakeProvider
) -> None:
    """A key reused for a different body gets 422 idempotency_key_reused, never the other answer."""
    async with sdk(proxy) as client:
        await ask(client, "k-reused")
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await ask(client, "k-reused", messages=[{"role": "user", "content": "bye"}])
        spaced = await ask(client, "k-reused", messages=[{"content": "hello", "role": "user"}])
    assert caught.value.status_code == 422
    assert "idempotency_key_reused" in str(caught.value.body)
    assert spaced.headers["idempotent-replayed"] == "true"  # same JSON, another key order
    assert provider.billed() == 1
    assert len(provider.requests) == 1
    assert stats(proxy).conflicts == 1


async def test_the_gateway_names_the_step_when_a_reused_key_is_refused(
    proxy: AsgiServer, provider: FakeProvider
) -> None:
    """Resuming with another model through the proxy is ModelRequestRejected naming the step."""
    request = ModelRequest(messages=[Message(role="user", content="hello")])
    key = f"{RUN}:m1:0123456789abcdef"
    async with OpenAIGateway("gpt-a", base_url=proxy.url + "/v1", api_key="k") as gw:
        await gw.complete(request, idempotency_key=key)
    async with OpenAIGateway("gpt-b", base_url=proxy.url + "/v1", api_key="k") as gw:
        with pytest.raises(ModelRequestRejected, match="original model") as caught:
            await gw.complete(request, idempotency_key=key)
    assert (caught.value.run_id, caught.value.step_id, caught.value.status) == (RUN, "m1", 422)
    assert provider.billed() == 1


async def test_keys_expire_after_the_ttl(
    make_proxy: Callable[..., AsgiServer], provider: FakeProvider
) -> None:
    """After the TTL a key is forgotten: the same request calls the provider again."""
    server = make_proxy(ttl=0.3)
    async with sdk(server) as client:
        await ask(client, "k-ttl")
        await ask(client, "k-ttl")
        assert provider.billed() == 1
        await asyncio.sleep(0.4)
        late = await ask(client, "k-ttl")
    assert provider.billed() == 2
    assert "idempotent-replayed" not in late.headers


async def test_requests_without_a_key_are_forwarded_every_time(
    proxy: AsgiServer, provider: FakeProvider
) -> None:
    """Without Idempotency-Key the proxy forwards as it is and keeps nothing."""
    async with sdk(proxy) as client:
        await ask(client, None)
        await ask(client, None)
    assert provider.billed() == 2
    assert stats(proxy).replayed == 0


async def test_keys_are_scoped_by_credentials_which_are_forwarded(
    proxy: AsgiServer, provider: FakeProvider
) -> None:
    """Authorization reaches the provider; the same key from other credentials is not shared."""
    async with sdk(proxy, api_key="sk-alice") as alice, sdk(proxy, api_key="sk-bob") as bob:
        await ask(alice, "k-shared")
        bobs = await ask(bob, "k-shared")
    assert [r.headers["authorization"] for r in provider.requests] == [
        "Bearer sk-alice",
        "Bearer sk-bob",
    ]
    assert "idempotent-replayed" not in bobs.headers
    assert provider.billed() == 2


@pytest.mark.parametrize("status", [400, 500])
async def test_an_error_answer_passes_through_and_is_not_kept(
    proxy: AsgiServer, provider: FakeProvider, status: int
) -> None:
    """An upstream error is returned as it is and releases the key; the retry is answered."""
    provider.fail_next(1, status)
    async with sdk(proxy, max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await ask(client, "k-error")
        ok = await ask(client, "k-error")
    assert caught.value.status_code == status
    assert ok.parse().id == "chatcmpl-1"
    assert provider.billed() == 1


async def test_an_unparseable_answer_is_not_kept(proxy: AsgiServer, provider: FakeProvider) -> None:
    """A 200 a gateway could not record is passed on but not kept: the next ask calls again."""
    provider.garble_next(b'{"object": "chat.completion", "choices": []}')
    async with sdk(proxy) as client:
        first = await ask(client, "k-garbled")
        second = await ask(client, "k-garbled")
    assert first.parse().choices == []
    assert second.parse().id == "chatcmpl-2"
    assert provider.billed() == 2


@pytest.mark.parametrize("kind", ["chat", "responses", "anthropic"])
async def test_every_wire_format_is_deduplicated_through_the_proxy(
    proxy: AsgiServer, provider: FakeProvider, kind: str
) -> None:
    """Chat Completions, Responses and Anthropic Messages each get the stored answer by key."""
    request = ModelRequest(instructions="Be brief.", messages=[Message(role="user", content="hi")])
    answers = []
    for _ in range(2):
        if kind == "anthropic":
            gw: Any = AnthropicGateway("claude-test", base_url=proxy.url, api_key="k")
        else:
            gw = OpenAIGateway("gpt-test", api=kind, base_url=proxy.url + "/v1", api_key="k")  # type: ignore[arg-type]
        async with gw:
            answers.append(await gw.complete(request, idempotency_key="run-1:m1:ffff"))
    assert answers[1].kept  # answered from the generation the proxy kept
    assert not answers[0].kept
    assert answers[0] == dataclasses.replace(answers[1], kept=False)
    assert answers[0].tool_calls[0].name == "read"
    assert provider.billed() == 1
    assert provider.problems == []


async def test_the_anthropic_sdk_keeps_its_credentials_through_the_proxy(
    proxy: AsgiServer, provider: FakeProvider
) -> None:
    """The official anthropic client works against the proxy unchanged; its headers get through."""
    async with anthropic.AsyncAnthropic(api_key="sk-ant", base_url=proxy.url) as client:
        message = await client.messages.create(
            model="claude-test",
            max_tokens=64,
            messages=HELLO,
            extra_headers={"Idempotency-Key": "a1"},
        )
    assert message.content[0].type == "tool_use"
    sent = provider.requests[0].headers
    assert "sk-ant" in sent.get("authorization", "") + sent.get("x-api-key", "")
    assert "anthropic-version" in sent


# -- crashes in the window: sent, not recorded ---------------------------------------------


def start_child(db: Path, base_url: str, *, crash_at: str | None = None) -> subprocess.Popen[str]:
    """One pass of the crash agent in a new process (armed to kill itself at ``crash_at``)."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if crash_at:
        env[ENV_VAR] = crash_at
    argv = [sys.executable, str(CHILD), "child", str(db), RUN, base_url]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen[str]) -> dict[str, Any] | None:
    """Wait for a child; its JSON outcome, or None if it did not exit 0."""
    out, err = proc.communicate(timeout=60)
    if proc.returncode != 0:
        assert proc.returncode == KILLED, err
        return None
    return json.loads(out.strip().splitlines()[-1])


def billed_per_step(provider: FakeProvider) -> Counter[str]:
    """Billable generations per step id, read from the key each generation was made for."""
    return Counter(key.split(":")[1] for key in provider.generations if key)


@pytest.fixture
def child_provider() -> Iterator[FakeProvider]:
    """The provider the crash children talk to: read /x, read /y, done."""
    with FakeProvider(CHILD_SCRIPT) as p:
        yield p


def test_killed_while_the_provider_generates_then_resumed_through_the_proxy_pays_once(
    child_provider: FakeProvider, tmp_path: Path
) -> None:
    """SIGKILL after m2 was sent, before its answer came: the resume gets it, not billed again."""
    child_provider.delay_turn(1, 2.0)
    db = tmp_path / "runs.db"
    with AsgiServer(create_app(child_provider.openai_url, db=tmp_path / "keys.db")) as server:
        proc = start_child(db, server.url + "/v1")
        wait_until(lambda: child_provider.billed() == 2)
        proc.kill()
        assert finish(proc) is None
        assert "m2" not in model_results(asyncio.run(journal(db)))
        resumed = finish(start_child(db, server.url + "/v1"))
    assert resumed == {"ended": "closed", "model_calls": 2, "replayed": 1}
    assert billed_per_step(child_provider) == {"m1": 1, "m2": 1, "m3": 1}
    assert model_results(asyncio.run(journal(db)))["m2"]["response"]["request_id"] == "req_2"


@pytest.mark.parametrize(
    ("via_proxy", "m2_bills"), [(True, 1), (False, 2)], ids=["proxy", "direct"]
)
def test_killed_after_the_answer_came_before_it_was_recorded(
    child_provider: FakeProvider, tmp_path: Path, via_proxy: bool, m2_bills: int
) -> None:
    """SIGKILL between m2's answer and its record: the proxy makes it one bill (direct, two)."""
    db = tmp_path / "runs.db"
    with ExitStack() as stack:
        url = child_provider.openai_url
        if via_proxy:
            app = create_app(child_provider.openai_url, db=tmp_path / "keys.db")
            url = stack.enter_context(AsgiServer(app)).url + "/v1"
        assert finish(start_child(db, url, crash_at="inside_model_call@2")) is None
        resumed = finish(start_child(db, url))
    assert resumed is not None
    assert resumed["ended"] == "closed"
    assert billed_per_step(child_provider) == {"m1": 1, "m2": m2_bills, "m3": 1}


def test_without_the_proxy_the_journal_still_prevents_calls_for_recorded_steps(
    child_provider: FakeProvider, tmp_path: Path
) -> None:
    """Killed right after m2 was recorded: the resume asks the provider for m3 only."""
    db = tmp_path / "runs.db"
    url = child_provider.openai_url
    assert finish(start_child(db, url, crash_at="after_model_result@2")) is None
    resumed = finish(start_child(db, url))
    assert resumed == {"ended": "closed", "model_calls": 1, "replayed": 2}
    assert billed_per_step(child_provider) == {"m1": 1, "m2": 1, "m3": 1}


# -- the proxy's own crash -------------------------------------------------------------------


def start_proxy(upstream: str, db: Path, **options: Any) -> tuple[subprocess.Popen[str], str]:
    """``serve()`` in its own process on a free port (with ``options``); the URL it printed."""
    code = (
        "import json, sys; from asiento.proxy import serve; "
        "serve(sys.argv[1], db=sys.argv[2], port=0, **json.loads(sys.argv[3]))"
    )
    argv = [sys.executable, "-c", code, upstream, str(db), json.dumps(options)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    ready, _, _ = select.select([proc.stderr], [], [], 30)
    line = proc.stderr.readline() if ready else ""
    assert "asiento gateway: http://" in line, line
    return proc, line.split()[2]


def stop(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    """Signal a proxy process, wait for it and close its pipe."""
    proc.send_signal(sig)
    proc.communicate(timeout=20)


def test_a_claim_left_by_a_killed_proxy_is_taken_over_at_once(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """A proxy SIGKILLed mid-request leaves a key in flight; its successor takes it over at once."""
    db, body = tmp_path / "keys.db", {"model": "gpt-test", "messages": HELLO}
    headers = {"Idempotency-Key": "k-orphan", "Authorization": "Bearer sk-test"}
    provider.delay_turn(0, 30.0)
    first, url = start_proxy(provider.openai_url, db)
    failed: list[BaseException] = []

    def doomed() -> None:
        try:
            httpx.post(url + "/chat/completions", json=body, headers=headers, timeout=60)
        except httpx.HTTPError as exc:
            failed.append(exc)

    sender = threading.Thread(target=doomed)
    sender.start()
    wait_until(lambda: provider.billed() == 1)
    stop(first, signal.SIGKILL)
    sender.join(timeout=10)
    assert failed
    second, url = start_proxy(provider.openai_url, db)
    try:
        began = time.monotonic()
        answer = httpx.post(url + "/chat/completions", json=body, headers=headers, timeout=60)
        took = time.monotonic() - began
        again = httpx.post(url + "/chat/completions", json=body, headers=headers, timeout=60)
    finally:
        stop(second, signal.SIGTERM)
    assert answer.status_code == 200
    assert took < 5
    assert again.headers["idempotent-replayed"] == "true"
    assert provider.billed("k-orphan") == 2  # the dead proxy's generation could not be kept


def test_the_proxy_page_example_runs_through_the_proxy(
    proxy: AsgiServer, provider: FakeProvider, tmp_path: Path
) -> None:
    """The gateway-proxy page's example reaches the provider through the proxy, as written."""
    page = Path(__file__).resolve().parents[2] / "docs" / "gateway-proxy.md"
    code = page.read_text(encoding="utf-8").split("```python\n", 1)[1].split("```", 1)[0]
    assert "http://127.0.0.1:8787/v1" in code
    code = code.replace("http://127.0.0.1:8787/v1", proxy.url + "/v1")
    env = os.environ | {"OPENAI_API_KEY": "sk-doc"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "FinalStep" in proc.stdout
    assert stats(proxy).upstream_calls == provider.billed() == len(SCRIPT)
    assert {r.headers["authorization"] for r in provider.requests} == {"Bearer sk-doc"}
    assert all(r.key and r.key.startswith("hello-1:m") for r in provider.requests)


async def test_the_key_store_refuses_a_run_journal(tmp_path: Path) -> None:
    """Given a run journal as its file by mistake, the proxy refuses it and leaves it as it was."""
    from asiento import SqliteCheckpointer
    from asiento.lease import Holder
    from asiento.proxy import KeyStore, ProxyError, serve

    store = SqliteCheckpointer(tmp_path / "runs.db")
    await store.close()
    before = (tmp_path / "runs.db").read_bytes()
    with pytest.raises(ProxyError, match="not an asiento gateway key store"):
        KeyStore(tmp_path / "runs.db", ttl=60, lease=60, holder=Holder.here())
    with pytest.raises(ProxyError, match="not an asiento gateway key store"):
        serve("http://127.0.0.1:9/v1", db=tmp_path / "runs.db", port=0)
    assert (tmp_path / "runs.db").read_bytes() == before
    KeyStore(tmp_path / "keys.db", ttl=60, lease=60, holder=Holder.here()).close()
    KeyStore(tmp_path / "keys.db", ttl=60, lease=60, holder=Holder.here()).close()
