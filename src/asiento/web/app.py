"""The web page: runs, a run's timeline, and what waits for a person, with buttons.

``create_app(store_url, token=...)`` is a Starlette app; ``serve(...)`` runs it
with uvicorn on 127.0.0.1. Pages are rendered on the server (Jinja2, no
JavaScript, no build step); ``/api/runs`` and ``/api/runs/ID`` answer the same
JSON as ``asiento runs --json`` and ``asiento show --json``. Every one of them
needs the token (``security``): without it a page answers 401 with the login
form, and the JSON 401 with ``{"error": ...}``. The buttons post forms that call
the same ``approve`` / ``deny`` / ``resolve`` as the ``asiento`` command, after
the same checks, so they write the same journal records. When two people decide
the same step at once, the journal's primary key keeps the first decision and the
second person is told who decided first.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import shlex
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl, quote

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from .. import step_ids
from .. import views as fmt
from .._listen import listening_socket
from ..budget import Budget
from ..decisions import approve, deny, raise_budget, resolve
from ..effects.records import effect_records_of
from ..errors import ApprovalError, AsientoError, UsageError
from ..events import Phase, RunInfo, RunStatus
from ..journal.base import Checkpointer
from ..journal.url import open_existing, shown
from .security import (
    LOOPBACK,
    SESSION_COOKIE,
    SESSION_TTL,
    AllowedHosts,
    Guard,
    check_open_reading,
)
from .security import same_origin as _same_origin
from .templates import STYLE, environment

DEFAULT_PORT = 8765
TOKEN_MODE = "every page and /api/ answer needs the token"
OPEN_MODE = (
    "--open-reading: anyone on this machine reads the runs without the token; writing needs it"
)
MAX_FORM = 64 * 1024
_STYLE_HASH = base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()
HEADERS = {
    "content-security-policy": (
        f"default-src 'none'; style-src 'sha256-{_STYLE_HASH}'; img-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


class _Refused(Exception):
    """A request the page answers with an explanation and an HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


Handler = Callable[[Request], Awaitable[Response]]


def run_url(run_id: str) -> str:
    return "/runs/" + quote(run_id, safe="")


def _pretty(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True)


