"""The web page in a real browser: headless Chromium driven by Playwright.

The browser is Debian's ``chromium`` package (``apt-get install -y chromium``),
launched with ``executable_path``; nothing is downloaded at run time. A missing
browser or a missing ``playwright`` package fails these tests, saying what to
install: they never skip. ``ASIENTO_CHROMIUM`` points at another binary.

The server is ``python -m asiento serve`` in its own process, on a real SQLite
journal holding a suspended run, an uncertain one and a closed one (the
``open_server`` fixture adds ``--open-reading``). Screenshots
of every page are saved under ``artifacts/screenshots/`` (ignored by git).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from asiento import SqliteCheckpointer

from .runs import PAYMENT, book, closed_with_effect, drive, suspended, uncertain

if TYPE_CHECKING:
    from playwright.async_api import BrowserContext, Page

CHROMIUM = Path(os.environ.get("ASIENTO_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
TOKEN = "browser-token-0123456789abcdef"
TIMEOUT_MS = 15_000


@dataclass
class Server:
    """A running ``asiento serve``: its URL and the journal it serves."""

    url: str
    db: Path


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    """``python -m asiento serve --port 0`` on a journal with three runs, stopped afterwards."""
    async with serving(tmp_path) as running:
        yield running


@pytest.fixture
async def open_server(tmp_path: Path) -> AsyncIterator[Server]:
    """The same with ``--open-reading``: the pages read without the token on 127.0.0.1."""
    async with serving(tmp_path, "--open-reading") as running:
        yield running


async def three_runs(db: Path) -> None:
    """A suspended run, an uncertain one and a closed one with an effect."""
    await suspended(db, "invoice-42")
    await uncertain(db, "refund-17")
    await closed_with_effect(db, "fee-3")


@asynccontextmanager
async def serving(
    tmp_path: Path, *args: str, runs: Callable[[Path], Awaitable[None]] = three_runs
) -> AsyncIterator[Server]:
    db = tmp_path / "runs.db"
    await runs(db)
    env = {**os.environ, "ASIENTO_WEB_TOKEN": TOKEN, "COLUMNS": "200"}
    argv = [sys.executable, "-m", "asiento", "serve", "--store", "runs.db", "--port", "0", *args]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        yield Server(url=_printed_url(proc), db=db)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        assert proc.stderr is not None
        proc.stderr.close()


def _printed_url(proc: subprocess.Popen[str]) -> str:
    """The URL ``asiento serve`` prints on its first line (within 30 s)."""
    assert proc.stderr is not None
    ready, _, _ = select.select([proc.stderr], [], [], 30)
    line = proc.stderr.readline() if ready else ""
    if not line.startswith("asiento serve: http://"):
        proc.kill()
        pytest.fail(f"asiento serve did not start: {line!r}", pytrace=False)
    return line.split()[2]


@asynccontextmanager
async def browser(tmp_path: Path, width: int = 1100) -> AsyncIterator[BrowserContext]:
    """Debian's Chromium, headless, with a new empty profile (a ``width`` pixels wide
    window); fails if it is not installed."""
    try:
        from playwright.async_api import async_playwright
    except ImportError as exc:
        pytest.fail(f"the browser tests need playwright: pip install -e '.[test]' ({exc})")
    if not CHROMIUM.is_file():
        pytest.fail(
            f"no Chromium at {CHROMIUM}: install Debian's package (apt-get install -y chromium) "
            "or point ASIENTO_CHROMIUM at a Chromium binary",
            pytrace=False,
        )
    profile = tmp_path / "profile"
    profile.mkdir()
    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": width, "height": 720},
        )
        context.set_default_timeout(TIMEOUT_MS)
        try:
            yield context
        finally:
            await context.close()


async def shot(page: Page, name: str) -> None:
    """Save the whole page as ``artifacts/screenshots/NAME.png``."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=SHOTS / f"{name}.png", full_page=True)


