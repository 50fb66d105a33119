"""The web page's routes, through Starlette's TestClient, on real SQLite journals.

Reading needs the token (``READ``, the Bearer header) as writing does; who may read
without it is tested on a real server in ``test_access``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from asiento import ApprovalStep, SqliteCheckpointer, StepEvent, ToolStep, UsageError
from asiento.web import SESSION_COOKIE, create_app

from .runs import PAYMENT, book, closed_with_effect, drive, suspended, uncertain

TOKEN = "test-token-0123456789abcdef"
BASE = "http://127.0.0.1"
READ = {"authorization": f"Bearer {TOKEN}"}  # reads as a script would; writes need more


@contextmanager
def page(db: Path, base_url: str = BASE) -> Iterator[TestClient]:
    """The app on ``db``, started (lifespan) and stopped around the block."""
    with TestClient(create_app(str(db), token=TOKEN), base_url=base_url) as client:
        yield client


def login(client: TestClient, by: str = "ana") -> None:
    """Log in through the form; the client keeps the session cookie."""
    answer = client.post("/login", data={"by": by, "token": TOKEN}, follow_redirects=False)
    assert answer.status_code == 303, answer.text
    assert SESSION_COOKIE in client.cookies


def hidden(html: str, name: str) -> str:
    """The value of the first hidden field ``name`` on a page."""
    found = re.search(rf'name="{name}" value="([^"]*)"', html)
    assert found is not None, f"no hidden field {name!r}"
    return found.group(1)


def decision(client: TestClient, run_id: str, **fields: str) -> dict[str, str]:
    """The fields the run page's form would post, plus ``fields``.

    The fingerprint is the awaited step's (``/api/runs/ID``, read with the token in a
    header); the CSRF field is the client's session's, empty without one (the page then
    offers no form).
    """
    [waiting] = client.get(f"/api/runs/{run_id}", headers=READ).json()["awaiting"]
    html = client.get(f"/runs/{run_id}", headers=READ).text
    csrf = re.search(r'name="csrf" value="([^"]*)"', html)
    form = {"run_id": run_id, "step_id": "m1.t1", "fp": waiting["fingerprint"]}
    return {**form, "csrf": "" if csrf is None else csrf.group(1), **fields}


def banner(html: str) -> str:
    """The page's message, if it has one."""
    found = re.search(r'role="status">([^<]*)<', html)
    return "" if found is None else " ".join(found.group(1).split())


async def people(db: Path, run_id: str) -> list[StepEvent]:
    """The records a person wrote in the run (approvals and resolutions)."""
    store = SqliteCheckpointer(db)
    try:
        events = await store.load(run_id)
    finally:
        await store.close()
    return [e for e in events if e.phase in ("approval", "resolution")]


async def test_the_runs_page_lists_runs_and_what_waits_for_a_person(tmp_path: Path) -> None:
    """`/` lists every run with its status and ledger, and a card per step waiting for a person."""
    db = tmp_path / "runs.db"
    fp = await suspended(db, "invoice-42")
    await uncertain(db, "refund-17")
    await closed_with_effect(db, "fee-3")
    with page(db) as client:
        html = client.get("/", headers=READ).text
        only = client.get("/?status=uncertain", headers=READ).text
    rows = re.findall(r'<td><a href="/runs/([^"]+)">.*?badge (\w+)', html, re.S)
    assert rows == [("invoice-42", "suspended"), ("refund-17", "uncertain"), ("fee-3", "closed")]
    assert "Waiting for a person (2)" in html
    assert fp in html
    assert "&#34;to&#34;: &#34;ACME Ltd&#34;" in html
    assert '<td class="num">412/38</td>' in html  # tokens paid by the run's one model call
    assert re.findall(r'<td><a href="/runs/([^"]+)">', only) == ["refund-17"]