class Pages:
    """The routes of one app: one journal, one token."""

    def __init__(self, store_url: str, guard: Guard) -> None:
        self.store_url = store_url
        self.guard = guard
        # One journal a lifespan, by its event loop: a server has one, but two test
        # clients of one app each run their own, and neither may close the other's.
        self._stores: dict[asyncio.AbstractEventLoop, Checkpointer] = {}
        self.env = environment(
            {
                "when": fmt.when,
                "lease": fmt.lease_text,
                "summary": lambda event: fmt.clip(fmt.summary(event), 240),
                "pretty": _pretty,
                "runurl": run_url,
                "money": fmt.money,
                "budget": fmt.budget_text,
                "state": self.state,
            }
        )

    def state(self, info: RunInfo) -> fmt.RunState:
        """What the run's status means now; its commands name this page's journal."""
        return fmt.run_state(info, store_hint=f" --store {shlex.quote(shown(self.store_url))}")

    @property
    def store(self) -> Checkpointer:
        store = self._stores.get(asyncio.get_running_loop())
        assert store is not None, "the app's lifespan opens the journal"
        return store

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        self._stores[loop] = store = await open_existing(self.store_url)
        try:
            yield
        finally:
            del self._stores[loop]
            await store.close()

    # -- rendering ---------------------------------------------------------------------

    def render(self, request: Request, name: str, code: int = 200, **context: Any) -> Response:
        access = self.guard.access(request)
        readable = self.guard.may_read(request, access)
        page = self.env.get_template(name).render(
            store=shown(self.store_url) if readable else "",
            operator=access.operator,
            csrf=self.guard.csrf(access.operator),
            open_reading=self.guard.open_reading,
            here=context.pop("here", request.url.path),
            message=context.pop("message", ""),
            message_kind=context.pop("message_kind", "info"),
            **context,
        )
        return HTMLResponse(page, code, headers=HEADERS)

    def problem(self, request: Request, status: int, message: str, back: str = "/") -> Response:
        heading = {404: "Not found", 401: "Log in first"}.get(status, "Refused")
        context = {"heading": heading, "message": message, "message_kind": "error"}
        response = self.render(request, "problem.html", status, here=back, back=back, **context)
        if status == 413:  # the rest of the body is never read: end the connection
            response.headers["connection"] = "close"
        return response

    # -- reading -----------------------------------------------------------------------

    def reading(self, endpoint: Handler) -> Handler:
        """``endpoint``, answered only to a request that may read (``Guard.may_read``)."""

        async def guarded(request: Request) -> Response:
            access = self.guard.access(request)
            if self.guard.may_read(request, access):
                return await endpoint(request)
            why = WRONG_HEADER if access.wrong_header else NEEDS_LOGIN
            if request.url.path.startswith("/api/"):
                return _json({"error": why}, 401, {"www-authenticate": "Bearer"})
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            kind = "error" if access.wrong_header else "info"
            context = {"next": _local(target), "message": why, "message_kind": kind}
            return self.render(request, "login.html", 401, **context)

        return guarded

    async def runs_json(self, request: Request) -> Response:
        """``asiento runs --json``: every run (``?status=`` filters)."""
        status = request.query_params.get("status", "")
        infos = [i for i in await self.store.runs() if not status or i.status.value == status]
        return _json([fmt.run_json(info) for info in infos])

    async def run_json(self, request: Request) -> Response:
        """``asiento show --json``: one run's records, effects and what it awaits."""
        try:
            info = await fmt.find_run(self.store, request.path_params["run_id"])
        except UsageError as exc:
            return _json({"error": str(exc)}, 404)
        return _json(fmt.show_json(info, await self.store.load(info.run_id)))

    async def runs_page(self, request: Request) -> Response:
        status = request.query_params.get("status", "")
        everything = await self.store.runs()
        counts: dict[str, int] = {}
        for info in everything:
            counts[info.status.value] = counts.get(info.status.value, 0) + 1
        shown = [i for i in everything if not status or i.status.value == status]
        return self.render(
            request,
            "runs.html",
            runs=shown,
            status=status,
            statuses=[s.value for s in RunStatus],
            counts=counts,
            waiting=await self._waiting(everything),
        )

    async def _waiting(self, infos: Iterable[RunInfo]) -> list[fmt.Waiting]:
        found = []
        for info in infos:
            if info.status in (RunStatus.SUSPENDED, RunStatus.UNCERTAIN):
                events = await self.store.load(info.run_id)
                found += [w for w in fmt.waiting_of(events, info.status) if w.needs_person]
        return found

    async def run_page(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        try:
            info = await fmt.find_run(self.store, run_id)
        except UsageError as exc:
            return self.problem(request, 404, str(exc))
        done = request.query_params.get("done", "")
        return await self.show_run(request, info, done=await self._done(info, done))

    async def show_run(
        self, request: Request, info: RunInfo, *, status: int = 200, error: str = "", done: str = ""
    ) -> Response:
        """The run's page, with an error (the decision was refused) or what was recorded."""
        events = await self.store.load(info.run_id)
        return self.render(
            request,
            "run.html",
            status,
            run=info,
            timeline=fmt.timeline(events),
            waiting=fmt.waiting_of(events, info.status),
            effects=effect_records_of(events),
            budget_stop=fmt.budget_stop_of(events),
            in_flight=fmt.tool_in_flight(events) if info.reason else None,
            message=error or done,
            message_kind="error" if error else "ok",
        )

    async def _done(self, info: RunInfo, step_id: str) -> str:
        """The banner after a decision, read back from the journal (not from the URL), and
        what to do next, as the ``asiento`` command says it."""
        if not step_id:
            return ""
        for event in reversed(await self.store.load(info.run_id)):
            if step_ids.base(event.step_id) == step_id and event.phase in _PERSON:
                state = self.state(info)
                recorded = f"Recorded: step {step_id} {fmt.summary(event)}."
                return f"{recorded} The run is {state.name}: {state.next}."
        return ""

    # -- logging in --------------------------------------------------------------------

    async def login_page(self, request: Request) -> Response:
        target = _local(request.query_params.get("next", "/"))
        return self.render(request, "login.html", next=target)

    async def login(self, request: Request) -> Response:
        try:
            form = await _form(request)
        except _Refused as exc:
            return self.problem(request, exc.status, str(exc), "/login")
        if not _same_origin(request):
            return self.problem(request, 403, CROSS_SITE)
        by, target = form.get("by", "").strip(), _local(form.get("next", "/"))
        if not by or len(by) > 100 or not self.guard.token_ok(form.get("token", "")):
            message = "Wrong token, or no name: both are needed."
            return self.render(
                request, "login.html", 401, next=target, message=message, message_kind="error"
            )
        response = RedirectResponse(target, 303, headers=HEADERS)
        response.set_cookie(
            SESSION_COOKIE,
            self.guard.cookie_for(by),
            max_age=SESSION_TTL,
            httponly=True,
            samesite="strict",
        )
        return response

    async def logout(self, request: Request) -> Response:
        try:
            form = await _form(request)
        except _Refused as exc:
            return self.problem(request, exc.status, str(exc))
        operator = self.guard.access(request).operator
        if not _same_origin(request) or (
            operator is not None and not self.guard.csrf_ok(operator, form.get("csrf", ""))
        ):
            return self.problem(request, 403, CROSS_SITE)
        response = RedirectResponse("/", 303, headers=HEADERS)
        response.delete_cookie(SESSION_COOKIE, httponly=True, samesite="strict")
        return response

    # -- deciding ----------------------------------------------------------------------

    def action(self, decide: Callable[[Mapping[str, str], str], Awaitable[str]]) -> Handler:
        """A POST that writes: checked for origin, token and CSRF, then ``decide(form, by)``."""

        async def endpoint(request: Request) -> Response:
            back = "/"
            try:
                form = await _form(request)
                back = run_url(form["run_id"]) if form.get("run_id") else "/"
                by = self.authorize(request, form)
                run_id = form.get("run_id", "")
                info = await fmt.find_run(self.store, run_id)
            except _Refused as exc:
                return self.problem(request, exc.status, str(exc), back)
            except UsageError as exc:
                return self.problem(request, 404, str(exc))
            try:
                step_id = await decide(form, by)
            except _Refused as exc:
                return await self.refused(request, info, exc.status, str(exc))
            except AsientoError as exc:
                return await self.refused(request, info, 409, await self._conflict(form, exc))
            target = f"{run_url(run_id)}?done={quote(step_id, safe='')}"
            return RedirectResponse(target, 303, headers=HEADERS)

        return endpoint

    async def refused(self, request: Request, info: RunInfo, status: int, msg: str) -> Response:
        fresh = await fmt.find_run(self.store, info.run_id)
        return await self.show_run(request, fresh, status=status, error=msg)

    def authorize(self, request: Request, form: Mapping[str, str]) -> str:
        """Who writes: the session's person (with a valid CSRF field), or a Bearer's ``by``."""
        if not _same_origin(request):
            raise _Refused(403, CROSS_SITE)
        access = self.guard.access(request)
        if access.wrong_header:
            raise _Refused(401, f"{WRONG_HEADER} Nothing recorded.")
        if access.bearer:
            return _required(form, "by", "say who decides: a 'by' field")
        operator = access.operator
        if operator is None:
            raise _Refused(401, NEEDS_TOKEN)
        if not self.guard.csrf_ok(operator, form.get("csrf", "")):
            raise _Refused(403, STALE_FORM)
        return operator.by

    async def approve(self, form: Mapping[str, str], by: str) -> str:
        return await self._decide(form, by, approved=True)

    async def deny(self, form: Mapping[str, str], by: str) -> str:
        return await self._decide(form, by, approved=False)

    async def _decide(self, form: Mapping[str, str], by: str, *, approved: bool) -> str:
        run_id, step_id = form.get("run_id", ""), form.get("step_id", "")
        fp = _required(form, "fp", "the form lacks the fingerprint of the arguments shown")
        reason = form.get("reason", "").strip()
        if not approved and not reason:
            raise _Refused(400, "A denial needs a reason: the model is told why. Nothing recorded.")
        write = approve if approved else deny
        await write(self.store, run_id, step_id, by=by, reason=reason, fingerprint=fp)
        return step_id

    async def resolve(self, form: Mapping[str, str], by: str) -> str:
        run_id, step_id = form.get("run_id", ""), form.get("step_id", "")
        happened = {"yes": True, "no": False}.get(form.get("happened", ""))
        if happened is None:
            raise _Refused(400, "Say what you found: it happened, or it did not.")
        remote_id = form.get("remote_id", "").strip() or None
        if remote_id is not None and not happened:
            raise _Refused(400, "A remote id names an effect that happened; nothing recorded.")
        reason = form.get("reason", "").strip()
        await resolve(
            self.store,
            run_id,
            step_id,
            happened=happened,
            by=by,
            remote_id=remote_id,
            reason=reason,
        )
        return step_id

    async def budget(self, form: Mapping[str, str], by: str) -> str:
        """Raise the budget of a run stopped on it (the limits the form fills in)."""
        limits: dict[str, Any] = {}
        for name, kind in (("max_cost", float), ("max_tokens", int), ("max_model_calls", int)):
            text = form.get(name, "").strip()
            if not text:
                continue
            try:
                limits[name] = kind(text)
            except ValueError:
                msg = f"{name} must be a number, got {text[:40]!r}. Nothing recorded."
                raise _Refused(400, msg) from None
        try:
            Budget(**limits)
        except UsageError as exc:  # the person's input, refused before anything is read
            raise _Refused(400, f"{exc}.") from None
        reason = form.get("reason", "").strip()
        event = await raise_budget(
            self.store, form.get("run_id", ""), by=by, reason=reason, **limits
        )
        return event.step_id

    async def _conflict(self, form: Mapping[str, str], exc: AsientoError) -> str:
        """Why a decision was not recorded; if someone decided first, who and what."""
        run_id, step_id = form.get("run_id", ""), form.get("step_id", "")
        first = [
            e for e in await self.store.load(run_id) if e.step_id == step_id and e.phase in _PERSON
        ]
        if isinstance(exc, ApprovalError | UsageError) and first:
            return (
                f"Step {step_id} was already decided: {fmt.summary(first[0])}. "
                "This decision was not recorded: the first decision wins."
            )
        return str(exc)


_PERSON = (Phase.APPROVAL, Phase.RESOLUTION)
CROSS_SITE = "Cross-site request refused: this form was not sent by this page. Nothing recorded."
NEEDS_TOKEN = "This action needs the operator token: log in first. Nothing was recorded."
NEEDS_LOGIN = (
    "The runs are shown only with the operator token: log in, or send Authorization: Bearer TOKEN."
)
WRONG_HEADER = "Wrong token in the Authorization header."
STALE_FORM = (
    "This form's CSRF field is missing or belongs to another session: reload the page and "
    "try again. Nothing was recorded."
)


def _required(form: Mapping[str, str], name: str, why: str) -> str:
    value = form.get(name, "").strip()
    if not value:
        raise _Refused(400, why[0].upper() + why[1:] + ". Nothing was recorded.")
    return value


def _local(target: str) -> str:
    """Only a path on this server: never an open redirect to another site."""
    ok = target.startswith("/") and not target.startswith("//") and "\\" not in target
    return target if ok else "/"


def _json(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return JSONResponse(data, status, headers={**HEADERS, **(headers or {})})


async def _form(request: Request) -> dict[str, str]:
    """An urlencoded form body (the only kind the pages send); the last value of each field."""
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    if kind != "application/x-www-form-urlencoded":
        raise _Refused(415, "Send an application/x-www-form-urlencoded form.")
    too_large = _Refused(413, f"The form is too large (at most {MAX_FORM // 1024} KiB).")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_FORM:
        raise too_large  # refused before a byte of it is read
    body = bytearray()
    async for chunk in request.stream():  # read no more than MAX_FORM, whatever it claims
        body += chunk
        if len(body) > MAX_FORM:
            raise too_large
    return dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))


