"""asiento and the Model Context Protocol (the ``mcp`` extra: ``pip install 'asiento[mcp]'``).

``asiento.mcp.server.IdempotencyKeys``: for MCP servers, deduplicate tool calls
by the idempotency key asiento sends (docs/mcp-servers.md).
"""

from asiento.mcp.server import IdempotencyKeys

__all__ = ["IdempotencyKeys"]
