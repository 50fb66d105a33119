"""Who may read and write, and from where: the token, the session, CSRF and Host checks.

Run data is personal data (tool arguments hold names, e-mails, amounts), so every
page and every JSON answer needs the operator token, in one of two ways (``Guard.access``
tells which a request proved):

- a person logs in with a form (name + token, compared in constant time); the server
  answers with a session cookie signed with a secret made at start (a restart logs
  everybody out), ``HttpOnly`` and ``SameSite=Strict``; the name is recorded as ``by``;
- a script sends ``Authorization: Bearer TOKEN`` (and a ``by`` form field to write).

The one exception is explicit: ``open_reading`` lets requests that reach the server
on a loopback address read without the token (``asiento serve --open-reading``, which
refuses any other address: ``check_open_reading``). Writes need the token always.

Cross-site writes are refused three times over: a browser does not send a
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
import ipaddress
import json
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import UsageError

SESSION_COOKIE = "asiento_session"
SESSION_TTL = 12 * 3600
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, slots=True)
class Operator:
    """A logged-in person: the name recorded with their decisions, and the session's id."""

    by: str
    sid: str


@dataclass(frozen=True, slots=True)
class Access:
    """What a request proved: a person's session, the token in its header, or neither.

    ``wrong_header``: it sent an ``Authorization`` header without the token; such a
    request is refused even if it also carries a valid session.
    """

    operator: Operator | None = None
    bearer: bool = False
    wrong_header: bool = False

    @property
    def has_token(self) -> bool:
        return not self.wrong_header and (self.bearer or self.operator is not None)


class Guard:
    """The token, the session cookies and the CSRF fields of one server process."""

    def __init__(self, token: str, *, open_reading: bool = False) -> None:
        self._token = token.encode()
        self._secret = secrets.token_bytes(32)
        self.open_reading = open_reading

    def access(self, request: Request) -> Access:
        """What ``request`` proves: its ``Authorization`` header, else its session cookie."""
        operator = self.operator(request.cookies.get(SESSION_COOKIE))
        header = request.headers.get("authorization")
        if header is None:
            return Access(operator=operator)
        if self.bearer_ok(header):
            return Access(operator=operator, bearer=True)
        return Access(wrong_header=True)

    def may_read(self, request: Request, access: Access) -> bool:
        """With the token; or, when reading is open, over a loopback connection."""
        if access.has_token:
            return True
        if not self.open_reading or access.wrong_header:
            return False
        server, client = request.scope.get("server"), request.scope.get("client")
        return bool(server and client and is_loopback(str(server[0])) and is_loopback(client[0]))

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
        # Bytes: a cookie is the client's to write, non-ASCII included (str would raise).
        expected = self._sign("session", body).encode()
        if not body or not hmac.compare_digest(signature.encode(), expected):
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


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) is this machine's loopback."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_open_reading(host: str, allowed_hosts: Iterable[str]) -> None:
    """Open reading only on a loopback address, and not behind a proxy: else a ``UsageError``."""
    if not is_loopback(host):
        raise UsageError(
            f"--open-reading lets anyone who reaches the port read the runs without the token, "
            f"so it needs a loopback address; {host!r} is not one (use --host 127.0.0.1, or "
            "drop --open-reading and log in with the token)"
        )
    if list(allowed_hosts):
        raise UsageError(
            "--open-reading cannot be combined with --allowed-host: a proxy on this machine "
            "would hand every visitor's reads to the page over loopback"
        )


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
