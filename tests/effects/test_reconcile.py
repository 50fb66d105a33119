"""The reconcile table (pure), the effect record's fields, and the seed's idempotency key."""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import asiento
from asiento import (
    Agent,
    ApprovalStep,
    FinalStep,
    ModelResponse,
    Session,
    SqliteCheckpointer,
    Tool,
    ToolCall,
    UsageError,
    require_approval_for,
)
from asiento.effects import (
    IdempotencyKeyConflict,
    Reconcile,
    effect_records,
    effect_records_of,
    reconcile,
)
from asiento.testing import ScriptedGateway
from asiento.testing.invoices import InvoiceServer

from .child import INVOICE, PublishInvoice, invoice_effect

RUN = "rpt-2026-09-17-a1b2"
TTL = 24 * 3600.0


def seed_idem_key(run_id: str, step_id: str, params: dict[str, Any]) -> str:
    """The seed's function, copied verbatim."""
    canon = json.dumps(params, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canon.encode()).hexdigest()[:6]
    return f"{run_id}:{step_id}:{digest}"


def table(
    *, keys: bool, ttl: float | None, lookup: bool, age: float | None, margin: float | None = None
) -> Reconcile:
    return reconcile(honours_keys=keys, key_ttl=ttl, has_lookup=lookup, age=age, key_margin=margin)


# -- the reconcile table, one test per row ------------------------------------------------

MARGIN = 3600.0  # the default margin of a 24 h TTL: 10% of it, at most an hour


def test_live_key_is_republished() -> None:
    """Keys honoured and younger than the TTL minus the margin: publish again with the same key."""
    assert table(keys=True, ttl=TTL, lookup=False, age=60.0) is Reconcile.REPUBLISH


def test_live_key_wins_over_lookup() -> None:
    """A live key is preferred to a lookup: the destination itself deduplicates."""
    assert table(keys=True, ttl=TTL, lookup=True, age=60.0) is Reconcile.REPUBLISH


def test_key_without_ttl_never_expires() -> None:
    """key_ttl=None declares keys that are never forgotten: republish after any wait."""
    assert table(keys=True, ttl=None, lookup=False, age=10 * 365 * 86400.0) is Reconcile.REPUBLISH


def test_key_just_below_ttl_minus_margin_is_alive() -> None:
    """A key one second short of its TTL minus the margin is still trusted."""
    assert table(keys=True, ttl=TTL, lookup=False, age=TTL - MARGIN - 1) is Reconcile.REPUBLISH


def test_key_inside_the_margin_is_not_trusted() -> None:
    """From TTL minus the margin on, a skewed clock could hide an expired key: look up."""
    assert table(keys=True, ttl=TTL, lookup=True, age=TTL - MARGIN) is Reconcile.LOOKUP
    assert table(keys=True, ttl=TTL, lookup=False, age=TTL - 30.0) is Reconcile.UNCERTAIN


def test_key_exactly_at_ttl_is_expired_then_lookup() -> None:
    """At exactly the TTL the destination may already have forgotten the key: look up."""
    assert table(keys=True, ttl=TTL, lookup=True, age=TTL) is Reconcile.LOOKUP


def test_key_exactly_at_ttl_without_lookup_is_uncertain() -> None:
    """At exactly the TTL, with no lookup, nobody can know: a person decides."""
    assert table(keys=True, ttl=TTL, lookup=False, age=TTL) is Reconcile.UNCERTAIN


def test_expired_key_with_lookup_looks_up() -> None:
    """A weekend waiting for approval outlived the key: the lookup decides."""
    assert table(keys=True, ttl=TTL, lookup=True, age=3 * 86400.0) is Reconcile.LOOKUP


def test_expired_key_without_lookup_is_uncertain() -> None:
    """An expired key and no lookup: UncertainEffect, never a blind republish."""
    assert table(keys=True, ttl=TTL, lookup=False, age=3 * 86400.0) is Reconcile.UNCERTAIN


@pytest.mark.parametrize("age", [-0.001, -86400.0, math.nan, math.inf, -math.inf, None])
def test_an_age_that_cannot_be_trusted_is_never_fresh(age: float | None) -> None:
    """Negative (a clock ahead or gone back), not a number, or unknown: look up, or a person."""
    assert table(keys=True, ttl=TTL, lookup=True, age=age) is Reconcile.LOOKUP
    assert table(keys=True, ttl=TTL, lookup=False, age=age) is Reconcile.UNCERTAIN