async def approvals(db: Path, run_id: str) -> list[tuple[str | None, str]]:
    """(decision, by) of every approval record of the run."""
    store = SqliteCheckpointer(db)
    try:
        events = await store.load(run_id)
    finally:
        await store.close()
    return [(e.decision, e.payload["by"]) for e in events if e.phase == "approval"]


async def test_a_person_approves_in_the_browser_and_the_run_pays_once(
    server: Server, tmp_path: Path
) -> None:
    """After logging in with the token the page lists the suspended run; approving records
    it (a late second decision is refused); the resumed run pays once."""
    async with browser(tmp_path) as context:
        page = await context.new_page()
        await page.goto(server.url)
        await page.fill("#by", "ana")
        await page.fill("#token", TOKEN)
        await shot(page, "login")
        await page.click("button:has-text('Log in')")
        rows = page.locator("table.runs tbody tr")
        assert await rows.count() == 3
        suspended_row = rows.filter(has_text="invoice-42")
        assert await suspended_row.locator(".badge").inner_text() == "suspended"
        card = page.locator(".card.approval")
        assert '"amount": 120' in await card.locator("pre.args").inner_text()
        await shot(page, "runs")

        await page.click("a:has-text('invoice-42') >> nth=0")
        assert "/runs/invoice-42" in page.url
        await shot(page, "run-awaiting-approval")

        other_tab = await context.new_page()
        await other_tab.goto(page.url)

        await page.fill(".card.approval input[name=reason]", "invoice checked")
        await page.click(".card.approval button.approve")
        status = page.locator('[role="status"]')
        assert "approved by ana" in await status.inner_text()
        await shot(page, "run-approved")

        await other_tab.fill(".card.approval input[name=reason]", "not this month")
        async with other_tab.expect_navigation() as navigation:
            await other_tab.click(".card.approval button.deny")
        late = await navigation.value
        assert late is not None
        assert late.status == 409
        message = await other_tab.locator('[role="status"]').inner_text()
        assert "already decided: approved by ana" in message
        await shot(other_tab, "run-decided-twice")

    assert await approvals(server.db, "invoice-42") == [("approved", "ana")]
    resumed = await drive(server.db, "invoice-42")
    assert resumed.payments == [PAYMENT]
    assert (await drive(server.db, "invoice-42")).payments == []


async def test_without_the_token_the_browser_sees_only_the_login_form(
    server: Server, tmp_path: Path
) -> None:
    """A visitor without the token who opens a run's page gets the login form (401) and no
    run data; logging in there leads to that run's page."""
    async with browser(tmp_path) as context:
        page = await context.new_page()
        answer = await page.goto(server.url + "runs/invoice-42")
        assert answer is not None
        assert answer.status == 401
        body = await page.locator("main").inner_text()
        assert "Reading the runs and deciding need the operator token" in body
        assert "ACME" not in await page.content()
        assert await page.locator(".card").count() == 0
        await shot(page, "login-required")
        await page.fill("#by", "ana")
        await page.fill("#token", TOKEN)
        await page.click("button:has-text('Log in')")
        assert page.url.endswith("/runs/invoice-42")
        assert "signed in as ana" in await page.locator("header").inner_text()
        assert await page.locator(".card.approval").count() == 1


async def test_a_reader_not_logged_in_is_offered_no_decision_in_the_browser(
    open_server: Server, tmp_path: Path
) -> None:
    """With --open-reading the page shows the run without the token, with no Approve / Deny
    buttons: a line says to log in to decide, and logging in there brings them back."""
    server = open_server
    async with browser(tmp_path) as context:
        page = await context.new_page()
        await page.goto(server.url + "runs/invoice-42")
        card = page.locator(".card.approval")
        assert '"amount": 120' in await card.locator("pre.args").inner_text()
        assert await page.locator("button.approve, button.deny, button.happened").count() == 0
        line = await card.locator(".login-to-decide").inner_text()
        assert " ".join(line.split()) == "Log in with the operator token to approve or deny."
        await shot(page, "reading-without-token")
        await card.locator(".login-to-decide a").click()
        await page.fill("#by", "ana")
        await page.fill("#token", TOKEN)
        await page.click("button:has-text('Log in')")
        assert page.url.endswith("/runs/invoice-42")
        assert await page.locator(".card.approval button.approve").count() == 1
    assert await approvals(server.db, "invoice-42") == []


