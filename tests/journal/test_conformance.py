"""One conformance suite that every journal backend must pass.

A new backend joins by adding one factory to ``FACTORIES``: it gets the test's
``request`` (for fixtures such as ``tmp_path`` or ``pg_dsn``) and returns a
store, or an awaitable of one. The PostgreSQL server is started only if a
postgres test runs.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

import asiento._clock
from asiento import (
    Agent,
    ApprovalStep,
    Checkpointer,
    Decision,
    DuplicateRecord,
    FinalStep,
    Holder,
    Lease,
    LeaseLost,
    MemoryCheckpointer,
    Phase,
    RunClosed,
    RunLocked,
    RunStatus,
    Savings,
    Session,
    SqliteCheckpointer,
    Step,
    StepEvent,
    ToolCall,
    UsageError,
    approve,
    require_approval_for,
    tool,
)
from asiento.journal.postgres import PostgresCheckpointer
from asiento.lease import hostname, process_start
from asiento.model import ModelResponse
from asiento.testing import ScriptedGateway

Factory = Callable[[pytest.FixtureRequest], "Checkpointer | Awaitable[Checkpointer]"]

FACTORIES: dict[str, Factory] = {
    "memory": lambda request: MemoryCheckpointer(),
    "sqlite": lambda request: SqliteCheckpointer(request.getfixturevalue("tmp_path") / "runs.db"),
    "postgres": lambda request: PostgresCheckpointer.connect(request.getfixturevalue("pg_dsn")),
}


@pytest.fixture(params=list(FACTORIES))
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Checkpointer]:
    """A fresh, empty journal of each backend."""
    made = FACTORIES[request.param](request)
    backend = await made if inspect.isawaitable(made) else made
    yield backend
    await backend.close()


def ev(
    step_id: str,
    phase: Phase = Phase.RESULT,
    *,
    run_id: str = "run-1",
    decision: Decision | None = None,
    **payload: Any,
) -> StepEvent:
    """A record with a small payload."""
    return StepEvent(
        run_id=run_id, step_id=step_id, phase=phase, decision=decision, payload=payload
    )


async def test_load_keeps_append_order(store: Checkpointer) -> None:
    """load() returns every record in the order of the appends, across batches."""
    batches = [
        [ev("m1", n=1)],
        [ev("m1.t1", Phase.INTENT, decision=Decision.ALLOW), ev("m1.t1", Phase.SUBMITTED)],
        [ev("m1.t1", n=2)],
        [ev("m2", n=3), ev("a-sorts-first", n=4)],
    ]
    for batch in batches:
        await store.append(*batch)
    assert await store.load("run-1") == [e for batch in batches for e in batch]


async def test_batch_with_duplicate_records_nothing(store: Checkpointer) -> None:
    """A batch whose third record is already taken records none of its records."""
    first = ev("s3", n=0)
    await store.append(first)
    batch = [ev("s1"), ev("s2"), ev("s3", n=1), ev("s4")]
    with pytest.raises(DuplicateRecord, match=r"run-1.*s3.*result") as info:
        await store.append(*batch, status=RunStatus.CLOSED)
    assert (info.value.run_id, info.value.step_id, info.value.phase) == ("run-1", "s3", "result")
    assert await store.load("run-1") == [first]
    [run] = await store.runs()
    assert (run.events, run.status) == (1, RunStatus.RUNNING)


async def test_duplicate_key_across_appends(store: Checkpointer) -> None:
    """The second append of the same (run, step, phase) raises DuplicateRecord."""
    await store.append(ev("m1.t1", Phase.INTENT, x=1))
    with pytest.raises(DuplicateRecord):
        await store.append(ev("m1.t1", Phase.INTENT, x=2))
    assert [e.payload for e in await store.load("run-1")] == [{"x": 1}]


async def test_same_step_other_phase_or_run_is_not_a_duplicate(store: Checkpointer) -> None:
    """Only the whole key (run, step, phase) is unique."""
    await store.append(ev("m1.t1", Phase.INTENT))
    await store.append(ev("m1.t1", Phase.RESULT))
    await store.append(ev("m1.t1", Phase.INTENT, run_id="run-2"))
    assert len(await store.load("run-1")) == 2


async def test_load_step_returns_one_step(store: Checkpointer) -> None:
    """load_step() returns the records of exactly that step, in order."""
    await store.append(ev("m1"), ev("m1.t1", Phase.INTENT), ev("m1.t1", Phase.SUBMITTED))
    await store.append(ev("m1.t1"), ev("m1.t10"))
    await store.append(ev("m1.t1", run_id="run-2"))
    steps = await store.load_step("run-1", "m1.t1")
    assert [(e.step_id, e.phase) for e in steps] == [
        ("m1.t1", Phase.INTENT),
        ("m1.t1", Phase.SUBMITTED),
        ("m1.t1", Phase.RESULT),
    ]
    assert await store.load_step("run-1", "nope") == []


async def test_final_is_none_until_the_final_record(store: Checkpointer) -> None:
    """final() is None for an open run and the closing record once it is written."""
    assert await store.final("run-1") is None
    await store.append(ev("m1", text="draft"))
    assert await store.final("run-1") is None
    closing = ev("final", step="m1", text="done")
    await store.append(closing, status=RunStatus.CLOSED)
    assert await store.final("run-1") == closing
    assert await store.final("run-2") is None


async def test_final_is_the_result_record(store: Checkpointer) -> None:
    """final() is the result record of step ``final``, whatever else that step holds."""
    await store.append(ev("final", Phase.INTENT, note="not the end"))
    assert await store.final("run-1") is None
    closing = ev("final", step="m1", text="done")
    await store.append(closing, status=RunStatus.CLOSED)
    assert await store.final("run-1") == closing


async def test_set_status_on_unknown_run(store: Checkpointer) -> None:
    """set_status() on a run the journal does not know is a UsageError."""
    with pytest.raises(UsageError, match="ghost"):
        await store.set_status("ghost", RunStatus.UNCERTAIN)
    assert await store.runs() == []


async def test_runs_lists_status_and_event_counts(store: Checkpointer) -> None:
    """runs() lists runs oldest first with their event counts, filtered by status."""
    await store.append(ev("m1", run_id="a"), ev("m1.t1", Phase.INTENT, run_id="a"))
    await store.append(ev("m1", run_id="b"), status=RunStatus.SUSPENDED)
    await store.append(ev("m1.t1", run_id="a"))
    await store.set_status("a", RunStatus.UNCERTAIN)
    listing = await store.runs()
    assert [(r.run_id, r.status, r.events) for r in listing] == [
        ("a", RunStatus.UNCERTAIN, 3),
        ("b", RunStatus.SUSPENDED, 1),
    ]
    assert listing[0].created_at <= listing[0].updated_at
    assert [r.run_id for r in await store.runs(status=RunStatus.SUSPENDED)] == ["b"]
    assert await store.runs(status=RunStatus.CLOSED) == []


async def test_append_without_status_keeps_status(store: Checkpointer) -> None:
    """An append with no status leaves the run's status as it was."""
    await store.append(ev("m1"), status=RunStatus.SUSPENDED)
    await store.append(ev("m2"))
    [run] = await store.runs()
    assert run.status is RunStatus.SUSPENDED