async def test_the_pages_count_steps_not_records(tmp_path: Path) -> None:
    """`/` lists each run's steps (model steps and tool calls), not its records; `/runs/ID`
    shows both."""
    db = tmp_path / "runs.db"
    await uncertain(db, "refund-17")
    await closed_with_effect(db, "fee-3")
    with page(db) as client:
        html = client.get("/", headers=READ).text
        run = client.get("/runs/fee-3", headers=READ).text
    assert "<th>steps</th>" in html
    assert "<th>records</th>" not in html
    cells = re.findall(
        r'<a href="/runs/([^"]+)">.*?badge \w+.*?<td class="num">(\d+)</td>', html, re.S
    )
    assert cells == [("refund-17", "2"), ("fee-3", "3")]
    assert "<dt>steps</dt><dd>3 (2 model, 1 tool)</dd>" in run
    assert "<dt>records</dt><dd>6</dd>" in run


async def test_the_run_page_shows_timeline_effects_and_what_is_awaited(tmp_path: Path) -> None:
    """`/runs/ID` shows each record step by step, the effect records and the awaited step."""
    db = tmp_path / "runs.db"
    fp = await suspended(db, "invoice-42")
    await closed_with_effect(db, "fee-3")
    with page(db) as client:
        login(client)
        waiting = client.get("/runs/invoice-42").text
        closed = client.get("/runs/fee-3").text
    steps = re.findall(r'data-step="([^"]+)" data-phase="([^"]+)"', waiting)
    assert steps == [("m1", "result"), ("m1.t1", "intent")]
    assert "Approve or deny" in waiting
    assert f'name="fp" value="{fp}"' in waiting
    assert 'class="effects"' not in waiting
    effects = re.search(r'<table class="effects">(.*?)</table>', closed, re.S)
    assert effects is not None
    assert re.search(r"fee-3:m1\.t1:[0-9a-f]{6}</td>\s*<td>confirmed</td>", effects.group(1))
    assert ">entry-0001</td>" in effects.group(1)
    assert "Waiting for a person" not in closed


async def test_an_effect_awaiting_approval_shows_its_prepared_payload(tmp_path: Path) -> None:
    """For an effect, the card shows the frozen payload it would publish and its idem_key."""
    db = tmp_path / "runs.db"
    steps = await book(db, "fee-3", approval=True)
    approval = steps[-1]
    assert isinstance(approval, ApprovalStep)
    with page(db) as client:
        login(client)
        html = client.get("/runs/fee-3").text
    card = re.search(r'<div class="card approval".*?</form>', html, re.S)
    assert card is not None
    assert "<dt>prepared</dt>" in card.group(0)
    assert "&#34;account&#34;: &#34;4300&#34;" in card.group(0)
    assert re.search(r"fee-3:m1\.t1:[0-9a-f]{6}", card.group(0))
    assert f'name="fp" value="{approval.fingerprint}"' in card.group(0)


async def test_a_reader_not_logged_in_is_offered_no_decision(tmp_path: Path) -> None:
    """Read without a session (the token in a header), a card shows the frozen arguments
    and the fingerprint but no Approve / Deny / Resolve form: a line says to log in to
    decide, and leads back to the run; logged in, the same card has its buttons."""
    db = tmp_path / "runs.db"
    fp = await suspended(db, "invoice-42")
    await uncertain(db, "refund-17")
    with page(db) as client:
        listing = client.get("/", headers=READ).text
        run = client.get("/runs/invoice-42", headers=READ).text
        login(client)
        signed = client.get("/runs/invoice-42").text
    for html in (listing, run):
        assert fp in html
        assert '<form method="post">' not in html
        for action in ("/approve", "/deny", "/resolve"):
            assert f'formaction="{action}"' not in html
    said = " ".join(run.split())
    assert '<a href="/login?next=/runs/invoice-42">Log in</a> with the operator token to ' in said
    assert "with the operator token to approve or deny." in said
    assert "with the operator token to say whether it happened." in " ".join(listing.split())
    assert 'formaction="/approve"' in signed
    assert "login-to-decide" not in signed


