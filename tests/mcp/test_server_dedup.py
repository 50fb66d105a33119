"""IdempotencyKeys on a real MCP server (dedup_server.py), over stdio and Streamable HTTP.

Each test starts the server as its own process and calls it with the SDK's
``ClientSession``, sending the key in ``_meta`` as asiento's client does; the
effect counted is a line in ``effects.log`` per run of a tool's body.

``ASIENTO_TEST_WITHOUT_HELPER=1`` serves the same tools without the middleware:
every test here then fails (that is how each was checked to test something).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, TextIO

import anyio
import httpx2
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, TextContent

from asiento.mcp.server import (
    BAD_KEY,
    CONFLICT,
    IN_PROGRESS,
    KEY_META,
    OUTCOME_META,
    REPLAYED_META,
    UNKNOWN,
)

SERVER = Path(__file__).with_name("dedup_server.py")
_WAIT = 30.0  # seconds any wait for a server may take at most


class Launcher:
    """Starts dedup_server.py over one transport and opens client sessions to it.

    Over stdio every session is a server process of its own (several processes on
    one SQLite file); over HTTP one process serves every session, and is started
    again when the options change or after it was killed.
    """

    def __init__(self, transport: str, folder: Path) -> None:
        self.transport = transport
        self.folder = folder
        self._http: subprocess.Popen[bytes] | None = None
        self._http_options: tuple[str, ...] = ()

    def command(self, options: tuple[str, ...]) -> list[str]:
        plain = ("--plain",) if os.environ.get("ASIENTO_TEST_WITHOUT_HELPER") else ()
        return [sys.executable, str(SERVER), str(self.folder), self.transport, *options, *plain]

    @asynccontextmanager
    async def session(
        self, *options: str, headers: dict[str, str] | None = None
    ) -> AsyncIterator[ClientSession]:
        """A ready ClientSession to a server started with ``options`` (headers: HTTP only)."""
        async with AsyncExitStack() as stack:
            if self.transport == "stdio":
                errors = stack.enter_context((self.folder / "stderr.log").open("a"))
                streams = self._stdio(options, errors)
            else:
                client = await stack.enter_async_context(httpx2.AsyncClient(headers=headers))
                streams = await self._http_streams(options, client)
            read, write = await stack.enter_async_context(streams)
            session = await stack.enter_async_context(ClientSession(read, write))
            await session.initialize()
            yield session

    def _stdio(self, options: tuple[str, ...], errors: TextIO) -> Any:
        command = self.command(options)
        environment = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        parameters = StdioServerParameters(command=command[0], args=command[1:], env=environment)
        return stdio_client(parameters, errlog=errors)

    async def _http_streams(self, options: tuple[str, ...], client: httpx2.AsyncClient) -> Any:
        if self._http is None or self._http.poll() is not None or options != self._http_options:
            self.stop()
            (self.folder / "port").unlink(missing_ok=True)
            with (self.folder / "stderr.log").open("a") as errors:
                self._http = subprocess.Popen(self.command(options), stderr=errors)
            self._http_options = options
        port = await wait_for_file(self.folder / "port")
        return streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=client)

    def stop(self) -> None:
        if self._http is not None and self._http.poll() is None:
            self._http.kill()
            self._http.wait(timeout=_WAIT)


@pytest.fixture(params=["stdio", "http"])
def launcher(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A Launcher for each transport; its HTTP server is stopped after the test."""
    started = Launcher(request.param, tmp_path)
    yield started
    started.stop()


async def wait_for_file(path: Path) -> str:
    """The text of ``path`` once it exists (bounded by _WAIT)."""
    with anyio.fail_after(_WAIT):
        while not path.exists():
            await anyio.sleep(0.02)
    return path.read_text()


def effects(folder: Path) -> list[str]:
    log = folder / "effects.log"
    return log.read_text().splitlines() if log.exists() else []


def keyed(key: str) -> dict[str, Any]:
    return {KEY_META: key}


def text(result: CallToolResult) -> str:
    return "".join(block.text for block in result.content if isinstance(block, TextContent))


def outcome(result: CallToolResult) -> object:
    return (result.meta or {}).get(OUTCOME_META)


