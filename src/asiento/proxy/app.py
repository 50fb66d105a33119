"""``asiento gateway``: an OpenAI-compatible proxy that honours ``Idempotency-Key`` durably.

OpenAI and Anthropic ignore idempotency keys, so a process killed after sending
a model request and before recording its answer pays for that answer again on
resume. Put this proxy between the gateway and the provider and it does not:

- a ``POST`` to ``/v1/chat/completions``, ``/v1/responses`` or ``/v1/messages``
  with an ``Idempotency-Key`` is claimed in SQLite (committed) before it goes
  upstream, and its answer is committed before it is returned;
- the same key again gets the stored answer (``Idempotent-Replayed: true``),
  and the provider is not called;
- the same key while its request is in flight waits for that answer (up to
  ``wait`` seconds, then ``409`` with ``Retry-After``, which the SDKs retry);
- the same key with another body is refused with ``422``
  (``idempotency_key_reused``), never answered with the other body's answer;
- keys expire ``ttl`` seconds after their first use;
- a request with ``"stream": true`` and a key is claimed the same way; the
  proxy reads upstream's stream to its end (even when its client is gone),
  relaying it as it comes, and keeps it once it ends with its API's last
  event; the same key again gets the kept events, and a request for a key
  whose stream is still coming attaches to it (the events so far, then the
  rest live; see ``_recording``). A stream without a key is passed through,
  never claimed nor kept (``Asiento-Gateway: passthrough-stream``).

The upstream call belongs to the proxy, not to the client's connection: a
client killed mid-request does not cancel it, and its answer is kept for the
resumed run. Only answers a gateway could record are kept (a 2xx that parses);
errors pass through and release the key, so a retry calls upstream again.
Everything else (other paths, no key) is forwarded as it is. Keys are scoped by
the credentials that sent them (a hash of ``Authorization`` / ``x-api-key``),
so two tenants of one proxy never see each other's answers.

An in-flight claim holds a lease that its proxy renews (every third of the
lease) for as long as the upstream call is alive, fenced to that one claim: a
live holder keeps its key however long the answer takes. A claim whose proxy
process died in this PID namespace of this host is taken over at once; any
other (another host, another container) once its lease has run out unrenewed.
``upstream_timeout`` bounds the whole upstream answer, from sending the request
to its last byte; ``read_timeout`` bounds each silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import sqlite3
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._canonical import canonical_json, sha256_hex
from .._listen import listening_socket
from ..errors import AsientoError
from ..gateways._errors import ModelResponseInvalid, read_answer
from ..gateways.anthropic import parse_message
from ..gateways.openai import parse_chat, parse_responses
from ..gateways.quota import CHARS_PER_TOKEN, Quota, Reservation
from ..lease import Holder, is_dead_here
from . import _tracing
from ._convert import STREAM_OPTIONS, is_stream, plain_from_stream, stream_from_plain
from ._recording import Recording
from ._stream import PassedThrough, wants_stream

DEFAULT_PORT = 8787
DEFAULT_TTL = 24 * 3600.0
DEFAULT_UPSTREAM = "https://api.openai.com/v1"
DEFAULT_LEASE = 30.0
DEFAULT_UPSTREAM_TIMEOUT = 600.0
RENEWALS_PER_LEASE = 3  # a live holder renews every third of its lease: two may be late
POLL = 0.05
KEY_STORE_ID = 0x41534E50  # "ASNP": PRAGMA application_id of a key store ("ASNT" is a journal)
PARSERS = {
    "/v1/chat/completions": parse_chat,
    "/v1/responses": parse_responses,
    "/v1/messages": parse_message,
}
# Hop-by-hop and framing headers are the connection's, never forwarded; httpx decodes
# the body, so content-encoding and content-length no longer describe what we send.
_REQUEST_DROP = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
     "trailer", "upgrade", "accept-encoding", "proxy-authorization", "proxy-connection"}
)  # fmt: skip
_RESPONSE_DROP = frozenset(
    {"content-length", "content-encoding", "transfer-encoding", "connection", "keep-alive",
     "date", "server", "set-cookie"}
)  # fmt: skip

_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency_keys (
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('in_flight', 'done')),
    status INTEGER,
    headers TEXT,
    body BLOB,
    created_at REAL NOT NULL,
    owner TEXT NOT NULL,
    owner_host TEXT NOT NULL,
    owner_pid INTEGER NOT NULL,
    owner_started TEXT NOT NULL,
    lease_until REAL NOT NULL,
    PRIMARY KEY (scope, key)
);
CREATE INDEX IF NOT EXISTS idempotency_keys_created ON idempotency_keys (created_at);
"""