async def test_the_state_says_whether_a_process_drives_the_run(tmp_path: Path) -> None:
    """A run stored as running that no process drives is shown `ready to resume` in the list,
    on its page (with what to do next) and in /api/runs (`state`; `status` unchanged)."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as client:
        login(client, "ana")
        client.post("/approve", data=decision(client, "invoice-42", reason="checked"))
        listing = client.get("/").text
        run = client.get("/runs/invoice-42").text
        api = client.get("/api/runs").json()
        one = client.get("/api/runs/invoice-42").json()
    assert re.findall(r'<a href="/runs/([^"]+)">.*?badge ([\w-]+)">([^<]+)<', listing, re.S) == [
        ("invoice-42", "ready-to-resume", "ready to resume")
    ]
    assert "<th>state</th>" in listing
    facts = re.search(r'<dd class="state">(.*?)</dd>', run, re.S)
    assert facts is not None
    assert " ".join(facts.group(1).split()) == (
        "ready to resume (status running): no process drives it now (it was decided, stopped "
        "or killed since its last pass). Next: run its agent again with the same run_id, "
        "Session(&#39;invoice-42&#39;, gateway, store), to go on."
    )
    assert [(r["status"], r["state"]) for r in api] == [("running", "ready to resume")]
    assert (one["status"], one["state"]) == ("running", "ready to resume")


async def test_an_unknown_run_is_404(tmp_path: Path) -> None:
    """A run the journal does not hold is a 404 page naming it."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as client:
        answer = client.get("/runs/ghost", headers=READ)
    assert answer.status_code == 404
    assert "unknown run &#39;ghost&#39;" in answer.text


async def test_approving_records_the_approval_and_the_run_pays_once(tmp_path: Path) -> None:
    """Approve (logged in) records who approved which arguments; the resumed run pays once."""
    db = tmp_path / "runs.db"
    fp = await suspended(db, "invoice-42")
    with page(db) as client:
        login(client, "ana")
        answer = client.post("/approve", data=decision(client, "invoice-42", reason="checked"))
        assert answer.status_code == 200
        assert answer.url.path == "/runs/invoice-42"
        assert banner(answer.text).startswith("Recorded: step m1.t1 approved by ana")
        assert banner(answer.text).endswith(
            "The run is ready to resume: run its agent again with the same run_id, "
            "Session(&#39;invoice-42&#39;, gateway, store), to go on."
        )
    [approval] = await people(db, "invoice-42")
    assert approval.decision == "approved"
    assert {k: approval.payload[k] for k in ("by", "reason", "fp")} == {
        "by": "ana",
        "reason": "checked",
        "fp": fp,
    }
    resumed = await drive(db, "invoice-42")
    assert resumed.payments == [PAYMENT]
    assert (await drive(db, "invoice-42")).payments == []


async def test_denying_needs_a_reason_and_tells_the_model(tmp_path: Path) -> None:
    """Deny without a reason is refused; with one it is recorded and fed to the model."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as client:
        login(client, "bob")
        bare = client.post("/deny", data=decision(client, "invoice-42"))
        assert bare.status_code == 400
        assert "needs a reason" in banner(bare.text)
        assert await people(db, "invoice-42") == []
        client.post("/deny", data=decision(client, "invoice-42", reason="wrong supplier"))
    resumed = await drive(db, "invoice-42")
    assert resumed.payments == []
    denied = [s for s in resumed.steps if isinstance(s, ToolStep)]
    assert [(s.status, s.result) for s in denied] == [("denied", "wrong supplier")]


async def test_a_write_without_the_token_is_refused(tmp_path: Path) -> None:
    """No session, a wrong Bearer token, or a wrong login token: 401 and nothing recorded."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as client:
        form = decision(client, "invoice-42")
        anonymous = client.post("/approve", data=form)
        wrong = client.post("/approve", data=form, headers={"authorization": "Bearer nope"})
        bad_login = client.post("/login", data={"by": "eve", "token": "guess"})
    assert (anonymous.status_code, wrong.status_code, bad_login.status_code) == (401, 401, 401)
    assert "needs the operator token" in banner(anonymous.text)
    assert SESSION_COOKIE not in bad_login.headers.get("set-cookie", "")
    assert await people(db, "invoice-42") == []


