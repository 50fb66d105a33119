"""HttpEffect against a real HTTP server on 127.0.0.1, and that server's own contract.

The agent runs in this process; the InvoiceServer serves from a thread and
counts every POST, key and body it received.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

import asiento
from asiento import (
    Agent,
    FinalStep,
    ModelResponse,
    Phase,
    Session,
    SqliteCheckpointer,
    StepEvent,
    Tool,
    ToolAnswerLost,
    ToolCall,
    ToolStep,
)
from asiento.effects import EffectRejected, IdempotencyKeyConflict
from asiento.testing import ScriptedGateway
from asiento.testing.invoices import InvoiceServer

from .child import INVOICE, PublishInvoice, invoice_effect

RUN = "run-1"
KEY = asiento.idem_key(RUN, "m1.t1", INVOICE)


@pytest.fixture
def server() -> Iterator[InvoiceServer]:
    """A Stripe-like destination: deduplicates by Idempotency-Key."""
    with InvoiceServer(honour_keys=True) as running:
        yield running


@pytest.fixture
def keyless() -> Iterator[InvoiceServer]:
    """A destination that ignores Idempotency-Key: every POST creates an invoice."""
    with InvoiceServer(honour_keys=False) as running:
        yield running


def gateway(arguments: dict[str, Any] = INVOICE) -> ScriptedGateway:
    call = ToolCall(name="publish_invoice", arguments=dict(arguments))
    return ScriptedGateway([ModelResponse(tool_calls=[call]), ModelResponse(text="done")])


async def drive(tool: Tool, db: Path, arguments: dict[str, Any] = INVOICE) -> list[Any]:
    """One pass in this process over RUN; the steps it yielded."""
    store = SqliteCheckpointer(db)
    agent = Agent(instructions="Publish.", tools=[tool])
    try:
        session = Session(RUN, gateway(arguments), store)
        return [s async for s in agent.run("publish", session=session)]
    finally:
        await store.close()


async def journal(db: Path) -> list[StepEvent]:
    store = SqliteCheckpointer(db)
    try:
        return await store.load(RUN)
    finally:
        await store.close()


def effect_result(events: list[StepEvent]) -> dict[str, Any]:
    (result,) = [e for e in events if e.step_id.startswith("m1.t1") and e.phase is Phase.RESULT]
    return dict(result.payload)


def with_keys(server: InvoiceServer, *, lookup: bool = False) -> PublishInvoice:
    return invoice_effect(server.invoices_url, keys=True, ttl=3600.0, lookup=lookup)


# -- the key and the body ------------------------------------------------------------------


async def test_header_is_the_steps_frozen_key(tmp_path: Path, server: InvoiceServer) -> None:
    """The Idempotency-Key sent is the intent's idem_key: asiento.idem_key(run, step, payload)."""
    await drive(with_keys(server).as_tool(), tmp_path / "runs.db")
    (intent,) = [e for e in await journal(tmp_path / "runs.db") if e.phase is Phase.INTENT]
    assert intent.payload["prepared"] == INVOICE
    assert intent.payload["idem_key"] == KEY
    assert server.headers_seen == [KEY]


async def test_same_key_twice_makes_one_invoice(server: InvoiceServer) -> None:
    """Publishing twice with one key: the destination answers the first invoice again."""
    effect = with_keys(server)
    first = await effect.publish(INVOICE, KEY)
    again = await effect.publish(INVOICE, KEY)
    assert first == again
    assert first.remote_id == "in_000001"
    assert (server.posts, len(server.invoices)) == (2, 1)


async def test_503_is_retried_with_same_key_and_identical_body(
    tmp_path: Path, server: InvoiceServer
) -> None:
    """Two 503s, then success: three POSTs, one key, byte-identical bodies, one invoice."""
    server.fail_next(2)
    steps = await drive(with_keys(server).as_tool(), tmp_path / "runs.db")
    assert isinstance(steps[-1], FinalStep)
    assert server.posts == 3
    assert server.headers_seen == [KEY] * 3
    assert len(set(server.bodies)) == 1
    assert len(server.invoices) == 1
    outcome = effect_result(await journal(tmp_path / "runs.db"))
    assert (outcome["via"], outcome["attempts"]) == ("publish", 1)


async def test_dropped_connection_is_retried(server: InvoiceServer) -> None:
    """A connection closed before the server acted is retried: one invoice."""
    server.drop_next(1)
    published = await with_keys(server).publish(INVOICE, KEY)
    assert published.remote_id == "in_000001"
    assert (server.posts, len(server.invoices)) == (2, 1)