class ProxyError(AsientoError):
    """The idempotency proxy cannot start or use its key store."""


@dataclass(frozen=True, slots=True)
class Stored:
    """An answer kept under a key: what the client gets again."""

    status: int
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class Claim:
    """What a key holds when a request for it arrives."""

    kind: Literal["new", "done", "in_flight", "conflict"]
    stored: Stored | None = None
    token: str = ""  # of a "new" claim: what renews, finishes or releases this claim only


class KeyStore:
    """The proxy's SQLite file: one row per (credential scope, idempotency key).

    Every write is one ``BEGIN IMMEDIATE`` transaction with ``synchronous=FULL``:
    a claim is on disk before the request goes upstream, an answer before it is
    returned. One connection, used from worker threads under a lock.

    A claim's ``owner`` column holds the claim's own token (the holder's id and
    a counter), so renewing, finishing and releasing are fenced to the claim: a
    claim taken over, even by this same process, is not touched again.
    """

    def __init__(self, path: str | Path, *, ttl: float, lease: float, holder: Holder) -> None:
        self.path, self.ttl, self.lease, self.holder = Path(path), ttl, lease, holder
        self._lock = threading.Lock()
        self._claims = itertools.count(1)
        try:
            self._db = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=10.0
            )
            self._check_identity()
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA application_id = {KEY_STORE_ID}")
        except sqlite3.Error as exc:
            raise ProxyError(f"cannot open the key store {self.path}: {exc}") from exc

    def _check_identity(self) -> None:
        """Refuse a database that is not a key store (a run journal given by mistake)."""
        app_id = self._db.execute("PRAGMA application_id").fetchone()[0]
        others = self._db.execute(
            "SELECT count(*) FROM sqlite_master WHERE name != 'idempotency_keys'"
            " AND name NOT LIKE 'idempotency_keys%' AND name NOT LIKE 'sqlite_%'"
        ).fetchone()[0]
        if app_id != KEY_STORE_ID and (app_id != 0 or others):
            self._db.close()
            raise ProxyError(
                f"{self.path} is not an asiento gateway key store (it holds other data, "
                "perhaps a run journal); give the proxy a file of its own"
            )

    def claim(self, scope: str, key: str, fingerprint: str) -> Claim:
        """Take the key for this request, or say who has it. Atomic against rival proxies."""
        now = time.time()
        with self._transaction() as db:
            db.execute(
                "DELETE FROM idempotency_keys WHERE state = 'done' AND created_at <= ?",
                (now - self.ttl,),
            )
            row = db.execute(
                "SELECT fingerprint, state, status, headers, body, owner_host, owner_pid,"
                " owner_started, lease_until FROM idempotency_keys WHERE scope = ? AND key = ?",
                (scope, key),
            ).fetchone()
            if row is None:
                token = self._token()
                db.execute(
                    "INSERT INTO idempotency_keys (scope, key, fingerprint, state, created_at,"
                    " owner, owner_host, owner_pid, owner_started, lease_until)"
                    " VALUES (?, ?, ?, 'in_flight', ?, ?, ?, ?, ?, ?)",
                    (scope, key, fingerprint, now, *self._owner(token, now)),
                )
                return Claim("new", token=token)
            return self._existing(db, row, (scope, key), fingerprint, now)

    def _existing(
        self, db: sqlite3.Connection, row: Any, ident: tuple[str, str], fp: str, now: float
    ) -> Claim:
        recorded_fp, state, status, headers, body, host, pid, started, lease_until = row
        if recorded_fp != fp:
            return Claim("conflict")
        if state == "done":
            return Claim("done", Stored(status, json.loads(headers), bytes(body)))
        # A live holder renews its lease; only a dead one, or one silent past it, is replaced.
        if lease_until > now and not is_dead_here(host, pid, started):
            return Claim("in_flight")
        token = self._token()
        db.execute(
            "UPDATE idempotency_keys SET owner = ?, owner_host = ?, owner_pid = ?,"
            " owner_started = ?, lease_until = ? WHERE scope = ? AND key = ?",
            (*self._owner(token, now), *ident),
        )
        return Claim("new", token=token)

    def renew(self, scope: str, key: str, token: str) -> bool:
        """Extend the claim's lease; False when it is no longer this claim's (taken over)."""
        with self._transaction() as db:
            renewed = db.execute(
                "UPDATE idempotency_keys SET lease_until = ?"
                " WHERE scope = ? AND key = ? AND owner = ? AND state = 'in_flight'",
                (time.time() + self.lease, scope, key, token),
            )
            return renewed.rowcount == 1

    def finish(self, scope: str, key: str, token: str, answer: Stored) -> None:
        """Keep the answer under the key, if the claim ``token`` still holds it."""
        with self._transaction() as db:
            db.execute(
                "UPDATE idempotency_keys SET state = 'done', status = ?, headers = ?, body = ?"
                " WHERE scope = ? AND key = ? AND owner = ? AND state = 'in_flight'",
                (answer.status, json.dumps(answer.headers), answer.body, scope, key, token),
            )

    def release(self, scope: str, key: str, token: str) -> None:
        """Give the key up (no answer worth keeping), if the claim ``token`` still holds it."""
        with self._transaction() as db:
            db.execute(
                "DELETE FROM idempotency_keys WHERE scope = ? AND key = ? AND owner = ?"
                " AND state = 'in_flight'",
                (scope, key, token),
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _token(self) -> str:
        return f"{self.holder.owner}.{next(self._claims)}"

    def _owner(self, token: str, now: float) -> tuple[str, str, int, str, float]:
        h = self.holder
        return (token, h.host, h.pid, h.started, now + self.lease)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")


@dataclass(slots=True)
class ProxyStats:
    """What the proxy did since it started: calls it made upstream and answers it replayed."""

    upstream_calls: int = 0
    replayed: int = 0
    conflicts: int = 0
    streams_passed_through: int = 0
    streams_recorded: int = 0  # streams read to their end and kept under their key
    streams_attached: int = 0  # requests that joined a stream still coming


class IdempotencyProxy:
    """The request handling behind ``create_app``: forward, or claim / replay / wait / refuse."""

    def __init__(
        self,
        upstream: str,
        store: KeyStore,
        client: httpx.AsyncClient,
        *,
        wait: float,
        upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT,
        quota: Quota | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.store, self.client, self.wait = store, client, wait
        self.upstream_timeout = upstream_timeout
        self.quota = quota or Quota()
        self.stats = ProxyStats()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._live: dict[tuple[str, str], Recording] = {}  # streams this process is reading

    async def handle(self, request: Request) -> Response:
        """Answer one request; one with a ``traceparent`` in a span of its trace (``_tracing``)."""
        if not _tracing.traced(request):
            return await self._handle(request)
        joined = _tracing.Joined(request)
        try:
            response = await self._handle(request)
        except BaseException as exc:
            joined.failed(exc)
            raise
        _tracing.answered(response.status_code)
        return joined.ends_with(response)

    async def _handle(self, request: Request) -> Response:
        path = request.url.path
        if path != "/v1" and not path.startswith("/v1/"):
            return _error(404, f"no route {path}; the proxy serves /v1/...", "not_found")
        body = await request.body()
        key = request.headers.get("idempotency-key")
        keyed = request.method == "POST" and bool(key) and path in PARSERS
        if request.method == "POST" and wants_stream(body):
            if key and keyed:
                return await self._recorded_stream(request, body, key)
            return await self._pass_stream(request, body)
        if not key or not keyed:
            return await self._forward(request, body)
        # The proxy's own task, not the client's: a client that dies cancels neither the
        # claim nor the upstream call, and the answer is kept for the resumed run.
        task = asyncio.create_task(self._deduplicated(request, body, key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _deduplicated(self, request: Request, body: bytes, key: str) -> Response:
        scope = _scope(request.headers)
        fp = _fingerprint(request.url.path, body)
        deadline = time.monotonic() + self.wait
        while True:
            claim = await asyncio.to_thread(self.store.claim, scope, key, fp)
            if claim.kind == "new":
                return await self._fetch_and_keep(request, body, scope, key, claim.token)
            if claim.kind == "done" and claim.stored is not None:
                self.stats.replayed += 1
                _tracing.note("replayed")
                return _replayed(request.url.path, claim.stored, stream=False)
            if claim.kind == "conflict":
                self.stats.conflicts += 1
                _tracing.note("conflict")
                return _reused(key)
            if time.monotonic() >= deadline:
                _tracing.note("in_flight")
                return _still_in_flight(key)
            await asyncio.sleep(POLL)

    async def _recorded_stream(self, request: Request, body: bytes, key: str) -> Response:
        """A keyed stream: attach to it, replay it, or claim it and read it to its end."""
        scope, path = _scope(request.headers), request.url.path
        fp = _fingerprint(path, body)
        deadline = time.monotonic() + self.wait
        while True:
            live = self._live.get((scope, key))
            if live is not None:  # this process is reading it: join at the first chunk
                if live.fingerprint != fp:
                    self.stats.conflicts += 1
                    _tracing.note("conflict")
                    return _reused(key)
                self.stats.streams_attached += 1
                _tracing.note("attached")
                return await live.response(_ATTACHED)
            claim, sent = await self._claim_and_build(request, body, (scope, key), fp)
            if claim.kind == "new":
                live = self._live[(scope, key)] = Recording(path, fp)
                recording = self._record(request, body, sent, (scope, key), claim.token, live)
                self._spawn(recording)
                _tracing.note("upstream")
                return await live.response(_RECORDING)
            if claim.kind == "done" and claim.stored is not None:
                self.stats.replayed += 1
                _tracing.note("replayed")
                return _replayed(path, claim.stored, stream=True)
            if claim.kind == "conflict":
                self.stats.conflicts += 1
                _tracing.note("conflict")
                return _reused(key)
            if time.monotonic() >= deadline:  # another proxy process is reading it
                _tracing.note("in_flight")
                return _still_in_flight(key)
            await asyncio.sleep(POLL)

    async def _claim_and_build(
        self, request: Request, body: bytes, ident: tuple[str, str], fp: str
    ) -> tuple[Claim, httpx.Request]:
        """The key's claim, and the upstream request built while the claim commits.

        The loop would only wait for the claim's fsync; the request is sent once the
        claim is on disk (by ``_record``), never before.
        """
        claiming = asyncio.ensure_future(asyncio.to_thread(self.store.claim, *ident, fp))
        try:
            sent = self._build(request, body)
        except BaseException:
            claim = await claiming
            if claim.kind == "new":  # nothing will be sent: a retry asks upstream again
                await asyncio.to_thread(self.store.release, *ident, claim.token)
            raise
        return await claiming, sent

    async def _record(  # noqa: PLR0917 (one call site; each argument is the stream's)
        self,
        request: Request,
        body: bytes,
        sent: httpx.Request,
        ident: tuple[str, str],
        token: str,
        live: Recording,
    ) -> None:
        """Read upstream's stream to its end for every client of the key; keep it if whole.

        A plain answer (an error) is given only once the key is released, so a retry
        right after it asks upstream again instead of waiting for this claim.
        """
        scope, key = ident
        renewal = asyncio.create_task(self._renew(scope, key, token))
        kept, plain = False, None
        try:
            async with self.quota.slot(_estimate(self.quota, body)) as reservation:
                plain, status, headers = await self._read_stream(sent, live)
            whole = live.whole()
            if status == 429:
                reservation.refund()
            path = request.url.path
            assembled = None if whole is None else plain_from_stream(path, whole)
            if plain is None and assembled is not None and _acceptable(path, assembled):
                answer = Stored(status, headers, whole or b"")
                if self.quota.tokens_per_minute is not None:  # else usage settles nothing
                    _settle(reservation, path, Stored(status, {}, assembled))
                await asyncio.to_thread(self.store.finish, scope, key, token, answer)
                kept = True
                self.stats.streams_recorded += 1
        finally:
            try:
                if not kept:  # nothing whole to keep: a retry asks upstream again
                    await asyncio.to_thread(self.store.release, scope, key, token)
            finally:
                renewal.cancel()  # only once the stream is kept or the key released
                if plain is not None:
                    live.answered(plain)
                live.failed(_error(502, "the proxy stopped reading upstream", "upstream"))
                self._live.pop(ident, None)

    async def _read_stream(
        self, sent: httpx.Request, live: Recording
    ) -> tuple[Response | None, int, dict[str, str]]:
        """Upstream's stream into ``live`` within ``upstream_timeout``, or its plain answer.

        Returns the plain answer (None once streaming began), the status and headers.
        """
        url = str(sent.url)
        self.stats.upstream_calls += 1
        try:
            async with asyncio.timeout(self.upstream_timeout):
                upstream = await self.client.send(sent, stream=True)
                try:
                    status = upstream.status_code
                    kept = {
                        k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROP
                    }
                    streaming = "text/event-stream" in upstream.headers.get("content-type", "")
                    if not (200 <= status < 300 and streaming):
                        return Response(await upstream.aread(), status, headers=kept), status, kept
                    live.started(status, kept)
                    async for chunk in upstream.aiter_bytes():
                        live.add(chunk)
                finally:
                    await upstream.aclose()
        except TimeoutError:
            return self._cut(live, _too_slow(url, self.upstream_timeout))
        except httpx.HTTPError as exc:
            failure = f"upstream {url} failed: {type(exc).__name__}: {exc}"
            return self._cut(live, _error(502, failure, "upstream"))
        live.end(cut=False)
        return None, status, kept

    @staticmethod
    def _cut(live: Recording, error: Response) -> tuple[Response | None, int, dict[str, str]]:
        """A failure before the stream began is an answer; after, the stream is cut."""
        if live.streaming:
            live.end(cut=True)
            return None, error.status_code, {}
        return error, error.status_code, {}

    def _spawn(self, work: Any) -> None:
        """The proxy's own task, not the client's: a client that goes away cancels nothing."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fetch_and_keep(
        self, request: Request, body: bytes, scope: str, key: str, token: str
    ) -> Response:
        renewal = asyncio.create_task(self._renew(scope, key, token))
        try:
            answer = await self._send(request, body)
            kept = isinstance(answer, Stored) and _recordable(request.url.path, answer)
            _tracing.note("upstream", kept=kept)
            if kept and isinstance(answer, Stored):
                await asyncio.to_thread(self.store.finish, scope, key, token, answer)
            else:
                await asyncio.to_thread(self.store.release, scope, key, token)
        except BaseException:
            await asyncio.to_thread(self.store.release, scope, key, token)  # no-op once kept
            raise
        finally:
            renewal.cancel()  # only once the answer is kept or the key released
        return _response(answer)

    async def _renew(self, scope: str, key: str, token: str) -> None:
        """Keep the claim's lease alive while its upstream call is; stop once it is not ours."""
        period = self.store.lease / RENEWALS_PER_LEASE
        while True:
            await asyncio.sleep(period)
            try:
                if not await asyncio.to_thread(self.store.renew, scope, key, token):
                    return
            except sqlite3.Error:
                continue  # busy for once: the next renewal comes well before the lease ends

    async def _forward(self, request: Request, body: bytes) -> Response:
        _tracing.note("forwarded")
        return _response(await self._send(request, body))

    async def _send(self, request: Request, body: bytes) -> Stored | Response:
        """One upstream call under the proxy's quota; its tokens corrected to its usage."""
        async with self.quota.slot(_estimate(self.quota, body)) as reservation:
            answer = await self._send_now(request, body)
        if isinstance(answer, Stored):
            _settle(reservation, request.url.path, answer)
        return answer

    async def _send_now(self, request: Request, body: bytes) -> Stored | Response:
        """One upstream call, its whole answer within ``upstream_timeout``; failures are 5xx."""
        url, headers = self._upstream_request(request)
        self.stats.upstream_calls += 1
        try:
            async with asyncio.timeout(self.upstream_timeout):
                upstream = await self.client.request(
                    request.method, url, content=body, headers=headers
                )
        except TimeoutError:
            return _too_slow(url, self.upstream_timeout)
        except httpx.HTTPError as exc:
            return _error(502, f"upstream {url} failed: {type(exc).__name__}: {exc}", "upstream")
        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROP}
        return Stored(upstream.status_code, kept, upstream.content)

    async def _pass_stream(self, request: Request, body: bytes) -> Response:
        """Relay a streamed request as it streams: no claim, nothing kept (see ``_stream``)."""
        url, headers = self._upstream_request(request)
        self.stats.upstream_calls += 1
        self.stats.streams_passed_through += 1
        _tracing.note("forwarded")
        sent = self.client.build_request(request.method, url, content=body, headers=headers)
        held = contextlib.AsyncExitStack()  # the quota's place, held until the relay ends
        await held.enter_async_context(self.quota.slot(_estimate(self.quota, body)))
        try:
            upstream = await self.client.send(sent, stream=True)
        except BaseException as exc:
            await held.aclose()
            if isinstance(exc, httpx.HTTPError):
                message = f"upstream {url} failed: {type(exc).__name__}: {exc}"
                return _error(502, message, "upstream")
            raise
        return PassedThrough(upstream, _RESPONSE_DROP, on_close=held.aclose)

    def _build(self, request: Request, body: bytes) -> httpx.Request:
        """The upstream request for ``request``, not yet sent."""
        url, headers = self._upstream_request(request)
        return self.client.build_request(request.method, url, content=body, headers=headers)

    def _upstream_request(self, request: Request) -> tuple[str, dict[str, str]]:
        url = self.upstream + request.url.path.removeprefix("/v1")
        if request.url.query:
            url += "?" + request.url.query
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _REQUEST_DROP}
        _tracing.carry_on(headers)  # the proxy's span as upstream's parent, when traced
        return url, headers

    async def drain(self) -> None:
        """Let upstream calls in flight finish and keep their answers (shutdown)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.wait)


def create_app(
    upstream: str = DEFAULT_UPSTREAM,
    *,
    db: str | Path,
    ttl: float = DEFAULT_TTL,
    wait: float = 600.0,
    upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT,
    read_timeout: float | None = None,
    lease: float = DEFAULT_LEASE,
    quota: Quota | None = None,
) -> Starlette:
    """The proxy as an ASGI app; ``app.state.proxy`` is its ``IdempotencyProxy`` once started.

    ``upstream`` is the base URL an SDK would be given (``https://api.openai.com/v1``,
    ``https://api.anthropic.com/v1``, ``http://localhost:11434/v1``): a request for
    ``/v1/chat/completions`` goes to ``{upstream}/chat/completions``.
    ``upstream_timeout`` bounds a whole answer; ``read_timeout`` (default: the same)
    each wait for upstream's next bytes; ``lease`` how long a claim outlives its
    proxy's last renewal. ``quota`` limits what the proxy sends upstream, all
    requests and clients together (a 429 from upstream is relayed to the client,
    whose gateway retries it).
    """
    read_timeout = upstream_timeout if read_timeout is None else read_timeout
    if min(ttl, wait, upstream_timeout, read_timeout, lease) <= 0:
        raise ProxyError(
            "ttl, wait, upstream_timeout, read_timeout and lease must be positive numbers of "
            "seconds"
        )
    KeyStore(db, ttl=ttl, lease=lease, holder=Holder.here()).close()  # a bad file fails here

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        store = KeyStore(db, ttl=ttl, lease=lease, holder=Holder.here())
        timeout = httpx.Timeout(read_timeout, connect=min(read_timeout, 30.0))
        async with httpx.AsyncClient(timeout=timeout) as client:
            proxy = IdempotencyProxy(
                upstream, store, client, wait=wait, upstream_timeout=upstream_timeout, quota=quota
            )
            app.state.proxy = proxy
            try:
                yield
            finally:
                await proxy.drain()
                store.close()

    async def endpoint(request: Request) -> Response:
        proxy: IdempotencyProxy = request.app.state.proxy
        return await proxy.handle(request)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    routes = [Route("/{path:path}", endpoint, methods=methods)]
    return Starlette(routes=routes, lifespan=lifespan)


def serve(
    upstream: str = DEFAULT_UPSTREAM,
    *,
    db: str | Path,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    ttl: float = DEFAULT_TTL,
    wait: float = 600.0,
    upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT,
    read_timeout: float | None = None,
    lease: float = DEFAULT_LEASE,
    quota: Quota | None = None,
    log_level: str = "warning",
) -> None:
    """Run the proxy until interrupted; print the URL clients use (``port=0``: a free one)."""
    import uvicorn

    app = create_app(
        upstream,
        db=db,
        ttl=ttl,
        wait=wait,
        upstream_timeout=upstream_timeout,
        read_timeout=read_timeout,
        lease=lease,
        quota=quota,
    )
    sock = listening_socket(host, port, backlog=2048)  # connectable once the URL is printed
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    limits = f", {quota}" if quota is not None else ""
    print(
        f"asiento gateway: http://{shown}:{bound}/v1 -> {upstream} (keys in {db}, ttl {ttl:g}s"
        f"{limits})",
        file=sys.stderr,
        flush=True,
    )
    http, loop = server_options()
    config = uvicorn.Config(
        app, log_level=log_level, timeout_graceful_shutdown=int(wait), http=http, loop=loop
    )
    uvicorn.Server(config).run(sockets=[sock])


def server_options() -> tuple[str, str]:
    """The proxy's HTTP parser and event loop (uvicorn's ``http``, ``loop``): httptools
    and uvloop, named, never ``auto``.

    Every streamed answer crosses the proxy, so its hop is on each first token:
    httptools parses requests in C where h11 parses them in Python, and uvloop is
    the leaner loop (the proxy spent a tenth less CPU a stream here; figures in
    docs/performance.md). Both come with the ``gateway`` extra; uvloop has no
    Windows build, and there the loop is asyncio's.
    """
    try:
        import httptools  # noqa: F401
    except ImportError as exc:
        raise ProxyError(
            f"asiento gateway needs httptools: pip install 'asiento[gateway]' ({exc})"
        ) from None
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "httptools", "asyncio"
    return "httptools", "uvloop"


_RECORDING = {"asiento-gateway": "recorded-stream"}
_ATTACHED = {"asiento-gateway": "attached-stream", "idempotent-replayed": "true"}


def _recordable(path: str, answer: Stored) -> bool:
    """Keep only what a gateway would record: a 2xx its own rule (``read_answer``) accepts."""
    if not 200 <= answer.status < 300:
        return False
    if "text/event-stream" in answer.headers.get("content-type", ""):
        return True  # judged as it was read (``_record``), assembled
    return _acceptable(path, answer.body)


def _acceptable(path: str, body: bytes) -> bool:
    """Whether a gateway would record this answer (a stream's, as its gateway assembles it)."""
    try:
        read_answer(PARSERS[path], body, provider="upstream", key="proxy", request_id=None)
    except ModelResponseInvalid:
        return False
    return True


def _estimate(quota: Quota, body: bytes) -> int:
    """The request's tokens by the quota's rule (``estimate_tokens``), when tokens are limited."""
    if quota.tokens_per_minute is None:
        return 0
    try:
        params = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        params = None
    if not isinstance(params, dict):
        return -(-len(body) // CHARS_PER_TOKEN)
    return quota.reckon(params)


def _settle(reservation: Reservation, path: str, answer: Stored) -> None:
    """Hold the answer's usage instead of the estimate; a 429 gives its tokens back."""
    if answer.status == 429:
        reservation.refund()
        return
    if path not in PARSERS or not 200 <= answer.status < 300:
        return
    try:
        usage = read_answer(
            PARSERS[path], answer.body, provider="upstream", key="proxy", request_id=None
        ).usage
    except ModelResponseInvalid:
        return
    reservation.settle(usage.input_tokens + usage.output_tokens)


def _replayed(path: str, stored: Stored, *, stream: bool) -> Response:
    """A kept answer given again, in the form the request asks for (streamed or not)."""
    headers = stored.headers | {"idempotent-replayed": "true"}
    if is_stream(stored.headers) == stream:
        return Response(stored.body, stored.status, headers=headers)
    body = stream_from_plain(path, stored.body) if stream else plain_from_stream(path, stored.body)
    if body is None:
        message = "the answer kept under this key cannot be given in the form asked for"
        return _error(502, message, "kept_answer_unconvertible", **{"x-should-retry": "false"})
    kind = "text/event-stream" if stream else "application/json"
    return Response(body, stored.status, headers=headers | {"content-type": kind})


def _response(answer: Stored | Response) -> Response:
    if isinstance(answer, Response):
        return answer
    return Response(answer.body, answer.status, headers=answer.headers)


def _scope(headers: Mapping[str, str]) -> str:
    """Which credentials sent the key; keys of different credentials never meet."""
    who = headers.get("authorization", "") + "\n" + headers.get("x-api-key", "")
    return sha256_hex(who)[:16]


def _fingerprint(path: str, body: bytes) -> str:
    """The request as sent; equal JSON in another key order or spacing is the same request.

    Streamed or not is the same request: the answer is kept once and given in the form
    each request asks for (``_convert``), so a run streamed by one process and resumed
    by one that does not stream pays once.
    """
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return path + "\n" + hashlib.sha256(body).hexdigest()
    if isinstance(request, dict):
        request = {k: v for k, v in request.items() if k not in STREAM_OPTIONS}
    return sha256_hex(path + "\n" + canonical_json(request))


def _error(status: int, message: str, code: str, **headers: str) -> JSONResponse:
    kind = "idempotency_error" if status in (409, 422) else "proxy_error"
    body = {"error": {"message": message, "type": kind, "code": code}}
    return JSONResponse(body, status, headers=headers)


def _reused(key: str) -> JSONResponse:
    message = (
        f"Idempotency-Key {key!r} was already used with a different request body; "
        "a key names one request. Send the original body, or use a new key"
    )
    return _error(422, message, "idempotency_key_reused", **{"x-should-retry": "false"})


def _too_slow(url: str, seconds: float) -> JSONResponse:
    message = (
        f"upstream {url} did not finish its answer within {seconds:g} s (the proxy's "
        "upstream timeout); the key is released, and a retry asks upstream again"
    )
    return _error(504, message, "upstream_timeout", **{"x-should-retry": "false"})


def _still_in_flight(key: str) -> JSONResponse:
    message = f"the request with Idempotency-Key {key!r} is still in flight; retry shortly"
    return _error(409, message, "request_in_flight", **{"retry-after": "1"})