async def test_a_script_decides_with_the_bearer_token(tmp_path: Path) -> None:
    """`Authorization: Bearer TOKEN` and a `by` field write without a session or CSRF field."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as client:
        form = {k: v for k, v in decision(client, "invoice-42").items() if k != "csrf"}
        headers = {"authorization": f"Bearer {TOKEN}"}
        nameless = client.post("/approve", data=form, headers=headers)
        signed = client.post("/approve", data={**form, "by": "ci-bot"}, headers=headers)
    assert nameless.status_code == 400
    assert signed.status_code == 200
    [approval] = await people(db, "invoice-42")
    assert approval.payload["by"] == "ci-bot"


async def test_forms_are_protected_against_cross_site_requests(tmp_path: Path) -> None:
    """A session without the form's CSRF field, or a post from another origin, writes nothing."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as client:
        login(client)
        form = decision(client, "invoice-42")
        forged = client.post("/approve", data={**form, "csrf": "0" * 64})
        missing = client.post("/approve", data={k: v for k, v in form.items() if k != "csrf"})
        elsewhere = client.post("/approve", data=form, headers={"origin": "http://evil.example"})
        referred = client.post("/approve", data=form, headers={"referer": "http://evil.example/x"})
    codes = [r.status_code for r in (forged, missing, elsewhere, referred)]
    assert codes == [403, 403, 403, 403]
    assert "CSRF" in banner(forged.text)
    assert "Cross-site" in banner(elsewhere.text)
    assert await people(db, "invoice-42") == []


async def test_another_sessions_csrf_field_does_not_work(tmp_path: Path) -> None:
    """The CSRF field is bound to one session: a field from ana's page fails in bob's session."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    app = create_app(str(db), token=TOKEN)
    with TestClient(app, base_url=BASE) as ana, TestClient(app, base_url=BASE) as bob:
        login(ana, "ana")
        login(bob, "bob")
        stolen = decision(ana, "invoice-42")
        answer = bob.post("/approve", data=stolen)
    assert answer.status_code == 403
    assert await people(db, "invoice-42") == []


async def test_two_clients_of_one_app_each_keep_their_journal(tmp_path: Path) -> None:
    """Each lifespan of the app (a test client each) opens and closes its own journal:
    the one that stops first does not close the other's, which still reads the runs."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    app = create_app(str(db), token=TOKEN)
    with TestClient(app, base_url=BASE) as ana:
        with TestClient(app, base_url=BASE) as bob:
            assert bob.get("/api/runs", headers=READ).status_code == 200
        listed = ana.get("/api/runs", headers=READ)
    assert listed.status_code == 200, listed.text
    assert "invoice-42" in listed.text


