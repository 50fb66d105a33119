"""How ``asiento gateway`` is served, and the claim it commits before a stream goes upstream.

The proxy's hop is on every first token of a streamed answer, so it runs on
httptools and uvloop, named (never uvicorn's ``auto``, which would also move
every other server the moment the ``gateway`` extra is installed).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import openai
import pytest
import uvicorn

from asiento.proxy import create_app
from asiento.proxy import serve as serve_proxy
from asiento.web import serve as serve_web

from .fake_servers import AsgiServer, FakeProvider
from .test_openai import SCRIPT
from .test_proxy import HELLO
from .test_proxy_leases import keys_kept


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[uvicorn.Config]:
    """The configs uvicorn servers were run with; none is run for real."""
    configs: list[uvicorn.Config] = []

    def run(self: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
        configs.append(self.config)
        for sock in sockets or []:
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    return configs


def test_the_gateway_is_served_on_httptools_and_uvloop(
    started: list[uvicorn.Config], tmp_path: Path
) -> None:
    serve_proxy("http://127.0.0.1:9/v1", db=tmp_path / "keys.db", port=0)
    assert [(c.http, c.loop) for c in started] == [("httptools", "uvloop")]


def test_asiento_serve_stays_on_h11_and_asyncio(
    started: list[uvicorn.Config], tmp_path: Path
) -> None:
    """Installing the gateway extra does not change the page's server."""
    serve_web(f"sqlite:///{tmp_path / 'runs.db'}", token="t" * 32, port=0)
    assert [(c.http, c.loop) for c in started] == [("h11", "asyncio")]


class _Watching(FakeProvider):
    """A provider that reads the proxy's key store as each request reaches it."""

    def __init__(self, db: Path) -> None:
        super().__init__(SCRIPT)
        self.db, self.seen = db, list[list[tuple[str, str]]]()

    def answer(self, path: str, headers: dict[str, str], raw: bytes) -> Any:
        self.seen.append(keys_kept(self.db))  # in the server's thread, as the request arrives
        return super().answer(path, headers, raw)


async def test_a_keyed_stream_is_claimed_on_disk_before_upstream_receives_it(
    tmp_path: Path,
) -> None:
    db = tmp_path / "keys.db"
    with _Watching(db) as provider, AsgiServer(create_app(provider.openai_url, db=db)) as proxy:
        client = openai.AsyncOpenAI(api_key="k", base_url=proxy.url + "/v1", max_retries=0)
        async with client:
            stream = await client.chat.completions.create(
                model="gpt-test", messages=HELLO, stream=True,
                extra_headers={"Idempotency-Key": "k-first"},
            )  # fmt: skip
            chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None
    assert provider.seen == [[("k-first", "in_flight")]]