BAD_BATCHES: dict[str, list[StepEvent]] = {
    "empty": [],
    "mixed-runs": [ev("m1"), ev("m2", run_id="run-2")],
    "same-key-twice": [ev("m1", n=1), ev("m2"), ev("m1", n=2)],
    "nan": [ev("m1"), ev("m2", x=float("nan"))],
    "infinity": [ev("m1", x=[float("inf")])],
    "set": [ev("m1"), ev("m2", x={1, 2})],
    "bytes": [ev("m1", x=b"raw")],
}


@pytest.mark.parametrize("name", list(BAD_BATCHES))
async def test_invalid_batch_is_refused_whole(store: Checkpointer, name: str) -> None:
    """An invalid batch is a UsageError and records nothing at all."""
    with pytest.raises(UsageError):
        await store.append(*BAD_BATCHES[name])
    assert await store.load("run-1") == []
    assert await store.load("run-2") == []
    assert await store.runs() == []


async def test_append_refuses_what_is_not_a_step_event(store: Checkpointer) -> None:
    """append() takes StepEvent records only."""
    with pytest.raises(UsageError):
        await store.append(ev("m1"), {"run_id": "run-1"})  # type: ignore[arg-type]
    assert await store.runs() == []


ODD_IDS = [
    "ñandú-日本-🧾",
    'it\'s "quoted"',
    "100%_done",
    "a/b/c",
    "with spaces  and\ttabs",
    "x" * 512,
]


@pytest.mark.parametrize("odd", ODD_IDS)
async def test_odd_ids_round_trip(store: Checkpointer, odd: str) -> None:
    """Any text up to 512 characters works as run and step id, matched exactly."""
    mine = ev(odd, run_id=odd, n=1)
    await store.append(mine)
    await store.append(ev(odd, run_id=odd[:-1] + "_", n=2))
    await store.append(ev("final", run_id=odd, step=odd), status=RunStatus.CLOSED)
    assert (await store.load(odd))[0] == mine
    assert await store.load_step(odd, odd) == [mine]
    final = await store.final(odd)
    assert final is not None
    assert final.payload == {"step": odd}
    assert [r.run_id for r in await store.runs(status=RunStatus.CLOSED)] == [odd]