async def test_the_session_cookie_is_signed_strict_and_http_only(tmp_path: Path) -> None:
    """The cookie is HttpOnly and SameSite=Strict; a tampered one is not a session."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as client:
        answer = client.post("/login", data={"by": "ana", "token": TOKEN}, follow_redirects=False)
        cookie = answer.headers["set-cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=strict" in cookie
        value = client.cookies[SESSION_COOKIE]
        flipped = value[:-1] + ("0" if value[-1] != "0" else "1")
        client.cookies.clear()
        client.cookies.set(SESSION_COOKIE, flipped)
        tampered = client.post("/approve", data=decision(client, "invoice-42"))
    assert tampered.status_code == 401
    assert await people(db, "invoice-42") == []


async def test_two_people_deciding_the_same_step_the_first_wins(tmp_path: Path) -> None:
    """The second decision on a step is refused with a 409 naming who decided first."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as ana, page(db) as bob:
        login(ana, "ana")
        login(bob, "bob")
        ana_form = decision(ana, "invoice-42")
        bob_form = decision(bob, "invoice-42", reason="too much")
        first = ana.post("/approve", data=ana_form)
        second = bob.post("/deny", data=bob_form)
    assert first.status_code == 200
    assert second.status_code == 409
    assert "was already decided: approved by ana" in banner(second.text)
    assert "the first decision wins" in banner(second.text)
    assert [(e.decision, e.payload["by"]) for e in await people(db, "invoice-42")] == [
        ("approved", "ana")
    ]


async def test_racing_deciders_are_separated_by_the_primary_key(tmp_path: Path) -> None:
    """Eight people in eight threads, each with its own connection: one decision is recorded."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    codes: list[int] = []
    gate = threading.Barrier(8, timeout=30)

    def decide(client: TestClient, form: dict[str, str], action: str) -> None:
        gate.wait()
        codes.append(client.post(action, data={**form, "reason": "race"}).status_code)

    with ExitStack() as stack:
        clients = [stack.enter_context(page(db)) for _ in range(8)]
        for n, client in enumerate(clients):
            login(client, f"person-{n}")
        forms = [decision(client, "invoice-42") for client in clients]
        threads = [
            threading.Thread(target=decide, args=(c, f, "/approve" if n % 2 else "/deny"))
            for n, (c, f) in enumerate(zip(clients, forms, strict=True))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    assert sorted(codes) == [200] + [409] * 7
    assert len(await people(db, "invoice-42")) == 1


async def test_an_approval_binds_the_arguments_the_page_showed(tmp_path: Path) -> None:
    """A form whose fingerprint is not the step's frozen arguments approves nothing."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as client:
        login(client)
        answer = client.post("/approve", data=decision(client, "invoice-42", fp="f" * 32))
    assert answer.status_code == 409
    assert "nothing was recorded" in banner(answer.text)
    assert await people(db, "invoice-42") == []


async def test_resolving_an_uncertain_effect(tmp_path: Path) -> None:
    """`It happened` records the remote id and the resumed run does not pay again."""
    db = tmp_path / "runs.db"
    await uncertain(db, "refund-17")
    with page(db) as client:
        login(client, "ana")
        form = decision(client, "refund-17", happened="yes", remote_id="tx-9", reason="in bank")
        answer = client.post("/resolve", data=form)
        again = client.post("/resolve", data={**form, "happened": "no", "remote_id": ""})
    assert answer.status_code == 200
    assert "a person found it happened, remote_id=tx-9" in banner(answer.text)
    assert again.status_code == 409
    assert "already decided" in banner(again.text)
    [resolution] = await people(db, "refund-17")
    assert (resolution.payload["happened"], resolution.payload["by"]) == (True, "ana")
    resumed = await drive(db, "refund-17", approval=False)
    assert resumed.payments == []


async def test_resolving_did_not_happen_runs_the_effect_once_more(tmp_path: Path) -> None:
    """`It did not happen` lets the resumed run pay exactly once more."""
    db = tmp_path / "runs.db"
    await uncertain(db, "refund-17")
    with page(db) as client:
        login(client)
        with_id = decision(client, "refund-17", happened="no", remote_id="tx-9")
        refused = client.post("/resolve", data=with_id)
        answer = client.post("/resolve", data={**with_id, "remote_id": ""})
    assert refused.status_code == 400
    assert answer.status_code == 200
    resumed = await drive(db, "refund-17", approval=False)
    assert resumed.payments == [PAYMENT]