async def test_a_repeated_key_runs_the_tool_once_and_replays_its_result(launcher: Launcher) -> None:
    """The second call under a key, even from another connection, gets the first result."""
    arguments = {"invoice": "inv-1", "amount": 10}
    async with launcher.session() as session:
        first = await session.call_tool("pay", arguments, meta=keyed("run-1:m1.t0:aa"))
        again = await session.call_tool("pay", arguments, meta=keyed("run-1:m1.t0:aa"))
    async with launcher.session() as session:
        later = await session.call_tool("pay", arguments, meta=keyed("run-1:m1.t0:aa"))
    assert effects(launcher.folder) == ["pay inv-1 10"]
    assert not first.is_error
    assert REPLAYED_META not in (first.meta or {})
    for replay in (again, later):
        assert replay.structured_content == first.structured_content
        assert text(replay) == text(first)
        assert not replay.is_error
        assert (replay.meta or {})[REPLAYED_META] is True


async def test_a_tool_error_is_recorded_and_replayed_too(launcher: Launcher) -> None:
    """A tool that failed is not run again under its key: the same error comes back."""
    async with launcher.session() as session:
        first = await session.call_tool("refuse", {"reason": "no"}, meta=keyed("k-err"))
        again = await session.call_tool("refuse", {"reason": "no"}, meta=keyed("k-err"))
    assert effects(launcher.folder) == ["refuse no"]
    assert first.is_error
    assert again.is_error
    assert text(again) == text(first)
    assert (again.meta or {})[REPLAYED_META] is True


async def test_the_same_key_with_other_arguments_is_refused(launcher: Launcher) -> None:
    """Reusing a key for other arguments (or another tool) is an error result; nothing runs."""
    async with launcher.session() as session:
        await session.call_tool("pay", {"invoice": "inv-1", "amount": 10}, meta=keyed("k1"))
        other = await session.call_tool("pay", {"invoice": "inv-1", "amount": 99}, meta=keyed("k1"))
        tool = await session.call_tool("refuse", {"reason": "x"}, meta=keyed("k1"))
    assert effects(launcher.folder) == ["pay inv-1 10"]
    for refused in (other, tool):
        assert refused.is_error
        assert outcome(refused) == CONFLICT
        assert "'k1'" in text(refused)
        assert "'pay'" in text(refused)
        assert "client" in text(refused)


async def test_a_key_still_running_answers_in_progress(launcher: Launcher) -> None:
    """While the first call under a key runs, a second one gets "in-progress" and runs nothing."""
    results: list[CallToolResult] = []

    async def first_call() -> None:
        async with launcher.session() as session:
            results.append(await session.call_tool("hold", {"tag": "a"}, meta=keyed("k-hold")))

    async with anyio.create_task_group() as group:
        group.start_soon(first_call)
        await wait_for_file(launcher.folder / "entered-a")
        async with launcher.session() as session:
            with anyio.fail_after(_WAIT):
                second = await session.call_tool("hold", {"tag": "a"}, meta=keyed("k-hold"))
            (launcher.folder / "release-a").touch()
    async with launcher.session() as session:
        third = await session.call_tool("hold", {"tag": "a"}, meta=keyed("k-hold"))
    assert second.is_error
    assert outcome(second) == IN_PROGRESS
    assert text(results[0]) == "held a"
    assert text(third) == "held a"
    assert (third.meta or {})[REPLAYED_META] is True
    assert effects(launcher.folder) == ["hold-entered a", "hold-done a"]


async def test_a_server_killed_inside_the_tool_leaves_the_key_unknown(launcher: Launcher) -> None:
    """SIGKILL inside the tool, start the server again: the key answers "unknown", nothing runs."""

    async def doomed_call() -> None:
        with pytest.raises(Exception):  # noqa: B017, PT011 - the connection dies, whichever way
            async with launcher.session() as session:
                await session.call_tool("hold", {"tag": "k"}, meta=keyed("k-kill"))

    async with anyio.create_task_group() as group:
        group.start_soon(doomed_call)
        pid = int(await wait_for_file(launcher.folder / "entered-k"))
        os.kill(pid, signal.SIGKILL)
    (launcher.folder / "release-k").touch()  # a tool run again would not wait
    async with launcher.session() as session:
        after = await session.call_tool("hold", {"tag": "k"}, meta=keyed("k-kill"))
        again = await session.call_tool("hold", {"tag": "k"}, meta=keyed("k-kill"))
    assert effects(launcher.folder) == ["hold-entered k"]
    for answer in (after, again):
        assert answer.is_error
        assert outcome(answer) == UNKNOWN


