"""MCP servers as tool sources, with asiento's guarantees (the ``mcp`` extra).

    async with McpServer("files", command=["python", "files_server.py"], trusted=True) as files:
        agent = Agent(tools=[*await files.tools(), my_local_tool])

Each MCP tool is a ``Tool`` whose runner (``McpRunner``) calls the server: its
treatment comes from its annotations by the table in ``_annotations`` (for a trusted
server; an untrusted one's tools are all non-idempotent and destructive), the step's
idempotency key travels in the call's ``_meta`` (``IDEMPOTENCY_KEY``), and the
server's tool list and schemas are part of the run's fingerprint (docs/mcp.md).
``asiento.mcp.server.IdempotencyKeys`` is the other end: a middleware for MCP servers
that deduplicates tool calls by that key (docs/mcp-servers.md).
"""

from __future__ import annotations

try:  # the mcp extra; without it, say which one to install
    import mcp as _mcp_sdk
except ImportError as exc:
    raise ModuleNotFoundError(
        f"asiento.mcp needs the MCP SDK: pip install 'asiento[mcp]' ({exc})", name=exc.name
    ) from exc

from ._annotations import UNTRUSTED, Treatment, treatment
from ._keys import CONFLICT, IDEMPOTENCY_KEY, IN_PROGRESS, OUTCOME, UNKNOWN
from ._runner import McpRunner
from ._source import McpServer
from ._tool import McpTool
from .server import IdempotencyKeys

del _mcp_sdk

__all__ = [
    "CONFLICT",
    "IDEMPOTENCY_KEY",
    "IN_PROGRESS",
    "OUTCOME",
    "UNKNOWN",
    "UNTRUSTED",
    "IdempotencyKeys",
    "McpRunner",
    "McpServer",
    "McpTool",
    "Treatment",
    "treatment",
]