async def test_resolving_a_step_that_is_not_uncertain_is_refused(tmp_path: Path) -> None:
    """Resolve on a step awaiting approval (not submitted) is a 409, nothing recorded."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as client:
        login(client)
        answer = client.post("/resolve", data=decision(client, "invoice-42", happened="yes"))
    assert answer.status_code == 409
    assert "is not uncertain" in banner(answer.text)
    assert await people(db, "invoice-42") == []


async def test_a_foreign_host_header_is_refused(tmp_path: Path) -> None:
    """A Host that is not the server's (DNS rebinding) gets 421 and no page."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db, base_url="http://attacker.example") as client:
        answer = client.get("/", headers=READ)
    assert answer.status_code == 421
    assert "invoice-42" not in answer.text


async def test_pages_forbid_framing_and_scripts(tmp_path: Path) -> None:
    """Every page says: no framing, no scripts, forms only to this server."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as client:
        answers = [client.get("/runs/invoice-42", headers=READ), client.get("/runs/invoice-42")]
    assert [a.status_code for a in answers] == [200, 401]
    for answer in answers:  # the run's page, and the login form shown without the token
        policy = answer.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy
        assert "form-action 'self'" in policy
        assert "default-src 'none'" in policy
        assert "script" not in policy
        assert answer.headers["x-frame-options"] == "DENY"


async def test_text_from_the_journal_is_escaped(tmp_path: Path) -> None:
    """A run id carrying HTML is shown as text, never as markup."""
    db = tmp_path / "runs.db"
    run_id = "<script>alert(1)</script>"
    await suspended(db, run_id)
    with page(db) as client:
        listing = client.get("/", headers=READ).text
        run = client.get("/runs/%3Cscript%3Ealert(1)%3C%2Fscript%3E", headers=READ)
    assert "<script>" not in listing
    assert "&lt;script&gt;alert(1)" in listing
    assert run.status_code == 200
    assert "<script>" not in run.text


async def test_login_redirects_only_within_the_server(tmp_path: Path) -> None:
    """`next` pointing at another site sends the person to `/` instead."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as client:
        far = {"by": "ana", "token": TOKEN, "next": "//evil.example/x"}
        near = {"by": "ana", "token": TOKEN, "next": "/runs/invoice-42"}
        away = client.post("/login", data=far, follow_redirects=False)
        home = client.post("/login", data=near, follow_redirects=False)
    assert away.headers["location"] == "/"
    assert home.headers["location"] == "/runs/invoice-42"


async def test_logging_out_ends_the_session(tmp_path: Path) -> None:
    """After `log out` the same browser needs the token again to write."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as client:
        login(client)
        form = decision(client, "invoice-42")
        client.post("/logout", data={"csrf": form["csrf"]})
        assert SESSION_COOKIE not in client.cookies
        answer = client.post("/approve", data=form)
    assert answer.status_code == 401


def test_the_app_never_creates_a_journal(tmp_path: Path) -> None:
    """Starting the app on a missing SQLite file fails and leaves no file behind."""
    app = create_app(str(tmp_path / "nope.db"), token=TOKEN)
    with pytest.raises(UsageError, match="no journal at"), TestClient(app, base_url=BASE):
        pass
    assert list(tmp_path.iterdir()) == []


def test_an_empty_token_is_refused() -> None:
    """A server whose writes need no secret is not built."""
    with pytest.raises(UsageError, match="token"):
        create_app("runs.db", token="")


async def test_a_form_that_is_not_urlencoded_is_refused(tmp_path: Path) -> None:
    """Only the pages' own form encoding is accepted (415), so JSON posts write nothing."""
    db = tmp_path / "runs.db"
    await suspended(db, "invoice-42")
    with page(db) as client:
        headers = {"authorization": f"Bearer {TOKEN}"}
        answer = client.post("/approve", json={"run_id": "invoice-42"}, headers=headers)
    assert answer.status_code == 415
    assert await people(db, "invoice-42") == []
