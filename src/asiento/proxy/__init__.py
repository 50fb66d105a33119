"""``asiento gateway``: the idempotency proxy (needs the ``gateway`` extra: starlette, uvicorn)."""

from .app import (
    DEFAULT_PORT,
    DEFAULT_TTL,
    DEFAULT_UPSTREAM,
    IdempotencyProxy,
    KeyStore,
    ProxyError,
    ProxyStats,
    create_app,
    serve,
)

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_TTL",
    "DEFAULT_UPSTREAM",
    "IdempotencyProxy",
    "KeyStore",
    "ProxyError",
    "ProxyStats",
    "create_app",
    "serve",
]