async def test_a_person_resolves_an_uncertain_effect_in_the_browser(
    server: Server, tmp_path: Path
) -> None:
    """The uncertain run's card records `It happened` with its remote id."""
    async with browser(tmp_path) as context:
        page = await context.new_page()
        await page.goto(server.url + "login")
        await page.fill("#by", "ana")
        await page.fill("#token", TOKEN)
        await page.click("button:has-text('Log in')")
        await page.goto(server.url + "runs/refund-17")
        await shot(page, "run-uncertain")
        await page.fill(".card.resolution input[name=remote_id]", "tx-9")
        await page.click(".card.resolution button.happened")
        assert "remote_id=tx-9" in await page.locator('[role="status"]').inner_text()
        await page.goto(server.url + "runs/fee-3")
        assert await page.locator("table.effects tbody tr").count() == 1
        await shot(page, "run-closed-with-effect")
    resumed = await drive(server.db, "refund-17", approval=False)
    assert resumed.payments == []


LONG_RUN = "invoice_2026_11_ACME_Limited_Liability_Company_consulting_services_rendered_0042"
LONG_EFFECT = "booking_2026_11_ACME_Limited_Liability_Company_consulting_fee_ledger_4300_0042"


async def long_names(db: Path) -> None:
    """Runs whose ids (and so card titles and idem_keys) are longer than a card is wide."""
    await suspended(db, LONG_RUN)
    await book(db, LONG_EFFECT, approval=True)
    await uncertain(db, "refund-17")


async def overflowing(page: Page, selector: str) -> list[str]:
    """The elements under each ``selector`` that reach past its right edge (or scroll)."""
    found: list[str] = await page.evaluate(
        """(selector) => {
            const out = [];
            for (const box of document.querySelectorAll(selector)) {
                const edge = box.getBoundingClientRect().right + 1;
                if (box.scrollWidth > box.clientWidth) out.push(selector + " scrolls");
                for (const el of box.querySelectorAll("*")) {
                    if (el.getBoundingClientRect().right > edge) {
                        out.push(el.tagName + "." + el.className + ": " + el.textContent.trim());
                    }
                }
            }
            return out;
        }""",
        selector,
    )
    return found


async def test_long_titles_and_fingerprints_fit_their_cards_at_800_pixels(tmp_path: Path) -> None:
    """In an 800-pixel window, every card (a long run id in its title, the fingerprint, an
    effect's idem_key) stays inside its border, and the page does not scroll sideways."""
    async with (
        serving(tmp_path, runs=long_names) as server,
        browser(tmp_path, width=800) as context,
    ):
        page = await context.new_page()
        await page.goto(server.url + "login")
        await page.fill("#by", "ana")
        await page.fill("#token", TOKEN)
        await page.click("button:has-text('Log in')")
        for path in ("", "runs/" + LONG_RUN, "runs/" + LONG_EFFECT):
            await page.goto(server.url + path)
            assert await page.locator(".card").count() >= 1
            assert await overflowing(page, ".card") == [], path
            assert await overflowing(page, "h1") == [], path
            wide = await page.evaluate("document.documentElement.scrollWidth")
            assert wide <= 800, f"{path or '/'} is {wide} pixels wide"
            await shot(page, "narrow-" + (path.split("/")[-1][:12] or "runs"))
        title = page.locator(".card h3")
        assert LONG_EFFECT in " ".join((await title.inner_text()).split())
