"""Time to first token: the official client straight at a local server, through
``run(stream=True)``, and through ``asiento gateway``, measured in one run.

    python bench/streaming.py            # 200 streams per path
    python bench/streaming.py --quick    # 30 streams per path (a few seconds)
    git archive adbf9ac src | tar -x -C /tmp/before
    python bench/streaming.py --before /tmp/before   # and that release's proxy, side by side

The server (starlette + uvicorn on h11 and asyncio, on 127.0.0.1, in a thread of
this process) streams a Chat Completions answer of ``--chunks`` text chunks, as fast
as it can. The paths take turns in blocks of ten streams, so they share the
machine's noise and each keeps its connection warm, as a busy agent does:

- ``direct``: ``openai.AsyncOpenAI`` straight at the server, ``stream=True``;
- ``run``: ``Agent.run(task, session=..., stream=True)`` with an ``OpenAIGateway``
  at the same server and a SQLite journal (a new run each time: the lease is
  taken, the journal read, then the request sent), up to the first ``Delta``;
- ``pass``: the official client through ``asiento gateway`` without a key (the
  stream is passed through: the cost of the hop alone);
- ``proxy``: the same with a new key each time (the claim is committed before the
  request goes upstream, and the stream recorded).

``asiento gateway`` runs as its own process, as it is deployed (``--proxy-in-thread``:
in a thread of this one, sharing its GIL, as this bench measured before 2026-12-02).

Printed: medians and p90 of time to first token and total time, and what each
path adds to ``direct``. Figures, never pass/fail: targets (issue 16) are under
2 ms added at the median through ``run()``, under 5 ms through the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import openai
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asiento import Agent, Delta, Session, SqliteCheckpointer
from asiento._listen import listening_socket
from asiento.gateways import OpenAIGateway
from asiento.proxy import create_app
from asiento.proxy.app import server_options

PLAZO = 120.0  # no path may take longer than this in all
BLOCK = 10  # streams per path in a row: each path's connection stays warm, as in use


def chat_app(chunks: int) -> Starlette:
    """A Chat Completions server that streams ``chunks`` pieces of text, then usage."""

    async def completions(request: Request) -> StreamingResponse:
        await request.body()

        async def events() -> AsyncIterator[bytes]:
            head = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
            for i in range(chunks):
                delta = {"content": f"w{i} "} if i else {"role": "assistant", "content": "w0 "}
                choice = {"index": 0, "delta": delta, "finish_reason": None}
                yield b"data: " + json.dumps(head | {"choices": [choice]}).encode() + b"\n\n"
            end = {"index": 0, "delta": {}, "finish_reason": "stop"}
            yield b"data: " + json.dumps(head | {"choices": [end]}).encode() + b"\n\n"
            usage = {"prompt_tokens": 10, "completion_tokens": chunks, "total_tokens": 10 + chunks}
            yield b"data: " + json.dumps(head | {"choices": [], "usage": usage}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


@contextmanager
def serving(app: Any, *, http: str = "h11", loop: str = "asyncio") -> Iterator[str]:
    """``app`` on a free 127.0.0.1 port, in a thread; its base URL.

    The server's HTTP parser and event loop are named, never ``auto``: installing
    httptools or uvloop must not change what the baseline measures.
    """
    sock = listening_socket("127.0.0.1", 0, backlog=128)  # TCP_NODELAY, as asiento's servers
    config = uvicorn.Config(app, log_level="warning", lifespan="on", http=http, loop=loop)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def gateway_process(upstream: str, db: Path, before: Path | None = None) -> Iterator[str]:
    """``asiento gateway`` as its own process, as it is deployed; its base URL.

    ``before``: a source tree (``git archive REV src | tar -x -C DIR``) whose proxy is
    served as that release served it, on uvicorn's h11 and asyncio loop.
    """
    command = [sys.executable, "-m", "asiento", "gateway", "--upstream", upstream]
    command += ["--db", str(db), "--port", "0"]
    env = None
    if before is not None:
        command = [sys.executable, "-c", _BEFORE, upstream, str(db)]
        env = os.environ | {"PYTHONPATH": str(before / "src")}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stderr is not None
        line = process.stderr.readline()  # "asiento gateway: http://127.0.0.1:PORT/v1 -> ..."
        found = re.search(r"(http://\S+)/v1 ", line)
        if found is None:
            raise RuntimeError(f"asiento gateway did not start: {line}{process.stderr.read()}")
        yield found.group(1)
    finally:
        process.terminate()
        process.wait(timeout=30)


_BEFORE = """
import sys, uvicorn
from asiento._listen import listening_socket
from asiento.proxy import create_app
sock = listening_socket("127.0.0.1", 0, backlog=2048)
print(f"asiento gateway: http://127.0.0.1:{sock.getsockname()[1]}/v1 -> before", file=sys.stderr,
      flush=True)
app = create_app(sys.argv[1], db=sys.argv[2])
uvicorn.Server(uvicorn.Config(app, log_level="warning", http="h11", loop="asyncio")).run(
    sockets=[sock])