async def test_lost_answer_with_keys_is_deduplicated(server: InvoiceServer) -> None:
    """The invoice was created but its answer lost: the retry with the same key gets it back."""
    server.drop_next(1, applied=True)
    published = await with_keys(server).publish(INVOICE, KEY)
    assert published.remote_id == "in_000001"
    assert (server.posts, len(server.invoices)) == (2, 1)


async def test_lost_answer_without_keys_is_not_published_twice(
    tmp_path: Path, keyless: InvoiceServer
) -> None:
    """A destination that ignores keys, answer lost after it applied: still one invoice."""
    effect = invoice_effect(keyless.invoices_url, keys=False, ttl=None, lookup=True)
    keyless.drop_next(1, applied=True)
    with contextlib.suppress(ToolAnswerLost):  # or a lookup before retrying: both fine
        await drive(effect.as_tool(), tmp_path / "runs.db")
    assert len(keyless.invoices) <= 1, "a blind retry to a key-ignoring destination duplicated"
    steps = await drive(effect.as_tool(), tmp_path / "runs.db")
    assert isinstance(steps[-1], FinalStep)
    assert len(keyless.invoices) == 1


async def test_keyless_effect_with_one_attempt_leaves_it_to_the_lookup(
    tmp_path: Path, keyless: InvoiceServer
) -> None:
    """Without keys and with max_attempts=1, a lost answer is settled by the resume's lookup."""
    cls = type(invoice_effect(keyless.invoices_url, keys=False, ttl=None, lookup=True))
    effect = type("OneShot", (cls,), {"max_attempts": 1})(keyless.invoices_url)
    keyless.drop_next(1, applied=True)
    with pytest.raises(ToolAnswerLost, match=r"effect .*may have happened") as lost:
        await drive(effect.as_tool(), tmp_path / "runs.db")
    assert isinstance(lost.value.__cause__, httpx.RemoteProtocolError)
    steps = await drive(effect.as_tool(), tmp_path / "runs.db")
    assert isinstance(steps[-1], FinalStep)
    assert (keyless.posts, len(keyless.invoices)) == (1, 1)
    outcome = effect_result(await journal(tmp_path / "runs.db"))
    assert (outcome["via"], outcome["attempts"]) == ("lookup", 1)


async def test_payload_is_frozen_not_regenerated(tmp_path: Path, server: InvoiceServer) -> None:
    """A prepare that never gives the same payload twice: the resume republishes the frozen one."""
    serial = itertools.count()

    class StampedInvoice(PublishInvoice):
        def prepare(self, customer: str, amount: int, number: str) -> dict[str, Any]:
            """Publish an invoice, stamped with the moment it was prepared."""
            return {"customer": customer, "amount": amount, "number": number, "n": next(serial)}

    effect = StampedInvoice(server.invoices_url)
    server.fail_next(effect.max_attempts)
    with pytest.raises(ToolAnswerLost, match=r"effect .*may have happened") as lost:
        await drive(effect.as_tool(), tmp_path / "runs.db")
    assert isinstance(lost.value.__cause__, httpx.HTTPStatusError)
    steps = await drive(StampedInvoice(server.invoices_url).as_tool(), tmp_path / "runs.db")
    assert isinstance(steps[-1], FinalStep)
    assert next(serial) == 1, "prepare ran once, for the first pass only"
    assert len(set(server.bodies)) == 1
    assert len(server.invoices) == 1
    outcome = effect_result(await journal(tmp_path / "runs.db"))
    assert (outcome["via"], outcome["attempts"]) == ("republish", 2)


# -- refusals and conflicts ----------------------------------------------------------------


async def test_key_conflict_is_raised_never_success(tmp_path: Path, server: InvoiceServer) -> None:
    """The key was used with other parameters: IdempotencyKeyConflict out of run(), twice."""
    effect = with_keys(server)
    await effect.publish({**INVOICE, "amount": 1}, KEY)  # someone else took our key
    for _ in range(2):
        with pytest.raises(IdempotencyKeyConflict, match="other parameters"):
            await drive(effect.as_tool(), tmp_path / "runs.db")
    events = await journal(tmp_path / "runs.db")
    assert not [e for e in events if e.phase is Phase.RESULT and e.step_id.startswith("m1.t1")]
    assert [e.step_id for e in events if e.phase is Phase.SUBMITTED] == ["m1.t1", "m1.t1/2"]
    assert len(server.invoices) == 1
    assert server.invoices[0]["amount"] == 1


async def test_plain_4xx_is_a_recorded_failure(tmp_path: Path, server: InvoiceServer) -> None:
    """A refusal (400 invalid request) is the step's failed outcome; the run goes on and closes."""
    bad = {**INVOICE, "amount": -5}
    steps = await drive(with_keys(server).as_tool(), tmp_path / "runs.db", bad)
    (tool_step,) = [s for s in steps if isinstance(s, ToolStep)]
    assert tool_step.status == "error"
    assert "amount" in str(tool_step.result)
    assert isinstance(steps[-1], FinalStep)
    outcome = effect_result(await journal(tmp_path / "runs.db"))
    assert outcome["status"] == "error"
    assert outcome["error"].startswith("refused:")
    assert (server.posts, server.invoices) == (1, [])