BAD_IDS = ["x" * 513, "nul\x00byte", "lone \ud800 surrogate", ""]


@pytest.mark.parametrize("bad", BAD_IDS, ids=["513-chars", "nul", "surrogate", "empty"])
@pytest.mark.parametrize("field", ["run_id", "step_id"])
async def test_bad_ids_are_refused(store: Checkpointer, bad: str, field: str) -> None:
    """Ids over 512 characters, with NUL, lone surrogates or empty are UsageErrors."""
    ids = {"run_id": "run-1", "step_id": "m1", field: bad}
    event = StepEvent(phase=Phase.RESULT, **ids)
    with pytest.raises(UsageError, match=field):
        await store.append(event)
    assert await store.runs() == []


@pytest.mark.parametrize("decision", [None, *Decision])
async def test_decision_round_trips(store: Checkpointer, decision: Decision | None) -> None:
    """Every decision, and no decision, reads back as written."""
    event = ev("m1.t1", Phase.INTENT, decision=decision, tool="t")
    await store.append(event)
    [loaded] = await store.load("run-1")
    assert loaded == event
    assert loaded.decision is decision


async def test_payload_round_trips(store: Checkpointer) -> None:
    """A nested JSON payload with unicode reads back equal, field by field."""
    payload = {
        "texto": 'ñandú ‘comillas’ "dobles" \\ 日本語 🧾',
        "nested": {"list": [1, -2, 2.5, None, True, False, "", []], "empty": {}},
        "big": 2**53,
        "ctrl": "line\nbreak\ttab\u2028",
    }
    event = StepEvent(run_id="run-1", step_id="m1", phase=Phase.RESULT, payload=payload)
    await store.append(event)
    [loaded] = await store.load("run-1")
    assert loaded == event
    assert loaded.payload == payload
    assert isinstance(loaded.phase, Phase)


# -- the age of a record: what judges an idempotency key ----------------------------------


async def test_age_counts_from_when_the_record_was_written(store: Checkpointer) -> None:
    """A record just written is as old as the time since; a record that is not there has none."""
    start = time.monotonic()
    await store.append(ev("m1.t1", Phase.SUBMITTED))
    age = await store.age("run-1", "m1.t1", Phase.SUBMITTED)
    elapsed = time.monotonic() - start
    assert age is not None
    assert 0.0 <= age <= elapsed + 0.05  # the 0.05 s: two clocks read, not a time limit
    assert await store.age("run-1", "m1.t1", Phase.RESULT) is None
    assert await store.age("run-1", "m1.t2", Phase.SUBMITTED) is None
    assert await store.age("run-2", "m1.t1", Phase.SUBMITTED) is None


