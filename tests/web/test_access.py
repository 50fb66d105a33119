"""Who may read the page: `asiento serve` in its own process, asked over real HTTP.

Run data is personal data (tool arguments hold names and amounts), so every page
and every JSON answer needs the operator token; ``--open-reading`` opens reading
(never writing) on a loopback address only.
"""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from starlette.routing import Route
from starlette.testclient import TestClient

from asiento import SqliteCheckpointer
from asiento.web import SESSION_COOKIE, create_app

from .runs import suspended

TOKEN = "access-token-0123456789abcdef"
BEARER = {"authorization": f"Bearer {TOKEN}"}
SECRET_DATA = ("invoice-42", "ACME Ltd", "amount")  # a run id, a name, an argument


@dataclass
class Server:
    """A running ``asiento serve``: its URL and the lines it printed at start."""

    url: str
    printed: list[str]


@contextmanager
def serving(cwd: Path, *args: str) -> Iterator[Server]:
    """``python -m asiento serve --port 0 ARGS`` on ``cwd/runs.db``, stopped afterwards."""
    env = {**os.environ, "ASIENTO_WEB_TOKEN": TOKEN}
    env.pop("ASIENTO_STORE", None)
    argv = [sys.executable, "-m", "asiento", "serve", "--port", "0", *args]
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        printed = _lines(proc, 3)
        assert printed[0].startswith("asiento serve: http://127.0.0.1:"), printed
        yield Server(url=printed[0].split()[2], printed=printed)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        assert proc.stderr is not None
        proc.stderr.close()


def _lines(proc: subprocess.Popen[str], n: int) -> list[str]:
    """The first ``n`` lines the server prints on stderr (within 30 s each)."""
    assert proc.stderr is not None
    stream, lines = proc.stderr, queue.Queue[str]()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    try:
        return [lines.get(timeout=30).strip() for _ in range(n)]
    except queue.Empty:
        proc.kill()
        raise AssertionError(f"asiento serve printed fewer than {n} lines") from None


async def approvals(db: Path) -> list[str]:
    """Who approved, in the journal of ``invoice-42``."""
    store = SqliteCheckpointer(db)
    try:
        events = await store.load("invoice-42")
    finally:
        await store.close()
    return [str(e.payload["by"]) for e in events if e.phase == "approval"]


def reading_paths() -> list[str]:
    """Every GET route of the app but the login form, with ``invoice-42`` for a run id."""
    app = create_app("runs.db", token=TOKEN)
    paths = []
    for route in app.routes:
        assert isinstance(route, Route)
        if route.methods is not None and "GET" in route.methods and route.path != "/login":
            paths.append(route.path.replace("{run_id:path}", "invoice-42"))
    return paths


def assert_shows_no_run_data(text: str) -> None:
    for secret in SECRET_DATA:
        assert secret not in text, f"{secret!r} shown without the token"


async def test_without_the_token_no_page_and_no_json_shows_run_data(tmp_path: Path) -> None:
    """A visitor without the token gets the login form (401) for a page and a JSON 401 for
    the API, never the runs; the startup message says reading needs the token.

    Before the fix `/` and `/runs/ID` answered 200 with the runs and their arguments.
    """
    await suspended(tmp_path / "runs.db", "invoice-42")
    paths = reading_paths()
    assert {"/", "/runs/invoice-42", "/api/runs", "/api/runs/invoice-42"} <= set(paths)
    with serving(tmp_path) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        answers = {path: client.get(path) for path in paths}
        wrong = client.get("/api/runs", headers={"authorization": "Bearer not-the-token"})
    assert server.printed[2] == "mode: every page and /api/ answer needs the token"
    assert "to read and decide" in server.printed[1]
    for path, answer in answers.items():
        assert answer.status_code == 401, path
        assert_shows_no_run_data(answer.text.replace(path, ""))  # the login form's `next`
        if path.startswith("/api/"):
            assert answer.headers["content-type"] == "application/json"
            assert "operator token" in answer.json()["error"]
            assert answer.headers["www-authenticate"] == "Bearer"
        else:
            assert '<form class="login" method="post" action="/login">' in answer.text
            assert answer.headers["cache-control"] == "no-store"
    assert 'name="next" value="/runs/invoice-42"' in answers["/runs/invoice-42"].text
    assert (wrong.status_code, wrong.json()) == (
        401,
        {"error": "Wrong token in the Authorization header."},
    )


