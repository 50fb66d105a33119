"""``asiento gateway``: the idempotency proxy (needs the ``gateway`` extra: starlette, uvicorn,
httptools, uvloop)."""

from .app import (
    DEFAULT_LEASE,
    DEFAULT_PORT,
    DEFAULT_TTL,
    DEFAULT_UPSTREAM,
    DEFAULT_UPSTREAM_TIMEOUT,
    IdempotencyProxy,
    KeyStore,
    ProxyError,
    ProxyStats,
    create_app,
    serve,
)

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_PORT",
    "DEFAULT_TTL",
    "DEFAULT_UPSTREAM",
    "DEFAULT_UPSTREAM_TIMEOUT",
    "IdempotencyProxy",
    "KeyStore",
    "ProxyError",
    "ProxyStats",
    "create_app",
    "serve",
]
