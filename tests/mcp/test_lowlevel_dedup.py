"""IdempotencyKeys on the SDK's low-level ``Server`` (lowlevel_server.py), over stdio."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError
from mcp_types import TextContent

from asiento.mcp.server import KEY_META, OUTCOME_META, REPLAYED_META, UNKNOWN

SERVER = Path(__file__).with_name("lowlevel_server.py")


@asynccontextmanager
async def session(folder: Path) -> AsyncIterator[ClientSession]:
    parameters = StdioServerParameters(
        command=sys.executable,
        args=[str(SERVER), str(folder)],
        env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    with (folder / "stderr.log").open("a") as errors:
        async with (
            stdio_client(parameters, errlog=errors) as (read, write),
            ClientSession(read, write) as client,
        ):
            await client.initialize()
            yield client


async def test_the_low_level_server_replays_a_repeated_key(tmp_path: Path) -> None:
    """Appended to ``Server.middleware``, the helper answers a key's second call from its file."""
    async with session(tmp_path) as client:
        first = await client.call_tool("count", {}, meta={KEY_META: "k-low"})
        again = await client.call_tool("count", {}, meta={KEY_META: "k-low"})
    assert (tmp_path / "effects.log").read_text().splitlines() == ["count"]
    assert [block.text for block in again.content if isinstance(block, TextContent)] == ["1"]
    assert again.content == first.content
    assert (again.meta or {})[REPLAYED_META] is True


async def test_a_handler_that_raised_leaves_its_key_unknown(tmp_path: Path) -> None:
    """A handler's exception is no outcome (its effect may have happened): the key is unknown."""
    async with session(tmp_path) as client:
        with pytest.raises(MCPError):
            await client.call_tool("crash", {}, meta={KEY_META: "k-crash"})
        after = await client.call_tool("crash", {}, meta={KEY_META: "k-crash"})
    assert (tmp_path / "effects.log").read_text().splitlines() == ["crash"]
    assert after.is_error
    assert (after.meta or {})[OUTCOME_META] == UNKNOWN
