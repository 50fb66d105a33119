"""``asiento serve``: the web page for operators.

Needs the ``web`` extra (starlette, uvicorn, jinja2).

``create_app(store_url, token=...)`` is the ASGI app, for your own server;
``serve(store_url, token=..., host=..., port=...)`` runs it with uvicorn. Reading
needs the token as writing does, unless ``open_reading=True`` (loopback only).
"""

from .app import DEFAULT_PORT, create_app, serve
from .security import SESSION_COOKIE, check_open_reading

__all__ = ["DEFAULT_PORT", "SESSION_COOKIE", "check_open_reading", "create_app", "serve"]