async def test_the_token_in_a_header_reads_pages_and_json(tmp_path: Path) -> None:
    """`Authorization: Bearer TOKEN` reads every page; the JSON is `runs --json` and
    `show --json`, with the fingerprint a script approves."""
    fp = await suspended(tmp_path / "runs.db", "invoice-42")
    with serving(tmp_path) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        listing = client.get("/", headers=BEARER)
        run = client.get("/runs/invoice-42", headers=BEARER)
        runs = client.get("/api/runs", headers=BEARER)
        only = client.get("/api/runs?status=closed", headers=BEARER)
        shown = client.get("/api/runs/invoice-42", headers=BEARER)
        ghost = client.get("/api/runs/ghost", headers=BEARER)
    assert (listing.status_code, run.status_code) == (200, 200)
    assert "invoice-42" in listing.text
    assert "&#34;to&#34;: &#34;ACME Ltd&#34;" in run.text
    assert [(r["run_id"], r["status"]) for r in runs.json()] == [("invoice-42", "suspended")]
    assert only.json() == []
    [awaiting] = shown.json()["awaiting"]
    assert (awaiting["step_id"], awaiting["fingerprint"], awaiting["args"]) == (
        "m1.t1",
        fp,
        {"amount": 120, "to": "ACME Ltd"},
    )
    assert ghost.status_code == 404
    assert "unknown run 'ghost'" in ghost.json()["error"]


