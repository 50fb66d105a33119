"""``asiento gateway``: a key in flight stays its holder's while the holder lives.

Answers here take longer than the proxy's in-flight lease (made short through
the proxy's own ``lease`` option), so only a renewed claim keeps a second
request with the same key from calling (and paying) upstream again. The
clients are the official SDKs; the provider is ``FakeProvider`` on 127.0.0.1;
the proxies run in-process (uvicorn in a thread) or as processes of their own
when one is killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from asiento.lease import Holder
from asiento.proxy import KeyStore
from asiento.proxy.app import Stored

from .fake_servers import AsgiServer, FakeProvider, wait_until
from .test_proxy import HELLO, ask, make_proxy, provider, proxy, sdk, start_proxy, stats, stop

__all__ = ["make_proxy", "provider", "proxy"]  # fixtures, used by name

LEASE = 1.0  # the in-flight lease of these tests: renewed every third of a second


async def until(condition: Callable[[], bool], *, timeout: float = 20.0) -> None:
    """Poll ``condition`` every 20 ms without blocking the event loop; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.02)


def keys_kept(db: Path) -> list[tuple[str, str]]:
    """The (key, state) rows of a key store file, read with sqlite3 itself."""
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT key, state FROM idempotency_keys ORDER BY key").fetchall()


# -- a live holder keeps its key ---------------------------------------------------------


async def test_an_answer_slower_than_the_lease_is_billed_once(
    make_proxy: Callable[..., AsgiServer], provider: FakeProvider
) -> None:
    """Past the lease a second client with the same key waits for the live holder's answer."""
    server = make_proxy(lease=LEASE)
    provider.delay_turn(0, 3 * LEASE)
    async with sdk(server) as first_client, sdk(server) as second_client:
        first = asyncio.create_task(ask(first_client, "k-slow"))
        await until(lambda: provider.billed() == 1)
        await asyncio.sleep(1.5 * LEASE)  # the claim's first lease is over; its holder lives
        second = await ask(second_client, "k-slow")
        first_answer = await first
    assert provider.billed("k-slow") == 1
    assert stats(server).upstream_calls == 1
    assert second.parse().model_dump() == first_answer.parse().model_dump()
    assert second.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first_answer.headers


def test_a_live_proxy_keeps_its_key_and_a_killed_one_loses_it_at_once(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """A rival proxy gets 409 past the holder's lease; once the holder is SIGKILLed, the key."""
    db = tmp_path / "keys.db"
    provider.delay_turn(0, 60.0)
    holder, holder_url = start_proxy(provider.openai_url, db, lease=LEASE)
    rival, rival_url = start_proxy(provider.openai_url, db, lease=LEASE, wait=0.2)
    cut: list[BaseException] = []
    sender = threading.Thread(target=_ask_until_cut, args=(holder_url, "k-held", cut))
    try:
        sender.start()
        wait_until(lambda: provider.billed() == 1)
        time.sleep(2 * LEASE)  # two leases: only renewals keep the claim the holder's
        with openai.OpenAI(api_key="sk-test", base_url=rival_url, max_retries=0) as client:
            with pytest.raises(openai.ConflictError, match="in flight"):
                _create(client, "k-held")
            billed_while_held = provider.billed()
            stop(holder, signal.SIGKILL)
            sender.join(timeout=20)
            taken_over = _create(client, "k-held")
            again = _create(client, "k-held")
    finally:
        stop(rival, signal.SIGTERM)
        if holder.poll() is None:
            stop(holder, signal.SIGKILL)
    assert billed_while_held == 1
    assert cut, "the killed proxy's client should have lost its connection"
    assert taken_over.parse().id == "chatcmpl-2"
    assert "idempotent-replayed" not in taken_over.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert provider.billed("k-held") == 2  # the killed proxy's generation could not be kept


def _create(client: openai.OpenAI, key: str) -> Any:
    return client.chat.completions.with_raw_response.create(
        model="gpt-test", messages=HELLO, extra_headers={"Idempotency-Key": key}
    )


def _ask_until_cut(url: str, key: str, cut: list[BaseException]) -> None:
    """Ask through a proxy that will be killed; note the connection error it ends with."""
    with openai.OpenAI(api_key="sk-test", base_url=url, max_retries=0) as client:
        try:
            _create(client, key)
        except openai.APIConnectionError as exc:
            cut.append(exc)


def test_a_renewal_is_fenced_to_its_claim(tmp_path: Path) -> None:
    """A claim taken over, even by its own process, is never renewed, kept or released again."""
    store = KeyStore(tmp_path / "keys.db", ttl=60, lease=0.05, holder=Holder.here())
    try:
        first = store.claim("scope", "k", "fp")
        time.sleep(0.2)  # the first claim's lease runs out unrenewed
        second = store.claim("scope", "k", "fp")
        assert (first.kind, second.kind) == ("new", "new")
        assert first.token != second.token
        assert not store.renew("scope", "k", first.token)
        store.release("scope", "k", first.token)
        store.finish("scope", "k", first.token, Stored(200, {}, b'{"stale": true}'))
        assert store.renew("scope", "k", second.token)
        store.finish("scope", "k", second.token, Stored(200, {}, b'{"kept": true}'))
        done = store.claim("scope", "k", "fp")
    finally:
        store.close()
    assert done.kind == "done"
    assert done.stored is not None
    assert done.stored.body == b'{"kept": true}'


# -- timeouts ----------------------------------------------------------------------------


async def test_the_upstream_timeout_bounds_the_whole_answer(
    make_proxy: Callable[..., AsgiServer], provider: FakeProvider
) -> None:
    """An answer trickling in past upstream_timeout is cut with 504, though no read is slow."""
    server = make_proxy(upstream_timeout=2.0)
    provider.trickle_turn(0, 8.0)  # a few bytes every 0.1 s
    async with sdk(server, max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await ask(client, "k-trickle")
        retried = await ask(client, "k-trickle")
    assert caught.value.status_code == 504
    assert "upstream_timeout" in str(caught.value.body)
    assert retried.parse().id == "chatcmpl-2"  # the key was released, not kept half-answered
    assert "idempotent-replayed" not in retried.headers
    assert provider.billed("k-trickle") == 2


async def test_the_read_timeout_bounds_each_silence(
    make_proxy: Callable[..., AsgiServer], provider: FakeProvider
) -> None:
    """A silence longer than read_timeout is a 502 well within the whole-answer timeout."""
    server = make_proxy(upstream_timeout=60.0, read_timeout=0.5)
    provider.delay_turn(0, 3.0)
    async with sdk(server, max_retries=0) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await ask(client, "k-silent")
        retried = await ask(client, "k-silent")
    assert caught.value.status_code == 502
    assert "ReadTimeout" in str(caught.value.body)
    assert retried.parse().id == "chatcmpl-2"
    assert provider.billed("k-silent") == 2
