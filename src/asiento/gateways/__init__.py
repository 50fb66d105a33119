"""Real model providers behind the ``Gateway`` protocol, chosen by object or by a short string.

    gateway_from_string("openai:gpt-4o")
    gateway_from_string("anthropic:claude-sonnet-4-5")
    gateway_from_string("openai-compatible:llama3.1@http://localhost:11434/v1")

The SDKs (``openai``, ``anthropic``) are imported only when a gateway is made.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import UsageError
from ._errors import (
    ModelCallFailed,
    ModelRequestRejected,
    ModelResponseInvalid,
    ModelUnavailable,
    RateLimited,
)
from .anthropic import AnthropicGateway
from .openai import Api, OpenAIGateway
from .quota import Quota
from .rate_limit import RateLimitPolicy

__all__ = [
    "API_KEY_ENV",
    "GATEWAY_FORMS",
    "AnthropicGateway",
    "ModelCallFailed",
    "ModelRequestRejected",
    "ModelResponseInvalid",
    "ModelUnavailable",
    "OpenAIGateway",
    "Quota",
    "RateLimitPolicy",
    "RateLimited",
    "gateway_from_string",
]

#: The API key an ``openai-compatible`` gateway sends; never ``OPENAI_API_KEY``, so an
#: OpenAI key is not handed to another server by accident. Local servers ignore it.
API_KEY_ENV = "ASIENTO_API_KEY"

GATEWAY_FORMS = (
    "openai:MODEL[@URL]",
    "openai-responses:MODEL[@URL]",
    "anthropic:MODEL[@URL]",
    "openai-compatible:MODEL@URL",
)

_AT_URL = re.compile(r"^(?P<model>.+)@(?P<url>https?://\S+)$")


def gateway_from_string(spec: str, **options: Any) -> OpenAIGateway | AnthropicGateway:
    """Make a gateway from ``kind:MODEL`` or ``kind:MODEL@URL`` (see ``GATEWAY_FORMS``).

    ``URL`` is the base URL the SDK is given (for instance an ``asiento gateway``
    proxy). ``openai`` and ``anthropic`` read their keys from ``OPENAI_API_KEY``
    and ``ANTHROPIC_API_KEY``; ``openai-compatible`` from ``ASIENTO_API_KEY``.
    Extra keyword arguments go to the gateway's constructor.
    """
    kind, _, rest = spec.partition(":")
    match = _AT_URL.match(rest)
    model, url = (match["model"], match["url"]) if match else (rest, None)
    if not model or kind not in {f.split(":")[0] for f in GATEWAY_FORMS}:
        raise UsageError(f"unknown gateway {spec!r}; use one of: {', '.join(GATEWAY_FORMS)}")
    if kind == "anthropic":
        return AnthropicGateway(model, base_url=url, **options)
    if kind == "openai-compatible":
        if url is None:
            raise UsageError(f"{spec!r} needs the server's URL: openai-compatible:MODEL@URL")
        options.setdefault("api_key", os.environ.get(API_KEY_ENV) or "unused")
    api: Api = "responses" if kind == "openai-responses" else "chat"
    return OpenAIGateway(model, api=api, base_url=url, **options)