async def test_logging_in_with_the_token_opens_the_pages_until_logging_out(
    tmp_path: Path,
) -> None:
    """The login form takes the token (a wrong one sets no cookie); the cookie it sets is
    HttpOnly and SameSite=Strict and opens pages and JSON; logging out closes them."""
    await suspended(tmp_path / "runs.db", "invoice-42")
    with serving(tmp_path) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        wrong = client.post("/login", data={"by": "ana", "token": TOKEN[:-1] + "x"})
        assert (wrong.status_code, SESSION_COOKIE in client.cookies) == (401, False)
        assert_shows_no_run_data(wrong.text)
        login = {"by": "ana", "token": TOKEN, "next": "/runs/invoice-42"}
        right = client.post("/login", data=login, follow_redirects=False)
        assert (right.status_code, right.headers["location"]) == (303, "/runs/invoice-42")
        cookie = right.headers["set-cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=strict" in cookie
        run = client.get("/runs/invoice-42")
        assert run.status_code == 200
        assert "signed in as <b>ana</b>" in run.text
        assert client.get("/api/runs").status_code == 200
        csrf = re.search(r'name="csrf" value="([^"]+)"', run.text)
        assert csrf is not None
        client.post("/logout", data={"csrf": csrf.group(1)})
        after = client.get("/")
    assert after.status_code == 401
    assert_shows_no_run_data(after.text)


async def test_a_wrong_header_is_refused_even_with_a_session(tmp_path: Path) -> None:
    """A request that sends a wrong Bearer token is refused, whatever cookie it also carries."""
    await suspended(tmp_path / "runs.db", "invoice-42")
    with serving(tmp_path) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        client.post("/login", data={"by": "ana", "token": TOKEN})
        assert client.get("/").status_code == 200
        answer = client.get("/", headers={"authorization": "Bearer guess"})
    assert answer.status_code == 401
    assert "Wrong token in the Authorization header" in answer.text
    assert_shows_no_run_data(answer.text)


async def test_open_reading_on_loopback_reads_without_the_token_but_never_writes(
    tmp_path: Path,
) -> None:
    """`serve --open-reading` on 127.0.0.1 says so at start and shows the runs without the
    token; an approval still needs it (401, nothing recorded), and with it is recorded."""
    db = tmp_path / "runs.db"
    fp = await suspended(db, "invoice-42")
    with (
        serving(tmp_path, "--open-reading") as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        listing = client.get("/")
        runs = client.get("/api/runs")
        form = {"run_id": "invoice-42", "step_id": "m1.t1", "fp": fp, "by": "eve"}
        anonymous = client.post("/approve", data=form)
        recorded_before = await approvals(db)
        signed = client.post("/approve", data={**form, "by": "ci-bot"}, headers=BEARER)
    assert server.printed[2].startswith("mode: --open-reading: anyone on this machine reads")
    assert "writing needs it" in server.printed[2]
    assert (listing.status_code, runs.status_code) == (200, 200)
    assert "invoice-42" in listing.text
    assert anonymous.status_code == 401
    assert recorded_before == []
    assert (signed.status_code, signed.headers["location"]) == (303, "/runs/invoice-42?done=m1.t1")
    assert await approvals(db) == ["ci-bot"]


async def test_open_reading_is_refused_off_loopback(tmp_path: Path) -> None:
    """`--open-reading` with a non-loopback --host, or behind --allowed-host, does not start:
    one line saying why, exit 1."""
    await suspended(tmp_path / "runs.db", "invoice-42")
    env = {**os.environ, "ASIENTO_WEB_TOKEN": TOKEN}
    env.pop("ASIENTO_STORE", None)
    cases = {
        ("--host", "0.0.0.0"): "needs a loopback address; '0.0.0.0' is not one",
        ("--host", "::"): "needs a loopback address; '::' is not one",
        ("--allowed-host", "agents.example.com"): "cannot be combined with --allowed-host",
    }
    for args, why in cases.items():
        argv = [sys.executable, "-m", "asiento", "serve", "--open-reading", "--port", "0", *args]
        proc = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert proc.returncode == 1, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert why in proc.stderr
        assert "asiento serve: http" not in proc.stderr


async def test_an_app_with_open_reading_still_needs_the_token_off_loopback(
    tmp_path: Path,
) -> None:
    """`create_app(open_reading=True)` in a server of your own opens reading only to a
    loopback connection: a request from another address (here the test client's) needs the
    token."""
    await suspended(tmp_path / "runs.db", "invoice-42")
    app = create_app(str(tmp_path / "runs.db"), token=TOKEN, open_reading=True)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        remote = client.get("/")
        signed = client.get("/", headers=BEARER)
    assert remote.status_code == 401
    assert_shows_no_run_data(remote.text)
    assert signed.status_code == 200


async def test_a_non_ascii_session_cookie_is_no_session_not_a_500(tmp_path: Path) -> None:
    """A cookie is the client's to write: one that is not ASCII reads as no session."""
    await suspended(tmp_path / "runs.db", "invoice-42")
    cookie = f"{SESSION_COOKIE}=\u00e9t\u00e9.caf\u00e9".encode()
    with serving(tmp_path) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        for path in ("/", "/login", "/runs/invoice-42"):
            answer = client.get(path, headers={"cookie": cookie})
            assert answer.status_code in (200, 401), (path, answer.status_code, answer.text)
        assert_shows_no_run_data(client.get("/", headers={"cookie": cookie}).text)
        with_token = client.get("/", headers={"cookie": cookie, **BEARER})
        assert with_token.status_code == 200


async def test_login_and_logout_refuse_a_bad_body_clearly(tmp_path: Path) -> None:
    """Not a form: 415; a form of 1 MB: 413; never a 500, and no session set."""
    await suspended(tmp_path / "runs.db", "invoice-42")
    with serving(tmp_path) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        for path in ("/login", "/logout"):
            as_json = client.post(path, json={"by": "ana", "token": TOKEN})
            assert as_json.status_code == 415, (path, as_json.text)
            huge = client.post(path, data={"by": "ana", "token": TOKEN, "pad": "x" * (1 << 20)})
            assert huge.status_code == 413, (path, huge.text)
            assert "too large" in huge.text
        assert SESSION_COOKIE not in client.cookies


async def test_a_huge_form_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """150 MB sent to a form without a token: the server stops reading at 64 KiB (chunked,
    so no Content-Length warns it), and refuses a declared 150 MB without reading at all."""
    await suspended(tmp_path / "runs.db", "invoice-42")
    total, sent = 150 << 20, [0]

    def body() -> Iterator[bytes]:
        chunk = b"x" * (1 << 16)
        while sent[0] < total:
            sent[0] += len(chunk)
            yield chunk

    headers = {"content-type": "application/x-www-form-urlencoded"}
    with serving(tmp_path) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        try:
            answer = client.post("/approve", content=body(), headers=headers)
            assert answer.status_code == 413, answer.text
        except httpx.HTTPError:
            pass  # the server closed the connection on the rest of the body
        assert sent[0] < 16 << 20, f"the server read {sent[0] >> 20} MB of a refused form"
    with serving(tmp_path) as server:  # a raw request: it declares 150 MB, sends 6 bytes
        host, port = server.url.removeprefix("http://").rstrip("/").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            head = (
                f"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {total}\r\n"
                "Content-Type: application/x-www-form-urlencoded\r\n\r\nby=ana"
            )
            raw.sendall(head.encode())
            status_line = raw.makefile("rb").readline()
        assert status_line.startswith(b"HTTP/1.1 413"), status_line
