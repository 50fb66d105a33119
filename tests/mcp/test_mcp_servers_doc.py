"""The server in docs/mcp-servers.md runs as written and deduplicates by the key."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from mcp import ClientSession, StdioServerParameters, stdio_client

from asiento.mcp.server import KEY_META, REPLAYED_META

DOC = Path(__file__).resolve().parents[2] / "docs" / "mcp-servers.md"


def example() -> str:
    """The doc's first python block: a complete server program."""
    found = re.search(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert found, "docs/mcp-servers.md has no python block"
    return found.group(1)


async def test_the_documented_server_replays_a_repeated_key(tmp_path: Path) -> None:
    """Run over stdio in its own folder, the example answers a key's second call from its file."""
    script = tmp_path / "server.py"
    script.write_text(example())
    parameters = StdioServerParameters(
        command=sys.executable,
        args=[str(script)],
        env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        cwd=tmp_path,
    )
    arguments = {"invoice": "inv-1", "amount": 10}
    with (tmp_path / "stderr.log").open("w") as errors:
        async with (
            stdio_client(parameters, errlog=errors) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            first = await session.call_tool("pay", arguments, meta={KEY_META: "k-doc"})
            again = await session.call_tool("pay", arguments, meta={KEY_META: "k-doc"})
    assert first.structured_content == {"invoice": "inv-1", "amount": 10, "paid": True}
    assert again.structured_content == first.structured_content
    assert (again.meta or {})[REPLAYED_META] is True
    assert (tmp_path / "calls.db").exists()
