"""Runs that put every kind of record in a journal, through the public API only.

``record(store)`` drives them on any store; ``python tests/journal/scenarios.py``
wrote the fixtures in ``tests/journal/fixtures/`` with the code of commit b3236b8
(before the payloads had types): an SQLite journal and the rows of a PostgreSQL one.
``test_old_journals.py`` reads and resumes them with today's code, and checks that
the same runs recorded today give byte-identical records.

Every kind of payload appears: model results (with usage, cache tokens and cost),
intents (a plain tool, an effect with its prepared payload and key, a denial by
policy, one waiting for approval), submitted markers, outcomes (ok, error, denied,
an effect published, arguments that do not fit, a value JSON cannot carry in the
model's arguments), approvals and denials by a person, resolutions (happened, and
not, with the retry's attempt), the final record (answered, abandoned).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

from asiento import (
    Agent,
    Checkpointer,
    ModelResponse,
    Price,
    Session,
    ToolCall,
    UncertainEffect,
    Usage,
    abandon,
    approve,
    deny,
    require_approval_for,
    resolve,
    tool,
)
from asiento.effects import Effect, Published
from asiento.model import ModelRequest
from asiento.testing import ScriptedGateway

FIXTURES = Path(__file__).with_name("fixtures")
SQLITE_FIXTURE = FIXTURES / "journal-b3236b8.db"
# The rows of a PostgreSQL journal, as ``COPY ... TO STDOUT`` wrote them: table -> file.
POSTGRES_FIXTURES = {
    "journal": FIXTURES / "journal-b3236b8.pg-journal.tsv",
    "runs": FIXTURES / "journal-b3236b8.pg-runs.tsv",
}
POSTGRES_COLUMNS = {
    "journal": "run_id, step_id, phase, decision, payload, created_at",
    "runs": (
        "run_id, status, events, created_at, updated_at, fence, model_calls, input_tokens,"
        " output_tokens, replayed_calls, saved_input_tokens, saved_output_tokens, task, agent,"
        " attempts, reason, cost, saved_cost, tool_steps, cached_input_tokens, cache_write_tokens"
    ),
}
POSTGRES_ORDER = {"journal": "seq", "runs": "run_id"}
PRICES = {"scripted": Price(input_per_mtok=3.0, output_per_mtok=15.0, cached_input_per_mtok=0.3)}


class Stop(BaseException):
    """The process dies inside a tool: not an error the loop records."""


class Invoice(Effect):
    """Issue an invoice (a destination that honours idempotency keys for a day)."""

    name = "invoice"
    honours_keys = True
    key_ttl = 24 * 3600.0

    def prepare(self, customer: str, cents: int) -> dict[str, Any]:
        """Issue an invoice of ``cents`` to ``customer``."""
        return {"customer": customer, "cents": cents, "currency": "EUR"}

    async def publish(self, payload: Any, idem_key: str) -> Published:
        return Published(remote_id="in_42", result={"id": "in_42", "key": idem_key})


def agent(dies: set[str]) -> Agent:
    @tool(idempotent=True)
    def lookup(customer: str) -> str:
        """Look a customer up."""
        return f"{customer}: premium, ñandú 🧾"

    @tool()
    def pay(cents: int) -> dict[str, Any]:
        """Pay an amount."""
        return {"paid": cents, "ok": True}

    @tool()
    def send(to: str) -> str:
        """Send a message; the scenario kills the process inside it when told to."""
        if to in dies:
            dies.discard(to)
            raise Stop
        return f"sent to {to}"

    @tool()
    def fail(why: str) -> str:
        """A tool that raises."""
        raise RuntimeError(why)

    tools = [lookup, pay, send, fail, Invoice().as_tool()]
    return Agent(instructions="Serve ana.", tools=tools, policy=require_approval_for("pay"))


def answer(*calls: ToolCall, text: str = "", cached: int = 0) -> ModelResponse:
    usage = Usage(input_tokens=120, output_tokens=12, cached_input_tokens=cached)
    return ModelResponse(text=text, tool_calls=list(calls), usage=usage, model="scripted")


def call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


SCRIPTS: dict[str, list[ModelResponse]] = {
    "everything-ok": [
        answer(call("lookup", customer="ana"), call("invoice", customer="ana", cents=1200)),
        answer(text="invoiced", cached=100),
    ],
    "approved": [answer(call("pay", cents=500)), answer(text="paid")],
    "denied": [answer(call("pay", cents=9000)), answer(text="not paid")],
    "waiting": [answer(call("pay", cents=70)), answer(text="paid later")],
    "resolved-happened": [answer(call("send", to="bo")), answer(text="sent")],
    "resolved-not": [answer(call("send", to="cy")), answer(text="sent again")],
    "uncertain": [answer(call("send", to="di")), answer(text="never")],
    "abandoned": [answer(call("send", to="ed")), answer(text="never")],
    "errors": [
        answer(
            call("nope", x=1),
            call("lookup", customer=3),
            call("fail", why="the disk is on fire"),
        ),
        answer(text="errors fed back"),
    ],
}


class UnfitGateway:
    """A gateway whose model puts NaN in tool-call arguments (a model's answer, as it came)."""

    def __init__(self) -> None:
        self.inner = ScriptedGateway([answer(text="unused"), answer(text="the model was told")])

    async def complete(self, request: ModelRequest, *, idempotency_key: str) -> ModelResponse:
        if not any(m.role == "assistant" for m in request.messages):
            nan = ToolCall(name="pay", arguments={"cents": float("nan")})
            return answer(nan)
        return await self.inner.complete(request, idempotency_key=idempotency_key)


async def drive(store: Checkpointer, run_id: str, dies: set[str], gateway: Any = None) -> Any:
    """One pass; the last step, or the exception that ended it."""
    gateway = gateway or ScriptedGateway(SCRIPTS[run_id])
    session = Session(run_id, gateway, store, prices=PRICES)
    last: Any = None
    try:
        async for step in agent(dies).run(f"task of {run_id}", session=session):
            last = step
    except (Stop, UncertainEffect) as exc:
        return exc
    return last


async def record(store: Checkpointer, *, resume: bool = True) -> None:
    """Every scenario, to the state the fixture holds (``resume``: the passes after a
    person's decision too)."""
    dies = {"bo", "cy", "di", "ed"}
    await drive(store, "everything-ok", dies)
    for run_id in ("approved", "denied", "waiting"):
        await drive(store, run_id, dies)
    await approve(store, "approved", "m1.t1", by="ana", reason="checked")
    await deny(store, "denied", "m1.t1", by="ana", reason="too much")
    for run_id in ("resolved-happened", "resolved-not", "uncertain", "abandoned"):
        await drive(store, run_id, dies)  # killed inside send
        await drive(store, run_id, dies)  # UncertainEffect
    await resolve(store, "resolved-happened", "m1.t1", happened=True, by="ana",
                  remote_id="msg-7", reason="in the outbox")  # fmt: skip
    await resolve(store, "resolved-not", "m1.t1", happened=False, by="ana", reason="not sent")
    await abandon(store, "abandoned", by="ana", reason="nobody can tell")
    await drive(store, "errors", dies)
    await drive(store, "unfit", dies, UnfitGateway())
    if resume:
        for run_id in ("approved", "denied", "resolved-happened", "resolved-not"):
            await drive(store, run_id, dies)


RUNS = (*SCRIPTS, "unfit")


async def _write_fixtures(pg_dsn: str | None) -> None:
    from asiento import SqliteCheckpointer

    FIXTURES.mkdir(exist_ok=True)
    SQLITE_FIXTURE.unlink(missing_ok=True)
    store = SqliteCheckpointer(SQLITE_FIXTURE)
    await record(store)
    await store.close()
    with contextlib.closing(__import__("sqlite3").connect(SQLITE_FIXTURE)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        db.execute("PRAGMA journal_mode=DELETE")
    if pg_dsn is not None:
        await _write_postgres(pg_dsn)


async def _write_postgres(dsn: str) -> None:
    import psycopg

    from asiento.journal.postgres import PostgresCheckpointer

    store = await PostgresCheckpointer.connect(dsn)
    try:
        await record(store)
    finally:
        await store.close()
    with psycopg.connect(dsn) as conn:
        for table, path in POSTGRES_FIXTURES.items():
            query = (
                f"SELECT {POSTGRES_COLUMNS[table]} FROM {table} ORDER BY {POSTGRES_ORDER[table]}"
            )
            with conn.cursor().copy(f"COPY ({query}) TO STDOUT") as copy, path.open("wb") as out:
                for data in copy:
                    out.write(bytes(data))


if __name__ == "__main__":
    asyncio.run(_write_fixtures(sys.argv[1] if len(sys.argv) > 1 else None))