async def test_4xx_raises_effect_rejected(server: InvoiceServer) -> None:
    """publish() turns a plain 4xx into EffectRejected, without retrying it."""
    with pytest.raises(EffectRejected, match="400"):
        await with_keys(server).publish({"customer": "ACME"}, KEY)
    assert server.posts == 1


async def test_exhausted_retries_leave_the_step_submitted(
    tmp_path: Path, server: InvoiceServer
) -> None:
    """Every attempt got 503: the error leaves run(), and the resume republishes once."""
    effect = with_keys(server)
    server.fail_next(effect.max_attempts)
    with pytest.raises(ToolAnswerLost, match=r"effect .*may have happened") as lost:
        await drive(effect.as_tool(), tmp_path / "runs.db")
    assert isinstance(lost.value.__cause__, httpx.HTTPStatusError)
    assert server.invoices == []
    steps = await drive(effect.as_tool(), tmp_path / "runs.db")
    assert isinstance(steps[-1], FinalStep)
    assert len(server.invoices) == 1
    assert server.headers_seen == [KEY] * (effect.max_attempts + 1)


async def test_users_own_httpx_client_is_used_and_left_open(
    tmp_path: Path, server: InvoiceServer
) -> None:
    """HttpEffect(client=...) sends through the official httpx client it was given."""
    sent: list[httpx.Request] = []

    async def remember(request: httpx.Request) -> None:
        sent.append(request)

    async with httpx.AsyncClient(event_hooks={"request": [remember]}) as client:
        effect = PublishInvoice(server.invoices_url, client=client)
        steps = await drive(effect.as_tool(), tmp_path / "runs.db")
        assert not client.is_closed
    assert isinstance(steps[-1], FinalStep)
    assert [r.headers["Idempotency-Key"] for r in sent] == [KEY]
    assert len(server.invoices) == 1


# -- the InvoiceServer itself -------------------------------------------------------------


@pytest.fixture(scope="module")
def web() -> Iterator[httpx.Client]:
    """One plain HTTP client for the server's own tests."""
    with httpx.Client() as client:
        yield client


def post(
    web: httpx.Client, server: InvoiceServer, body: dict[str, Any], key: str | None = "k1"
) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return web.post(server.invoices_url, json=body, headers=headers)


def test_server_replays_first_answer_for_same_key_and_body(
    web: httpx.Client, server: InvoiceServer
) -> None:
    """Same key, same parameters (in any key order): the first answer, marked as replayed."""
    first = post(web, server, INVOICE)
    again = post(web, server, dict(reversed(INVOICE.items())))
    assert first.json() == again.json()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(server.invoices) == 1


def test_server_refuses_same_key_with_other_body(web: httpx.Client, server: InvoiceServer) -> None:
    """Same key, other parameters: 400 idempotency_error, nothing created."""
    post(web, server, INVOICE)
    refused = post(web, server, {**INVOICE, "amount": 7})
    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "idempotency_error"
    assert len(server.invoices) == 1


def test_server_forgets_keys_after_ttl(web: httpx.Client) -> None:
    """A key older than key_ttl is forgotten: the same request creates a second invoice."""
    with InvoiceServer(honour_keys=True, key_ttl=0.2) as short:
        post(web, short, INVOICE)
        time.sleep(0.3)
        post(web, short, INVOICE)
        assert len(short.invoices) == 2


def test_server_expire_keys(web: httpx.Client, server: InvoiceServer) -> None:
    """expire_keys() forgets every key at once."""
    post(web, server, INVOICE)
    server.expire_keys()
    post(web, server, INVOICE)
    assert [i["id"] for i in server.invoices] == ["in_000001", "in_000002"]


def test_keyless_server_creates_on_every_post(web: httpx.Client, keyless: InvoiceServer) -> None:
    """honour_keys=False ignores the header: two POSTs with one key, two invoices."""
    post(web, keyless, INVOICE)
    post(web, keyless, INVOICE)
    assert keyless.headers_seen == ["k1", "k1"]
    assert len(keyless.invoices) == 2