async def test_age_is_judged_on_the_store_clock(
    store: Checkpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written by a process whose clock is an hour ahead, then read on a true clock: SQLite
    and memory judge on the local clock (the age reads negative), PostgreSQL on the server's
    (the writer's clock does not count)."""
    monkeypatch.setattr(asiento._clock, "skew", 3600.0)
    await store.append(ev("m1.t1", Phase.SUBMITTED))
    monkeypatch.setattr(asiento._clock, "skew", 0.0)
    age = await store.age("run-1", "m1.t1", Phase.SUBMITTED)
    assert age is not None
    if isinstance(store, PostgresCheckpointer):
        assert 0.0 <= age < 1800.0
    else:
        assert -3600.0 <= age < -1800.0


# -- leases --------------------------------------------------------------------------------


def holder(owner: str, *, host: str | None = None, pid: int | None = None) -> Holder:
    """A lease holder; by default a live one: this process, on this host."""
    pid = os.getpid() if pid is None else pid
    here = host is None
    return Holder(
        owner=owner,
        host=hostname() if here else str(host),
        pid=pid,
        started=process_start(pid) if here else "1",
    )


def dead_pid() -> tuple[int, str]:
    """The pid and start time of a process that has exited (and was reaped)."""
    child = subprocess.Popen(["sleep", "5"])
    started = process_start(child.pid)
    child.kill()
    child.wait(timeout=10)
    return child.pid, started


async def info_of(store: Checkpointer, run_id: str = "run-1") -> Any:
    """The listing entry of one run."""
    [info] = [r for r in await store.runs() if r.run_id == run_id]
    return info


async def test_acquire_creates_the_run_with_token_one(store: Checkpointer) -> None:
    """The first acquire of an unknown run creates its row and returns fencing token 1."""
    lease = await store.acquire("run-1", holder("a"), ttl=30)
    assert (lease.run_id, lease.token, lease.owner) == ("run-1", 1, "a")
    info = await info_of(store)
    assert (info.status, info.events, info.fence, info.lease_owner) == (
        RunStatus.RUNNING,
        0,
        1,
        "a",
    )
    assert info.lease_expires is not None
    assert info.lease_expires > time.time() + 20


async def test_live_holder_on_this_host_locks_the_run(store: Checkpointer) -> None:
    """Another owner of a live process on this host gets RunLocked naming the holder."""
    await store.acquire("run-1", holder("a"), ttl=30)
    with pytest.raises(RunLocked, match=rf"run-1.*pid {os.getpid()}"):
        await store.acquire("run-1", holder("other"), ttl=30)
    assert (await info_of(store)).lease_owner == "a"


async def test_same_owner_acquires_again_with_a_new_token(store: Checkpointer) -> None:
    """The same owner may take its own lease again; the token still grows."""
    first = await store.acquire("run-1", holder("a"), ttl=30)
    again = await store.acquire("run-1", holder("a"), ttl=30)
    assert again.token == first.token + 1


async def test_other_host_is_taken_over_only_after_expiry(store: Checkpointer) -> None:
    """A holder on another host locks the run until its lease expires, then token+1."""
    first = await store.acquire("run-1", holder("far", host="elsewhere", pid=1), ttl=0.5)
    with pytest.raises(RunLocked, match="elsewhere"):
        await store.acquire("run-1", holder("b"), ttl=30)
    deadline = time.monotonic() + 5
    while True:
        try:
            taken = await store.acquire("run-1", holder("b"), ttl=30)
            break
        except RunLocked:
            assert time.monotonic() < deadline, "the expired lease was never taken over"
            await asyncio.sleep(0.05)
    assert taken.token == first.token + 1
    assert (await info_of(store)).lease_owner == "b"


async def test_dead_holder_on_this_host_is_taken_over_at_once(store: Checkpointer) -> None:
    """A holder whose process is gone from this host is taken over before its expiry."""
    pid, started = dead_pid()
    gone = Holder(owner="gone", host=hostname(), pid=pid, started=started)
    first = await store.acquire("run-1", gone, ttl=300)
    taken = await store.acquire("run-1", holder("b"), ttl=30)
    assert taken.token == first.token + 1


async def test_dead_holder_recorded_without_its_pid_namespace_waits_for_expiry(
    store: Checkpointer,
) -> None:
    """A row written before namespaces were recorded ("host/boot") proves no death: RunLocked."""
    pid, started = dead_pid()
    old_host = hostname().rsplit("/pidns:", 1)[0]
    old = Holder(owner="old", host=old_host, pid=pid, started=started)
    await store.acquire("run-1", old, ttl=300)
    with pytest.raises(RunLocked, match=rf"pid {pid} on {old_host}"):
        await store.acquire("run-1", holder("b"), ttl=30)
    assert (await info_of(store)).lease_owner == "old"


async def test_stale_lease_appends_nothing(store: Checkpointer) -> None:
    """After a takeover, the old lease's append raises LeaseLost and writes nothing."""
    pid, started = dead_pid()
    gone = Holder(owner="old", host=hostname(), pid=pid, started=started)
    old = await store.acquire("run-1", gone, ttl=300)
    await store.append(ev("m1", n=1), lease=old)
    new = await store.acquire("run-1", holder("new"), ttl=30)
    before = await info_of(store)
    with pytest.raises(LeaseLost, match=rf"run-1.*token {old.token}"):
        await store.append(ev("m2", n=2), ev("m2.t1", Phase.INTENT), lease=old)
    assert [e.step_id for e in await store.load("run-1")] == ["m1"]
    after = await info_of(store)
    assert (after.events, after.fence, after.lease_owner) == (1, new.token, "new")
    assert after.lease_expires == before.lease_expires
    await store.append(ev("m2", n=3), lease=new)
    assert [e.payload for e in await store.load("run-1")] == [{"n": 1}, {"n": 3}]


async def test_expired_lease_appends_nothing(store: Checkpointer) -> None:
    """A lease past its expiry, even not taken over, cannot write."""
    lease = await store.acquire("run-1", holder("a"), ttl=0.05)
    await asyncio.sleep(0.2)
    with pytest.raises(LeaseLost):
        await store.append(ev("m1"), lease=lease)
    assert await store.load("run-1") == []
    assert (await info_of(store)).events == 0


async def test_renew_extends_a_current_lease(store: Checkpointer) -> None:
    """renew() moves the expiry forward; a stale lease cannot be renewed."""
    lease = await store.acquire("run-1", holder("a"), ttl=5)
    before = (await info_of(store)).lease_expires
    renewed = await store.renew(lease, ttl=60)
    after = (await info_of(store)).lease_expires
    assert before is not None
    assert after is not None
    assert after > before + 30
    assert renewed.token == lease.token
    stale = Lease(run_id="run-1", token=lease.token - 1, owner="a", expires=0)
    with pytest.raises(LeaseLost):
        await store.renew(stale, ttl=60)


async def test_release_frees_the_run_and_adds_savings(store: Checkpointer) -> None:
    """release() lets another holder in at once and adds what the pass saved."""
    lease = await store.acquire("run-1", holder("a"), ttl=300)
    await store.release(lease, savings=Savings(calls=2, input_tokens=30, output_tokens=4))
    info = await info_of(store)
    assert (info.lease_owner, info.lease_expires) == (None, None)
    second = await store.acquire("run-1", holder("b"), ttl=300)
    await store.release(second, savings=Savings(calls=1, input_tokens=5, output_tokens=1))
    await store.release(second, savings=Savings(calls=9, input_tokens=9, output_tokens=9))
    info = await info_of(store)
    saved = (info.replayed_calls, info.saved_input_tokens, info.saved_output_tokens)
    assert saved == (3, 35, 5)


async def test_append_with_the_lease_extends_it(store: Checkpointer) -> None:
    """An append under a valid lease pushes lease_expires forward by the lease's ttl."""
    lease = await store.acquire("run-1", holder("a"), ttl=2)
    before = (await info_of(store)).lease_expires
    await asyncio.sleep(0.1)
    await store.append(ev("m1"), lease=lease)
    after = (await info_of(store)).lease_expires
    assert before is not None
    assert after is not None
    assert before + 0.05 < after < time.time() + 2.5


async def test_append_without_a_lease_ignores_the_lease(store: Checkpointer) -> None:
    """The harness appends without a lease whoever holds the run, and changes no lease."""
    await store.acquire("run-1", holder("a"), ttl=300)
    held = await info_of(store)
    await store.append(ev("m1.t1", Phase.APPROVAL, decision=Decision.APPROVED))
    after = await info_of(store)
    assert (after.events, after.lease_owner, after.fence) == (1, "a", held.fence)
    assert after.lease_expires == held.lease_expires


async def test_ledger_counts_paid_model_calls(store: Checkpointer) -> None:
    """Appended model results add their calls and tokens to the run's ledger."""
    usage = {"usage": [100, 7]}
    await store.append(ev("m1", response=usage), ev("m1.t1", Phase.INTENT))
    await store.append(ev("m2", response={"usage": [50, 3]}))
    info = await info_of(store)
    assert (info.model_calls, info.input_tokens, info.output_tokens) == (2, 150, 10)


# -- steps in the run index -------------------------------------------------------------------


async def test_run_index_counts_the_steps_of_an_agent_run(store: Checkpointer) -> None:
    """2 model steps and 3 tool calls (one approved) are 5 steps; the approval, the
    submitted markers and the closing record are records, not steps."""
    paid: list[int] = []

    @tool(idempotent=True)
    def look(name: str) -> str:
        """Look a supplier up."""
        return f"{name}: ok"

    @tool
    def pay(amount: int) -> str:
        """Pay an amount."""
        paid.append(amount)
        return "tx-1"

    calls = [ToolCall(name="look", arguments={"name": n}, id=n) for n in ("acme", "zeta")]
    script = [
        ModelResponse(tool_calls=[*calls, ToolCall(name="pay", arguments={"amount": 9}, id="p")]),
        ModelResponse(text="paid"),
    ]
    agent = Agent(tools=[look, pay], policy=require_approval_for("pay"))

    async def one_pass() -> list[Step]:
        session = Session("run-1", ScriptedGateway(script), store)
        return [s async for s in agent.run("pay acme", session=session)]

    assert isinstance((await one_pass())[-1], ApprovalStep)
    info = await info_of(store)
    assert (info.steps, info.model_calls, info.tool_steps, info.events) == (4, 1, 3, 8)
    await approve(store, "run-1", "m1.t3", by="ana")
    assert isinstance((await one_pass())[-1], FinalStep)
    assert isinstance((await one_pass())[-1], FinalStep)  # closed: answered from the journal
    info = await info_of(store)
    assert (info.steps, info.model_calls, info.tool_steps, info.events) == (5, 2, 3, 13)
    assert (info.status, paid) == (RunStatus.CLOSED, [9])


async def test_tool_steps_count_intents_not_attempts(store: Checkpointer) -> None:
    """A tool step is one intent record: a retry (m1.t1/2), a denial's result, a model
    result without a response and the closing record add no step."""
    await store.append(
        ev("m1", response={"usage": [10, 2]}),
        ev("m1.t1", Phase.INTENT, decision=Decision.ALLOW),
        ev("m1.t1", Phase.SUBMITTED),
    )
    await store.append(ev("m1.t1", Phase.RESOLUTION, happened=False))
    await store.append(ev("m1.t1/2", Phase.SUBMITTED))
    await store.append(
        ev("m1.t1/2", status="ok"),
        ev("m1.t2", Phase.INTENT, decision=Decision.DENY),
        ev("m1.t2", status="denied"),
    )
    await store.append(ev("m2", note="no response"), ev("final", step="m2", text="done"))
    info = await info_of(store)
    assert (info.steps, info.model_calls, info.tool_steps, info.events) == (3, 1, 2, 10)
    await store.append(ev("m3", response={"usage": [1, 1]}), ev("m3.t1", Phase.INTENT))
    assert (await info_of(store)).steps == 5


async def test_refused_batches_add_no_steps(store: Checkpointer) -> None:
    """A batch refused whole (a duplicate record, a lost lease) adds no step to the index."""
    await store.append(ev("m1", response={"usage": [1, 1]}), ev("m1.t1", Phase.INTENT))
    with pytest.raises(DuplicateRecord):
        await store.append(ev("m1.t2", Phase.INTENT), ev("m1.t1", Phase.INTENT))
    stale = await store.acquire("run-1", holder("a"), ttl=300)
    await store.acquire("run-1", holder("a"), ttl=300)
    with pytest.raises(LeaseLost):
        await store.append(ev("m1.t3", Phase.INTENT), lease=stale)
    info = await info_of(store)
    assert (info.steps, info.tool_steps, info.events) == (2, 1, 2)


# -- submitted runs: claims and parking ------------------------------------------------------


async def test_submit_then_claim_returns_task_agent_and_lease(store: Checkpointer) -> None:
    """A submitted run is claimed with its task, its agent and a lease (token 1) that writes."""
    await store.submit("job-1", "bill customer 42", agent="billing")
    await store.submit("job-2", "plain")
    claim = await store.claim(holder("w1"), ttl=30)
    assert claim is not None
    assert (claim.task, claim.agent, claim.attempts) == ("bill customer 42", "billing", 1)
    assert (claim.lease.run_id, claim.lease.token, claim.lease.owner) == ("job-1", 1, "w1")
    info = await info_of(store, "job-1")
    assert (info.status, info.task, info.agent, info.attempts) == (
        RunStatus.RUNNING,
        "bill customer 42",
        "billing",
        1,
    )
    assert (info.lease_owner, info.fence) == ("w1", 1)
    await store.append(ev("m1", run_id="job-1"), lease=claim.lease)
    second = await store.claim(holder("w1"), ttl=30)
    assert second is not None
    assert (second.lease.run_id, second.agent) == ("job-2", "default")


async def test_live_claim_is_not_claimed_again(store: Checkpointer) -> None:
    """While a claim's lease is live, another claim (by anyone) finds nothing."""
    await store.submit("job-1", "t")
    assert await store.claim(holder("w1"), ttl=30) is not None
    assert await store.claim(holder("w2"), ttl=30) is None
    assert await store.claim(holder("w1"), ttl=30) is None
    assert (await info_of(store, "job-1")).attempts == 1


async def test_expired_claim_is_claimed_again_with_one_more_attempt(store: Checkpointer) -> None:
    """An expired claim is claimed again: attempts + 1, token + 1, and the old lease is fenced."""
    await store.submit("job-1", "t")
    first = await store.claim(holder("w1"), ttl=0.05)
    assert first is not None
    await asyncio.sleep(0.2)
    second = await store.claim(holder("w2"), ttl=30)
    assert second is not None
    assert (second.attempts, second.lease.token) == (2, first.lease.token + 1)
    with pytest.raises(LeaseLost):
        await store.append(ev("m1", run_id="job-1"), lease=first.lease)
    await store.append(ev("m1", run_id="job-1"), lease=second.lease)
    assert (await info_of(store, "job-1")).lease_owner == "w2"


async def test_claim_skips_runs_nobody_submitted(store: Checkpointer) -> None:
    """Runs a Session or the harness created (no task) are never claimed by workers."""
    lease = await store.acquire("solo", holder("s"), ttl=30)
    await store.append(ev("m1", run_id="solo"), lease=lease)
    await store.release(lease)
    await store.append(ev("m1", run_id="harness"))
    assert await store.claim(holder("w1"), ttl=30) is None


async def test_suspended_run_is_claimable_again_once_approved(store: Checkpointer) -> None:
    """A suspended run is not claimed; after approve() it is, its claims counted anew."""
    await store.submit("job-1", "t")
    claim = await store.claim(holder("w1"), ttl=30)
    assert claim is not None
    intent = ev("m1.t1", Phase.INTENT, run_id="job-1", decision=Decision.REQUIRE_APPROVAL)
    await store.append(
        ev("m1", run_id="job-1"), intent, status=RunStatus.SUSPENDED, lease=claim.lease
    )
    await store.release(claim.lease)
    assert await store.claim(holder("w1"), ttl=30) is None
    await approve(store, "job-1", "m1.t1", by="ana")
    again = await store.claim(holder("w2"), ttl=30)
    assert again is not None
    assert (again.lease.run_id, again.attempts, again.lease.token) == ("job-1", 1, 2)


async def test_run_claimed_max_attempts_times_is_parked(store: Checkpointer) -> None:
    """Claimed max_attempts times without a stable state: parked with the reason, never claimed."""
    await store.submit("job-1", "t")
    for attempt in (1, 2):
        claim = await store.claim(holder("w1"), ttl=30, max_attempts=2)
        assert claim is not None
        assert claim.attempts == attempt
        await store.set_status("job-1", RunStatus.RUNNING, reason=f"boom {attempt}")
        await store.release(claim.lease)
    assert await store.claim(holder("w1"), ttl=30, max_attempts=2) is None
    info = await info_of(store, "job-1")
    assert (info.status, info.attempts, info.fence) == (RunStatus.PARKED, 2, 2)
    assert info.reason == (
        "parked after 2 claims without reaching a stable state; last failure: boom 2"
    )
    assert await store.claim(holder("w1"), ttl=30, max_attempts=10) is None
    assert [r.run_id for r in await store.runs(status=RunStatus.PARKED)] == ["job-1"]


async def test_run_whose_workers_died_is_parked_saying_so(store: Checkpointer) -> None:
    """Claims that expired without a word park the run with a reason that says so."""
    await store.submit("job-1", "t")
    assert await store.claim(holder("w1"), ttl=0.05, max_attempts=1) is not None
    await asyncio.sleep(0.2)
    assert await store.claim(holder("w2"), ttl=30, max_attempts=1) is None
    info = await info_of(store, "job-1")
    assert info.status is RunStatus.PARKED
    assert info.reason == (
        "parked after 1 claims without reaching a stable state (its workers died without a word)"
    )


async def test_claim_that_parks_a_run_claims_the_next(store: Checkpointer) -> None:
    """A claim that parks an exhausted run goes on to claim the next run needing work."""
    await store.submit("job-1", "t1")
    await store.submit("job-2", "t2")
    first = await store.claim(holder("w1"), ttl=30, max_attempts=1)
    assert first is not None
    assert first.lease.run_id == "job-1"
    await store.release(first.lease)
    second = await store.claim(holder("w1"), ttl=30, max_attempts=1)
    assert second is not None
    assert second.lease.run_id == "job-2"
    assert (await info_of(store, "job-1")).status is RunStatus.PARKED


async def test_submit_of_an_existing_run_id_is_a_usage_error(store: Checkpointer) -> None:
    """submit() refuses a run id already submitted, or already in the journal; nothing changes."""
    await store.submit("job-1", "first")
    with pytest.raises(UsageError, match="job-1"):
        await store.submit("job-1", "second")
    await store.append(ev("m1", run_id="solo"))
    with pytest.raises(UsageError, match="solo"):
        await store.submit("solo", "late")
    assert [(r.run_id, r.task) for r in await store.runs()] == [("job-1", "first"), ("solo", None)]


async def test_set_status_records_and_keeps_the_reason(store: Checkpointer) -> None:
    """set_status(reason=...) shows in runs(); a later one without a reason keeps it."""
    await store.append(ev("m1"))
    await store.set_status("run-1", RunStatus.UNCERTAIN, reason="the mail server timed out")
    info = await info_of(store)
    assert (info.status, info.reason) == (RunStatus.UNCERTAIN, "the mail server timed out")
    await store.set_status("run-1", RunStatus.RUNNING)
    assert (await info_of(store)).reason == "the mail server timed out"
    await store.set_status("run-1", RunStatus.PARKED, reason="a person looks at it")
    info = await info_of(store)
    assert (info.status, info.reason) == (RunStatus.PARKED, "a person looks at it")


# -- the index follows the journal: a person's decision, a closed run -----------------------


async def test_waiting_status_is_set_only_while_the_awaited_record_is_missing(
    store: Checkpointer,
) -> None:
    """set_status(waits_for=...) marks the run waiting, unless the record is there already."""
    lease = await store.acquire("run-1", holder("a"), ttl=30)
    await store.append(ev("m1.t1", Phase.INTENT, decision=Decision.REQUIRE_APPROVAL), lease=lease)
    waits = ("m1.t1", Phase.APPROVAL)
    assert await store.set_status("run-1", RunStatus.SUSPENDED, lease=lease, waits_for=waits)
    assert (await info_of(store)).status is RunStatus.SUSPENDED
    await store.append(ev("m1.t1", Phase.APPROVAL), status=RunStatus.RUNNING)  # a person
    # A pass that read the journal before the approval must not write its older view.
    assert not await store.set_status("run-1", RunStatus.SUSPENDED, lease=lease, waits_for=waits)
    assert (await info_of(store)).status is RunStatus.RUNNING


async def test_waiting_status_is_fenced_by_the_lease(store: Checkpointer) -> None:
    """A loop's status write with a lease that was taken over changes nothing."""
    stale = await store.acquire("run-1", holder("a"), ttl=30)
    await store.append(ev("m1.t1", Phase.SUBMITTED), lease=stale)
    await store.acquire("run-1", holder("b"), ttl=30, force=True)
    with pytest.raises(LeaseLost):
        await store.set_status(
            "run-1", RunStatus.UNCERTAIN, lease=stale, waits_for=("m1.t1", Phase.RESOLUTION)
        )
    assert (await info_of(store)).status is RunStatus.RUNNING


async def test_a_stable_status_starts_the_claim_count_anew(store: Checkpointer) -> None:
    """set_status() to suspended or uncertain ends the run's count of claims, as append does."""
    await store.submit("run-1", "task")
    claim = await store.claim(holder("w"), ttl=30)
    assert claim is not None
    assert (await info_of(store)).attempts == 1
    await store.set_status("run-1", RunStatus.UNCERTAIN, lease=claim.lease)
    assert (await info_of(store)).attempts == 0


async def test_force_takes_a_live_lease(store: Checkpointer) -> None:
    """acquire(force=True) takes the lease from a live holder, whose appends are then refused."""
    live = await store.acquire("run-1", holder("a"), ttl=30)
    taken = await store.acquire("run-1", holder("b"), ttl=30, force=True)
    assert taken.token == live.token + 1
    with pytest.raises(LeaseLost):
        await store.append(ev("m1"), lease=live)
    assert await store.load("run-1") == []


async def closed_run(store: Checkpointer) -> None:
    await store.append(ev("m1.t1", Phase.INTENT, decision=Decision.REQUIRE_APPROVAL))
    await store.append(ev("final", step="m1", text="abandoned"), status=RunStatus.CLOSED)


async def test_a_closed_run_takes_no_decision(store: Checkpointer) -> None:
    """An append without a lease (a person's decision) on a closed run writes nothing."""
    await closed_run(store)
    before = await store.load("run-1")
    with pytest.raises(RunClosed, match=r"run-1.*closed"):
        await store.append(ev("m1.t1", Phase.APPROVAL), status=RunStatus.RUNNING)
    assert await store.load("run-1") == before
    info = await info_of(store)
    assert (info.status, info.events) == (RunStatus.CLOSED, len(before))


@pytest.mark.parametrize("status", [s for s in RunStatus if s is not RunStatus.CLOSED])
async def test_a_closed_run_takes_no_other_status(store: Checkpointer, status: RunStatus) -> None:
    """set_status() never reopens a closed run; closed again is allowed (a reason, say)."""
    await closed_run(store)
    with pytest.raises(RunClosed):
        await store.set_status("run-1", status, reason="reopen")
    assert (await info_of(store)).status is RunStatus.CLOSED
    assert await store.set_status("run-1", RunStatus.CLOSED, reason="abandoned by ana")
    assert (await info_of(store)).reason == "abandoned by ana"


async def test_a_closed_run_is_never_claimed(store: Checkpointer) -> None:
    """A submitted run that closed is not claimed, whatever its lease."""
    await store.submit("run-1", "task")
    await closed_run(store)
    assert await store.claim(holder("w"), ttl=30) is None


async def test_run_looks_one_run_up_by_id(store: Checkpointer) -> None:
    """run() is the run's line in the index, as runs() lists it; None for an unknown run."""
    await store.append(ev("m1", run_id="a"))
    await store.submit("b", "task", agent="payer")
    assert await store.run("a") == await info_of(store, "a")
    found = await store.run("b")
    assert found is not None
    assert (found.task, found.agent, found.events) == ("task", "payer", 0)
    assert await store.run("nope") is None
