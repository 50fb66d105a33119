"""``InvoiceServer``: a real invoice API on 127.0.0.1, to test effects against.

It speaks HTTP over a real socket, so an effect under test goes through its
real client, retries and all. Two kinds of destination:

- ``honour_keys=True`` deduplicates by ``Idempotency-Key`` as Stripe does: the
  same key with the same body gets the first answer again (and the header
  ``Idempotent-Replayed: true``) without creating anything; the same key with
  another body gets ``400`` ``{"error": {"type": "idempotency_error"}}``; keys
  are forgotten ``key_ttl`` seconds after their first use.
- ``honour_keys=False`` ignores the header: every valid POST creates an
  invoice, so only a lookup by business id (``GET /invoices?number=...``)
  can tell whether an effect already happened.

Routes: ``POST /invoices`` (a JSON object with ``customer``, ``amount`` and
``number``), ``GET /invoices`` (``{"data": [...]}``, optionally filtered with
``?number=``) and ``GET /invoices/<id>``. ``fail_next`` and ``drop_next``
inject failures into the next requests, to exercise retries.

    with InvoiceServer(honour_keys=False) as server:
        effect = PublishInvoice(server.invoices_url)
        ...
        assert len(server.invoices) == 1
"""

from __future__ import annotations

import hashlib
import json
import socketserver
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["InvoiceServer"]

_DROP = "drop"
_DROP_APPLIED = "drop_applied"
_GARBLE = "garble"  # applied, then a 200 whose body is not JSON


@dataclass(frozen=True, slots=True)
class _Raw:
    """A body sent as these bytes, not as JSON."""

    raw: bytes


_NOT_JSON = _Raw(b"<html>502 Bad Gateway</html>")


@dataclass(frozen=True, slots=True)
class _Answer:
    """One HTTP answer: a status, a JSON body and extra headers."""

    status: int
    body: Any
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class _Remembered:
    """What the server answered the first time it saw an idempotency key."""

    body_hash: str
    answer: _Answer
    at: float


@dataclass(slots=True)
class _State:
    """Everything the server holds; guarded by ``InvoiceServer._lock``."""

    invoices: list[dict[str, Any]] = field(default_factory=list)
    keys: dict[str, _Remembered] = field(default_factory=dict)
    posts: int = 0
    headers_seen: list[str | None] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    faults: deque[int | str] = field(default_factory=deque)