def test_no_keys_with_lookup_looks_up() -> None:
    """A destination that ignores keys is reconciled by lookup, however young the step."""
    assert table(keys=False, ttl=None, lookup=True, age=0.0) is Reconcile.LOOKUP


def test_no_keys_no_lookup_is_uncertain() -> None:
    """Neither keys nor lookup: UncertainEffect even a millisecond after submitting."""
    assert table(keys=False, ttl=TTL, lookup=False, age=0.001) is Reconcile.UNCERTAIN


# -- the margin ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ttl", "margin"),
    [(30.0, 60.0), (600.0, 60.0), (3600.0, 360.0), (7200.0, 720.0), (TTL, 3600.0), (1e9, 3600.0)],
)
def test_default_margin_is_a_tenth_of_the_ttl_between_a_minute_and_an_hour(
    ttl: float, margin: float
) -> None:
    """10% of the TTL, at least 60 s and at most 1 h: trusted below TTL - margin only."""
    assert table(keys=True, ttl=ttl, lookup=False, age=max(ttl - margin - 1, 0)) is (
        Reconcile.REPUBLISH if ttl > margin else Reconcile.UNCERTAIN
    )
    assert table(keys=True, ttl=ttl, lookup=False, age=ttl - margin) is Reconcile.UNCERTAIN


def test_margin_is_configurable() -> None:
    """key_margin=0 trusts a key up to its TTL; a wider margin trusts it for less time."""
    assert table(keys=True, ttl=TTL, lookup=False, age=TTL - 1, margin=0) is Reconcile.REPUBLISH
    wide = TTL / 2
    assert table(keys=True, ttl=TTL, lookup=False, age=wide - 1, margin=wide) is Reconcile.REPUBLISH
    assert table(keys=True, ttl=TTL, lookup=False, age=wide, margin=wide) is Reconcile.UNCERTAIN


@pytest.mark.parametrize(
    ("ttl", "margin"), [(TTL, -1.0), (TTL, math.nan), (TTL, math.inf), (-1.0, None)]
)
def test_a_margin_or_ttl_that_is_not_seconds_is_refused(ttl: float, margin: float | None) -> None:
    """A negative or non-finite margin (or TTL) would trust keys too long: UsageError."""
    with pytest.raises(UsageError, match="must be None or a number of seconds >= 0"):
        table(keys=True, ttl=ttl, lookup=False, age=1.0, margin=margin)


def test_an_effect_with_a_bad_margin_is_refused_when_it_becomes_a_tool() -> None:
    """The mistake surfaces when the agent is built, naming the effect, not at a resume."""
    bad = type("BadMargin", (PublishInvoice,), {"honours_keys": True, "key_margin": -5.0})
    with pytest.raises(UsageError, match="BadMargin: key_margin must be"):
        bad("http://127.0.0.1:9/invoices").as_tool()


# -- the idempotency key -----------------------------------------------------------------

PARAMS = [
    {"customer": "ACME", "amount": 1200, "number": "F-1"},
    {"number": "F-1", "amount": 1200, "customer": "ACME"},
    {"z": [3, 1, {"b": 2, "a": 1}], "a": {"y": None, "x": True}, "m": 1.5},
    {"a": {"x": True, "y": None}, "m": 1.5, "z": [3, 1, {"a": 1, "b": 2}]},
    {"cliente": "Añó & Cía", "importe": -0.0, "notas": "línea 1\nlínea 2 €"},
    {},
]


@pytest.mark.parametrize("params", PARAMS)
def test_idem_key_matches_the_seed_byte_for_byte(params: dict[str, Any]) -> None:
    """asiento.idem_key gives exactly the seed's key for the same run, step and params."""
    assert asiento.idem_key(RUN, "publish_invoice", params) == seed_idem_key(
        RUN, "publish_invoice", params
    )


def test_idem_key_does_not_depend_on_key_order() -> None:
    """Two dicts with the same items in another order give the same key."""
    assert asiento.idem_key(RUN, "s", PARAMS[0]) == asiento.idem_key(RUN, "s", PARAMS[1])
    assert asiento.idem_key(RUN, "s", PARAMS[2]) == asiento.idem_key(RUN, "s", PARAMS[3])
    assert asiento.idem_key(RUN, "s", PARAMS[0]) != asiento.idem_key(RUN, "s", PARAMS[2])


# -- the effect record ---------------------------------------------------------------------


def gateway() -> ScriptedGateway:
    call = ToolCall(name="publish_invoice", arguments=dict(INVOICE))
    return ScriptedGateway([ModelResponse(tool_calls=[call]), ModelResponse(text="done")])


