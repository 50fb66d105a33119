"""Who may write, and from where: the token, the session cookie, CSRF and Host checks.

Reading is open to whoever reaches the port (bind it to 127.0.0.1, the
default). Every request that writes needs the operator token, in one of two ways:

- a person logs in with a form (name + token); the server answers with a
  session cookie signed with a secret made at start (a restart logs everybody
  out), ``HttpOnly`` and ``SameSite=Strict``; the name is recorded as ``by``;
- a script sends ``Authorization: Bearer TOKEN`` and a ``by`` form field.

Cross-site requests are refused three times over: a browser does not send a
``SameSite=Strict`` cookie with a request started by another site; every
form carries a CSRF field, an HMAC of the session's random id that another
site cannot read or compute; and a POST whose ``Origin`` (or ``Referer``) is not
this server is refused before anything else. The Bearer header needs no CSRF
field: a browser never adds it by itself, and no CORS header lets another site
set it. A ``Host`` header that is not one of the server's names is refused, so
a DNS-rebinding page cannot read or write through a visitor's browser.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

SESSION_COOKIE = "asiento_session"
SESSION_TTL = 12 * 3600
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, slots=True)
class Operator:
    """A logged-in person: the name recorded with their decisions, and the session's id."""

    by: str
    sid: str


class Guard:
    """The token, the session cookies and the CSRF fields of one server process."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self._secret = secrets.token_bytes(32)

    def token_ok(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self._token)

    def bearer_ok(self, header: str) -> bool:
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and self.token_ok(given.strip())

    def cookie_for(self, by: str) -> str:
        """A signed session for ``by``, valid for ``SESSION_TTL`` seconds."""
        claims = {"by": by, "exp": int(time.time()) + SESSION_TTL, "sid": secrets.token_hex(16)}
        body = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode()
        return f"{body}.{self._sign('session', body)}"

    def operator(self, cookie: str | None) -> Operator | None:
        """The person a session cookie names, if its signature holds and it has not expired."""
        body, _, signature = (cookie or "").partition(".")
        if not body or not hmac.compare_digest(signature, self._sign("session", body)):
            return None
        try:
            claims = json.loads(base64.urlsafe_b64decode(body))
            if int(claims["exp"]) < time.time():
                return None
            return Operator(by=str(claims["by"]), sid=str(claims["sid"]))
        except (ValueError, KeyError, TypeError):
            return None

    def csrf(self, operator: Operator | None) -> str:
        """The hidden form field of this session's forms (empty when nobody is logged in)."""
        return "" if operator is None else self._sign("csrf", operator.sid)

    def csrf_ok(self, operator: Operator, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self.csrf(operator).encode())

    def _sign(self, purpose: str, text: str) -> str:
        mac = hmac.new(self._secret, f"{purpose}:{text}".encode(), hashlib.sha256)
        return mac.hexdigest()


def same_origin(request: Request) -> bool:
    """False when a browser says the request comes from another site.

    A request without ``Origin`` and ``Referer`` was not sent by a page (a
    script, curl): it is let through here, and the token decides.
    """
    sent = request.headers.get("origin") or request.headers.get("referer")
    if not sent:
        return True
    parts = urlsplit(sent)
    return f"{parts.scheme}://{parts.netloc}" == f"{request.url.scheme}://{request.url.netloc}"


def host_name(header: str) -> str:
    """The name in a ``Host`` header, without its port (IPv6 in brackets too)."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class AllowedHosts:
    """Refuse requests whose ``Host`` is not one of the server's names (DNS rebinding)."""

    def __init__(self, app: ASGIApp, hosts: Iterable[str]) -> None:
        self.app = app
        self.hosts = frozenset(h.lower().strip("[]") for h in hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            name = host_name(headers.get(b"host", b"").decode("latin-1")).lower()
            if "*" not in self.hosts and name not in self.hosts:
                await send({"type": "http.response.start", "status": 421, "headers": _TEXT})
                body = f"this server does not answer to Host {name!r}\n".encode()
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


_TEXT = [(b"content-type", b"text/plain; charset=utf-8")]