def test_server_lists_and_finds_by_number(web: httpx.Client, keyless: InvoiceServer) -> None:
    """GET /invoices lists all; ?number= filters by business id; /invoices/<id> gets one."""
    post(web, keyless, INVOICE)
    post(web, keyless, {**INVOICE, "number": "F-2"}, key=None)
    everything = web.get(keyless.invoices_url).json()["data"]
    found = web.get(keyless.invoices_url, params={"number": "F-2"}).json()["data"]
    assert [i["number"] for i in everything] == [INVOICE["number"], "F-2"]
    assert [i["id"] for i in found] == ["in_000002"]
    assert web.get(f"{keyless.invoices_url}/in_000001").json()["number"] == INVOICE["number"]
    assert web.get(f"{keyless.invoices_url}/in_000009").status_code == 404


def test_server_injected_failures(web: httpx.Client, server: InvoiceServer) -> None:
    """fail_next answers 503 before acting; drop_next closes the connection without an answer."""
    server.fail_next(1)
    assert post(web, server, INVOICE).status_code == 503
    server.drop_next(1)
    with pytest.raises(httpx.RemoteProtocolError):
        post(web, server, INVOICE)
    assert server.invoices == []
    assert post(web, server, INVOICE).status_code == 200
    assert server.posts == 3


async def test_server_serves_concurrent_posts(server: InvoiceServer) -> None:
    """Twenty concurrent POSTs with one key create exactly one invoice."""
    async with httpx.AsyncClient() as client:
        answers = await asyncio.gather(
            *[
                client.post(server.invoices_url, json=INVOICE, headers={"Idempotency-Key": "k"})
                for _ in range(20)
            ]
        )
    assert {a.json()["id"] for a in answers} == {"in_000001"}
    assert (server.posts, len(server.invoices)) == (20, 1)


def test_client_killed_mid_request_is_not_reported_as_a_server_error(
    server: InvoiceServer, capfd: pytest.CaptureFixture[str]
) -> None:
    """A client that vanishes (RST) mid-exchange, as in every crash test, prints nothing."""
    import socket
    import struct
    from urllib.parse import urlsplit

    where = urlsplit(server.url)
    body = b'{"customer": "c", "amount": 1}'
    for _ in range(5):
        with socket.create_connection((where.hostname, where.port), timeout=5) as sock:
            sock.sendall(
                b"POST /invoices HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body[:5]
            )
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    time.sleep(0.3)  # let the handler threads meet the reset
    assert "Traceback" not in capfd.readouterr().err


class _Answer422(ThreadingHTTPServer):
    """Answers every POST with 422 and a fixed JSON body."""

    def __init__(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(422)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@contextlib.contextmanager
def answering_422(body: dict[str, Any]) -> Iterator[str]:
    server = _Answer422(body)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/invoices"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


VALIDATION_422 = {"detail": [{"loc": ["body", "amount"], "msg": "must be positive"}]}
DRAFT_422 = {
    "type": "https://developer.example.com/idempotency",
    "title": "Idempotency-Key is already used",
    "detail": "Idempotency Key MUST not be reused across different payloads of this operation.",
}


async def test_422_validation_error_is_a_recorded_refusal(tmp_path: Path) -> None:
    """A FastAPI-style 422 is the step's failure (the model reads it), not a key conflict."""
    with answering_422(VALIDATION_422) as url:
        steps = await drive(
            invoice_effect(url, keys=True, ttl=60, lookup=False).as_tool(), tmp_path / "runs.db"
        )
    assert isinstance(steps[-1], FinalStep)
    result = effect_result(await journal(tmp_path / "runs.db"))
    assert result["status"] == "error", result
    assert "must be positive" in result["error"], result


async def test_422_naming_the_idempotency_key_is_a_conflict(tmp_path: Path) -> None:
    """The IETF draft's 422 (key reused with another payload) raises IdempotencyKeyConflict."""
    with answering_422(DRAFT_422) as url:
        effect = invoice_effect(url, keys=True, ttl=60, lookup=False)
        with pytest.raises(IdempotencyKeyConflict, match="other parameters"):
            await drive(effect.as_tool(), tmp_path / "runs.db")


async def test_a_success_that_is_not_json_is_an_asiento_error_naming_the_effect(
    tmp_path: Path, server: InvoiceServer
) -> None:
    """The invoice was created and the answer is not JSON: ToolAnswerLost names the effect
    and its URL (the JSON error is its cause); the step stays submitted and the resume
    republishes under the same key: one invoice."""
    effect = with_keys(server)
    server.garble_next(1)
    with pytest.raises(ToolAnswerLost, match=r"effect 'publish_invoice' \(POST http") as lost:
        await drive(effect.as_tool(), tmp_path / "runs.db")
    assert isinstance(lost.value.__cause__, ValueError)
    assert len(server.invoices) == 1
    steps = await drive(effect.as_tool(), tmp_path / "runs.db")
    assert isinstance(steps[-1], FinalStep)
    assert len(server.invoices) == 1
    assert effect_result(await journal(tmp_path / "runs.db"))["via"] == "republish"