async def drive(tool: Tool, db: Path, *, policy: Any = None) -> list[Any]:
    """One pass in this process over RUN; the steps it yielded."""
    store = SqliteCheckpointer(db)
    agent = Agent(instructions="Publish.", tools=[tool], policy=policy)
    try:
        return [s async for s in agent.run("publish", session=Session(RUN, gateway(), store))]
    finally:
        await store.close()


async def records_of(db: Path) -> list[Any]:
    store = SqliteCheckpointer(db)
    try:
        return await effect_records(store, RUN)
    finally:
        await store.close()


@pytest.fixture
def server() -> Iterator[InvoiceServer]:
    with InvoiceServer(honour_keys=True) as running:
        yield running


def expected_key(step_id: str) -> str:
    canonical = json.dumps(INVOICE, sort_keys=True, separators=(",", ":"))
    return f"{RUN}:{step_id}:{hashlib.sha256(canonical.encode()).hexdigest()[:6]}"


async def test_confirmed_record_has_every_field(tmp_path: Path, server: InvoiceServer) -> None:
    """A published effect: run_id, step_id, the seed's key, params_hash, remote_id, attempts."""
    before = time.time()
    effect = invoice_effect(server.invoices_url, keys=True, ttl=TTL, lookup=False)
    steps = await drive(effect.as_tool(), tmp_path / "runs.db")
    assert isinstance(steps[-1], FinalStep)
    (record,) = await records_of(tmp_path / "runs.db")
    (invoice,) = server.invoices
    assert (record.run_id, record.step_id) == (RUN, "m1.t1")
    assert record.idem_key == expected_key("m1.t1")
    assert record.params_hash == record.idem_key.rsplit(":", 1)[1]
    assert len(record.params_hash) == 6
    assert (record.status, record.remote_id, record.attempts) == ("confirmed", invoice["id"], 1)
    assert before <= record.updated_at <= time.time()
    assert server.headers_seen == [record.idem_key]


async def test_prepared_record_awaits_approval(tmp_path: Path, server: InvoiceServer) -> None:
    """Frozen but not submitted (waiting for a person): status prepared, 0 attempts, no POST."""
    effect = invoice_effect(server.invoices_url, keys=True, ttl=TTL, lookup=False)
    policy = require_approval_for("publish_invoice")
    steps = await drive(effect.as_tool(), tmp_path / "runs.db", policy=policy)
    assert isinstance(steps[-1], ApprovalStep)
    assert steps[-1].prepared == INVOICE
    (record,) = await records_of(tmp_path / "runs.db")
    assert (record.status, record.attempts, record.remote_id) == ("prepared", 0, None)
    assert record.idem_key == expected_key("m1.t1")
    assert server.posts == 0


async def test_submitted_record_after_a_key_conflict(tmp_path: Path, server: InvoiceServer) -> None:
    """A publish that ended in an exception leaves the record submitted, with 1 attempt."""
    effect = invoice_effect(server.invoices_url, keys=True, ttl=TTL, lookup=False)
    other = {**INVOICE, "amount": 1}
    await effect.publish(other, expected_key("m1.t1"))  # someone else took the key
    with pytest.raises(IdempotencyKeyConflict):
        await drive(effect.as_tool(), tmp_path / "runs.db")
    (record,) = await records_of(tmp_path / "runs.db")
    assert (record.status, record.attempts, record.remote_id) == ("submitted", 1, None)


async def test_failed_record_after_a_refusal(tmp_path: Path, server: InvoiceServer) -> None:
    """A destination that refused (4xx): status failed, no remote_id, no invoice."""
    effect = invoice_effect(server.invoices_url, keys=True, ttl=TTL, lookup=False)
    server.fail_next(1, status=402)
    steps = await drive(effect.as_tool(), tmp_path / "runs.db")
    assert isinstance(steps[-1], FinalStep)
    (record,) = await records_of(tmp_path / "runs.db")
    assert (record.status, record.attempts, record.remote_id) == ("failed", 1, None)
    assert server.invoices == []


async def test_effect_records_skip_plain_tools(tmp_path: Path) -> None:
    """Only effect steps have an effect record: a plain @tool's step is not listed."""

    @asiento.tool(name="publish_invoice")
    def plain(customer: str, amount: int, number: str) -> str:
        """Pretend to publish."""
        return "ok"

    await drive(plain, tmp_path / "runs.db")
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        assert effect_records_of(await store.load(RUN)) == []
    finally:
        await store.close()