def create_app(
    store_url: str,
    *,
    token: str,
    allowed_hosts: Iterable[str] = LOOPBACK,
    open_reading: bool = False,
) -> Starlette:
    """The page for the journal at ``store_url`` (it must exist); reading and writing need
    ``token``.

    ``allowed_hosts``: the names the page answers to (``Host`` header); the
    loopback names by default, ``"*"`` for any. ``open_reading``: a request that
    reaches the server on a loopback address (from a loopback address) reads without
    the token; writes still need it. Serve such an app on 127.0.0.1 only.
    """
    if not token:
        raise UsageError("create_app(token=...) needs a non-empty token")
    pages = Pages(store_url, Guard(token, open_reading=open_reading))
    reading = {
        "/": pages.runs_page,
        "/runs/{run_id:path}": pages.run_page,
        "/api/runs": pages.runs_json,
        "/api/runs/{run_id:path}": pages.run_json,
    }
    routes = [Route(path, pages.reading(endpoint)) for path, endpoint in reading.items()]
    routes += [
        Route("/login", pages.login_page),
        Route("/login", pages.login, methods=["POST"]),
        Route("/logout", pages.logout, methods=["POST"]),
        Route("/approve", pages.action(pages.approve), methods=["POST"]),
        Route("/deny", pages.action(pages.deny), methods=["POST"]),
        Route("/resolve", pages.action(pages.resolve), methods=["POST"]),
        Route("/budget", pages.action(pages.budget), methods=["POST"]),
    ]
    middleware = [Middleware(AllowedHosts, hosts=list(allowed_hosts))]
    return Starlette(routes=routes, middleware=middleware, lifespan=pages.lifespan)