async def test_a_key_is_forgotten_after_its_ttl(launcher: Launcher) -> None:
    """Within the TTL a key replays; past it (the clock moved on) the call runs again."""
    arguments = {"invoice": "inv-7", "amount": 7}
    async with launcher.session("--ttl", "60") as session:
        await session.call_tool("pay", arguments, meta=keyed("k-ttl"))
    async with launcher.session("--ttl", "60", "--skew", "50") as session:
        within = await session.call_tool("pay", arguments, meta=keyed("k-ttl"))
    async with launcher.session("--ttl", "60", "--skew", "70") as session:
        past = await session.call_tool("pay", arguments, meta=keyed("k-ttl"))
    assert (within.meta or {}).get(REPLAYED_META) is True
    assert REPLAYED_META not in (past.meta or {})
    assert effects(launcher.folder) == ["pay inv-7 7", "pay inv-7 7"]


async def test_a_call_without_a_key_runs_every_time(launcher: Launcher) -> None:
    """No key, no deduplication: the same call runs each time (a keyed one beside it, once)."""
    arguments = {"invoice": "inv-2", "amount": 5}
    async with launcher.session() as session:
        for _ in range(2):
            await session.call_tool("pay", arguments)
            await session.call_tool("pay", arguments, meta={"other/meta": "x"})
            await session.call_tool("pay", {"invoice": "inv-3", "amount": 5}, meta=keyed("k-3"))
    assert effects(launcher.folder).count("pay inv-2 5") == 4
    assert effects(launcher.folder).count("pay inv-3 5") == 1


async def test_a_key_that_is_not_a_string_is_refused(launcher: Launcher) -> None:
    """A key that is not a non-empty string is the client's error; the tool does not run."""
    arguments = {"invoice": "inv-4", "amount": 4}
    async with launcher.session() as session:
        answers = [
            await session.call_tool("pay", arguments, meta={KEY_META: bad})
            for bad in (42, "", "k" * 1025)
        ]
    assert effects(launcher.folder) == []
    for answer in answers:
        assert answer.is_error
        assert outcome(answer) == BAD_KEY
        assert "client" in text(answer)


async def test_only_the_tools_named_are_deduplicated(launcher: Launcher) -> None:
    """With tools={"pay"}, a keyed call of another tool runs every time."""
    async with launcher.session("--only", "pay") as session:
        for _ in range(2):
            await session.call_tool("pay", {"invoice": "inv-5", "amount": 5}, meta=keyed("k-5"))
            await session.call_tool("refuse", {"reason": "r"}, meta=keyed("k-6"))
    assert effects(launcher.folder) == ["pay inv-5 5", "refuse r", "refuse r"]


# Over Streamable HTTP (mcp 2.3) a client's cancel closes its response stream and the
# tool runs on to a recorded result; over stdio it reaches the tool as a cancellation.
@pytest.mark.parametrize("launcher", ["stdio"], indirect=True)
async def test_a_cancelled_call_leaves_its_key_unknown(launcher: Launcher) -> None:
    """The client cancels a call inside the tool: its key answers "unknown", nothing reruns."""
    async with launcher.session() as session:
        async with anyio.create_task_group() as group:

            async def cancelled_call() -> None:
                await session.call_tool("hold", {"tag": "c"}, meta=keyed("k-cancel"))

            group.start_soon(cancelled_call)
            await wait_for_file(launcher.folder / "entered-c")
            group.cancel_scope.cancel()
        # Not released yet: released before the server saw the cancellation, the tool would
        # finish and record its result (the test raced that way under load).
        with anyio.fail_after(_WAIT):
            while (
                outcome(
                    answer := await session.call_tool("hold", {"tag": "c"}, meta=keyed("k-cancel"))
                )
                == IN_PROGRESS
            ):
                await anyio.sleep(0.02)  # the server has not seen the cancellation yet
        (launcher.folder / "release-c").touch()
    assert effects(launcher.folder) == ["hold-entered c"]
    assert answer.is_error
    assert outcome(answer) == UNKNOWN


@pytest.mark.parametrize("launcher", ["http"], indirect=True)
async def test_a_scope_keeps_the_keys_of_two_tenants_apart(launcher: Launcher) -> None:
    """With scope= (here a header), two tenants' equal keys are two calls; each replays its own."""
    arguments = {"invoice": "inv-8", "amount": 8}
    answers: dict[str, list[CallToolResult]] = {"a": [], "b": []}
    for tenant in ("a", "b", "a", "b"):
        async with launcher.session("--scope-header", headers={"x-tenant": tenant}) as session:
            answers[tenant].append(await session.call_tool("pay", arguments, meta=keyed("k-8")))
    assert effects(launcher.folder) == ["pay inv-8 8", "pay inv-8 8"]
    first_a, again_a = answers["a"]
    first_b, again_b = answers["b"]
    assert first_a.structured_content != first_b.structured_content
    assert again_a.structured_content == first_a.structured_content
    assert again_b.structured_content == first_b.structured_content