"""


async def direct(client: openai.AsyncOpenAI, key: str | None) -> tuple[float, float]:
    start = time.perf_counter()
    first = None
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_headers={"Idempotency-Key": key} if key else None,
    )  # fmt: skip
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start


async def through_run(
    gateway: OpenAIGateway, store: SqliteCheckpointer, run_id: str
) -> tuple[float, float]:
    start = time.perf_counter()
    first = None
    session = Session(run_id, gateway, store)
    async for item in Agent().run("hi", session=session, stream=True):
        if first is None and isinstance(item, Delta) and item.text:
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start


def summary(name: str, samples: list[tuple[float, float]], base: list[tuple[float, float]]) -> str:
    ttft = sorted(s[0] * 1000 for s in samples)
    total = sorted(s[1] * 1000 for s in samples)
    added = statistics.median(ttft) - statistics.median(s[0] * 1000 for s in base)
    p90 = ttft[int(0.9 * (len(ttft) - 1))]
    return (
        f"{name:<13} {statistics.median(ttft):>10.2f} {p90:>8.2f} "
        f"{statistics.median(total):>11.2f} {added:>+12.2f}"
    )


async def measure(
    url: str, proxies: dict[str, str], db: Path, n: int
) -> dict[str, list[tuple[float, float]]]:
    """Every path ``n`` times, in blocks in turn; ``proxies``: suffix -> proxy base URL."""
    deadline = time.monotonic() + PLAZO * len(proxies)
    store = SqliteCheckpointer(db)  # one journal, as a worker has: a new run each time
    async with contextlib.AsyncExitStack() as stack:
        straight = await stack.enter_async_context(openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="k", max_retries=0))  # fmt: skip
        gateway = await stack.enter_async_context(OpenAIGateway(
            "m", base_url=url + "/v1", api_key="k", max_retries=0))  # fmt: skip
        paths: dict[str, Callable[[int], Any]] = {
            "direct": lambda i: direct(straight, f"d{i}"),
            "run": lambda i: through_run(gateway, store, f"run-{i}"),
        }
        for suffix, proxy_url in proxies.items():
            proxied = await stack.enter_async_context(openai.AsyncOpenAI(
                base_url=proxy_url + "/v1", api_key="k", max_retries=0))  # fmt: skip
            paths["pass" + suffix] = partial(_no_key, proxied)
            paths["proxy" + suffix] = partial(_keyed, proxied, f"p{suffix}")
        for path in paths.values():  # warm each path once: connections, imports
            await path(-1)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
        for block in range(0, n, BLOCK):  # blocks in turn: warm connections, shared noise
            if time.monotonic() > deadline:
                break
            for name, path in paths.items():
                for i in range(block, min(n, block + BLOCK)):
                    results[name].append(await path(i))
    await store.close()
    return results


def _no_key(client: openai.AsyncOpenAI, i: int) -> Any:
    return direct(client, None)


def _keyed(client: openai.AsyncOpenAI, prefix: str, i: int) -> Any:
    return direct(client, f"{prefix}{i}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="30 streams per path")
    parser.add_argument("--streams", type=int, default=200, help="streams per path")
    parser.add_argument("--chunks", type=int, default=50, help="text chunks per stream")
    parser.add_argument(
        "--proxy-in-thread",
        action="store_true",
        help="serve the proxy in a thread of this process instead of as an `asiento gateway` "
        "process (the GIL is then shared with the client and the server)",
    )
    parser.add_argument(
        "--before",
        type=Path,
        help="also measure the proxy of this source tree (git archive REV src | tar -x -C "
        "DIR), served on h11 and asyncio as it was (paths pass-before, proxy-before)",
    )
    args = parser.parse_args(argv)
    n = 30 if args.quick else args.streams
    with (
        tempfile.TemporaryDirectory() as tmp,
        serving(chat_app(args.chunks)) as url,
        contextlib.ExitStack() as stack,
    ):
        keys = Path(tmp) / "keys.db"
        if args.proxy_in_thread:
            http, loop = server_options()  # as `asiento gateway` serves it
            app = create_app(url + "/v1", db=keys)
            proxy = stack.enter_context(serving(app, http=http, loop=loop))
        else:
            proxy = stack.enter_context(gateway_process(url + "/v1", keys))
        proxies = {"": proxy}
        if args.before is not None:
            old = gateway_process(url + "/v1", Path(tmp) / "before.db", args.before)
            proxies["-before"] = stack.enter_context(old)
        results = asyncio.run(measure(url, proxies, Path(tmp) / "runs.db", n))
    base = results["direct"]
    print(f"== Time to first token, {len(base)} streams per path, {args.chunks} chunks each (ms)")
    print(f"{'path':<13} {'ttft_med':>10} {'ttft_p90':>8} {'total_med':>11} {'added_ttft':>12}")
    for name, samples in results.items():
        print(summary(name, samples, base))


if __name__ == "__main__":
    main()
