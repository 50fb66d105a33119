"""The names both ends of an MCP call agree on: where the key travels, what a server answers.

A client (``asiento.mcp``) sends the step's idempotency key in every ``tools/call``
request's ``_meta`` under ``IDEMPOTENCY_KEY``. A deduplicating server answers a key
it saw with the first call's result; when it cannot know that call's outcome (it died
mid-call) it answers an error result (``isError: true``) whose ``_meta`` holds
``OUTCOME: UNKNOWN``, and ``OUTCOME: IN_PROGRESS`` while the first call still runs;
``OUTCOME: CONFLICT`` says the key was first used with other arguments.
``asiento.mcp.server`` (the server's end) takes its names from here, and adds
``REPLAYED`` to a result answered from its record and ``BAD_KEY`` to a refused key.
"""

from __future__ import annotations

IDEMPOTENCY_KEY = "asiento/idempotency-key"  # request: the step's key, a string
REPLAYED = "asiento/replayed"  # result: true when answered from the server's record
OUTCOME = "asiento/outcome"  # error result: why the tool did not run
UNKNOWN = "unknown"
IN_PROGRESS = "in-progress"
CONFLICT = "conflict"
BAD_KEY = "bad-key"