class InvoiceServer:
    """A threaded HTTP invoice API bound to 127.0.0.1 on a free port.

    Use it as a context manager (or ``start()`` / ``stop()``). The counters
    (``invoices``, ``posts``, ``headers_seen``, ``bodies``) are copies taken
    under a lock, safe to read while requests are being served.
    """

    def __init__(self, *, honour_keys: bool = True, key_ttl: float = 24 * 3600.0) -> None:
        self.honour_keys = honour_keys
        self.key_ttl = key_ttl
        self._lock = threading.Lock()
        self._state = _State()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- life cycle ----------------------------------------------------------------

    def start(self) -> InvoiceServer:
        """Bind 127.0.0.1 on a free port and serve in a daemon thread."""
        if self._httpd is not None:
            raise RuntimeError("InvoiceServer is already running")
        self._httpd = _HTTPServer(self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.05,), name="InvoiceServer", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd, self._thread = None, None

    def __enter__(self) -> InvoiceServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The server's base URL, ``http://127.0.0.1:<port>``."""
        if self._httpd is None:
            raise RuntimeError("InvoiceServer is not running; use start() or a with block")
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def invoices_url(self) -> str:
        """Where invoices are POSTed and listed."""
        return f"{self.url}/invoices"

    # -- what a test reads ---------------------------------------------------------

    @property
    def invoices(self) -> list[dict[str, Any]]:
        """Every invoice created, in order."""
        with self._lock:
            return [dict(invoice) for invoice in self._state.invoices]

    @property
    def posts(self) -> int:
        """How many ``POST /invoices`` arrived, failed and replayed ones included."""
        with self._lock:
            return self._state.posts

    @property
    def headers_seen(self) -> list[str | None]:
        """The ``Idempotency-Key`` of every POST, in order (None when absent)."""
        with self._lock:
            return list(self._state.headers_seen)

    @property
    def bodies(self) -> list[bytes]:
        """The raw body of every POST, in order."""
        with self._lock:
            return list(self._state.bodies)

    # -- what a test changes -------------------------------------------------------

    def fail_next(self, n: int = 1, *, status: int = 503) -> None:
        """Answer the next ``n`` requests with ``status`` before doing anything."""
        self._add_faults(n, status)

    def drop_next(self, n: int = 1, *, applied: bool = False) -> None:
        """Close the connection of the next ``n`` requests without an answer.

        ``applied=True`` handles the request first (the invoice is created), so
        the answer is lost after the effect happened: the client cannot know.
        """
        self._add_faults(n, _DROP_APPLIED if applied else _DROP)

    def garble_next(self, n: int = 1) -> None:
        """Handle the next ``n`` requests, then answer 200 with a body that is not JSON."""
        self._add_faults(n, _GARBLE)

    def expire_keys(self) -> None:
        """Forget every idempotency key now, as if ``key_ttl`` had passed."""
        with self._lock:
            self._state.keys.clear()

    def _add_faults(self, n: int, fault: int | str) -> None:
        if n < 0:
            raise ValueError("the number of requests to fail must be >= 0")
        with self._lock:
            self._state.faults.extend([fault] * n)

    # -- request handling ----------------------------------------------------------

    def _answer(self, method: str, target: str, key: str | None, body: bytes) -> _Answer | None:
        """The answer to one request; None means: close the connection without one."""
        with self._lock:
            fault = self._state.faults.popleft() if self._state.faults else None
            if method == "POST":
                self._state.posts += 1
                self._state.headers_seen.append(key)
                self._state.bodies.append(body)
            if isinstance(fault, int):
                return _error(fault, "api_error", "injected failure")
            if fault == _DROP:
                return None
            answer = self._route(method, target, key, body)
            if fault == _GARBLE:
                return _Answer(answer.status, _NOT_JSON, answer.headers)
            return None if fault == _DROP_APPLIED else answer

    def _route(self, method: str, target: str, key: str | None, body: bytes) -> _Answer:
        parts = urlsplit(target)
        path = parts.path.rstrip("/")
        if method == "POST" and path == "/invoices":
            return self._post(key, body)
        if method == "GET" and path == "/invoices":
            return self._list(parse_qs(parts.query).get("number"))
        if method == "GET" and path.startswith("/invoices/"):
            return self._get(path.removeprefix("/invoices/"))
        return _error(404, "invalid_request_error", f"no route for {method} {parts.path}")

    def _post(self, key: str | None, body: bytes) -> _Answer:
        if not self.honour_keys or key is None:
            return self._create(body)
        self._forget_old_keys()
        body_hash = _parameters_hash(body)
        seen = self._state.keys.get(key)
        if seen is not None and seen.body_hash != body_hash:
            message = f"key {key!r} was already used with other parameters"
            return _error(400, "idempotency_error", message)
        if seen is not None:
            return _Answer(seen.answer.status, seen.answer.body, (("Idempotent-Replayed", "true"),))
        answer = self._create(body)
        if answer.status < 400:
            # Like Stripe, a request that failed validation leaves no saved result.
            self._state.keys[key] = _Remembered(body_hash, answer, time.monotonic())
        return answer

    def _forget_old_keys(self) -> None:
        now = time.monotonic()
        keys = self._state.keys
        for key in [k for k, seen in keys.items() if now - seen.at >= self.key_ttl]:
            del keys[key]

    def _create(self, body: bytes) -> _Answer:
        fields, problem = _invoice_fields(body)
        if problem is not None:
            return _error(400, "invalid_request_error", problem)
        invoice = {"id": f"in_{len(self._state.invoices) + 1:06d}", "object": "invoice", **fields}
        self._state.invoices.append(invoice)
        return _Answer(200, dict(invoice))

    def _list(self, numbers: list[str] | None) -> _Answer:
        found = [i for i in self._state.invoices if numbers is None or i["number"] in numbers]
        return _Answer(200, {"object": "list", "data": [dict(i) for i in found]})

    def _get(self, invoice_id: str) -> _Answer:
        for invoice in self._state.invoices:
            if invoice["id"] == invoice_id:
                return _Answer(200, dict(invoice))
        return _error(404, "invalid_request_error", f"no such invoice: {invoice_id!r}")


def _parameters_hash(body: bytes) -> str:
    """Like Stripe, compare the parameters, not their spelling: key order does not count."""
    try:
        text = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return hashlib.sha256(body).hexdigest()
    return hashlib.sha256(text.encode()).hexdigest()


def _error(status: int, kind: str, message: str) -> _Answer:
    return _Answer(status, {"error": {"type": kind, "message": message}})


def _invoice_fields(body: bytes) -> tuple[dict[str, Any], str | None]:
    """The invoice's fields from a POST body, or why the body is refused."""
    try:
        data = json.loads(body or b"null")
    except ValueError:
        return {}, "the body is not JSON"
    if not isinstance(data, dict):
        return {}, "the body must be a JSON object"
    customer, amount, number = data.get("customer"), data.get("amount"), data.get("number")
    if not isinstance(customer, str) or not customer:
        return {}, "customer: a non-empty string is required"
    if not isinstance(amount, int) or isinstance(amount, bool) or amount < 0:
        return {}, "amount: a non-negative integer (cents) is required"
    if not isinstance(number, str) or not number:
        return {}, "number: a non-empty string is required"
    return dict(data), None


class _HTTPServer(ThreadingHTTPServer):
    """The socket side: a thread per request, bound to 127.0.0.1 on a free port."""

    daemon_threads = True
    request_queue_size = 128  # the default 5 resets bursts of concurrent clients

    def __init__(self, app: InvoiceServer) -> None:
        self.app = app
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client killed mid-request (a crash test's whole point) is not an error."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)

    def server_bind(self) -> None:
        """Bind without ``HTTPServer``'s reverse DNS lookup of the host name."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)


class _Handler(BaseHTTPRequestHandler):
    """Reads one request, asks ``InvoiceServer._answer`` and writes its answer."""

    server_version = "InvoiceServer/1"

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length > 0 else b""
        assert isinstance(self.server, _HTTPServer)
        key = self.headers.get("Idempotency-Key")
        answer = self.server.app._answer(method, self.path, key, body)
        if answer is None:
            self.close_connection = True
            return
        data = (
            answer.body.raw if isinstance(answer.body, _Raw) else json.dumps(answer.body).encode()
        )
        self.send_response(answer.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in answer.headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read the counters, not a log on stderr."""