def serve(
    store_url: str,
    *,
    token: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    allowed_hosts: Iterable[str] = (),
    token_shown: str | None = None,
    log_level: str = "warning",
    open_reading: bool = False,
) -> None:
    """Run the page until interrupted; print its URL, the token and who may read
    (``port=0``: a free port). ``open_reading`` only on a loopback ``host``."""
    import uvicorn

    allowed_hosts = list(allowed_hosts)
    if open_reading:
        check_open_reading(host, allowed_hosts)
    names = [*LOOPBACK, *allowed_hosts]
    if host not in ("0.0.0.0", "::", ""):
        names.append(host)
    app = create_app(store_url, token=token, allowed_hosts=names, open_reading=open_reading)
    sock = listening_socket(host, port, backlog=128)  # connectable once the URL is printed
    bound = f"[{host}]" if ":" in host else host
    url = f"http://{bound}:{sock.getsockname()[1]}/"
    print(f"asiento serve: {url} (journal {shown(store_url)})", file=sys.stderr, flush=True)
    does = "to decide" if open_reading else "to read and decide"
    print(f"token: {token_shown or token} (log in at {url}login {does})", file=sys.stderr)
    print(f"mode: {OPEN_MODE if open_reading else TOKEN_MODE}", file=sys.stderr, flush=True)
    # Named, not "auto": the gateway extra's httptools and uvloop are the proxy's choice.
    config = uvicorn.Config(app, log_level=log_level, http="h11", loop="asyncio")
    uvicorn.Server(config).run(sockets=[sock])
