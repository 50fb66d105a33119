"""The run index: its counts, the queue of submitted runs (claims, parking), its statuses."""

from __future__ import annotations

import asyncio

import pytest

from asiento import (
    Agent,
    ApprovalStep,
    Checkpointer,
    Claim,
    Decision,
    DuplicateRecord,
    FinalStep,
    LeaseLost,
    ModelResponse,
    Phase,
    RunClosed,
    RunInfo,
    RunStatus,
    Session,
    Step,
    ToolCall,
    UsageError,
    approve,
    require_approval_for,
    tool,
)
from asiento.testing import ScriptedGateway

from ._build import ev, holder, info_of


async def closed_run(store: Checkpointer) -> None:
    """A run closed while a step waited for a person's approval."""
    await store.append(ev("m1.t1", Phase.INTENT, decision=Decision.REQUIRE_APPROVAL))
    await store.append(ev("final", step="m1", text="abandoned"), status=RunStatus.CLOSED)


class IndexTests:
    """What runs() and run() say of each run, submit and claim, set_status."""

    # -- what the run index counts: calls, tokens, steps -----------------------------------

    async def test_ledger_counts_paid_model_calls(self, store: Checkpointer) -> None:
        """Appended model results add their calls and tokens to the run's ledger."""
        usage = {"usage": [100, 7]}
        await store.append(ev("m1", response=usage), ev("m1.t1", Phase.INTENT))
        await store.append(ev("m2", response={"usage": [50, 3]}))
        info = await info_of(store)
        assert (info.model_calls, info.input_tokens, info.output_tokens) == (2, 150, 10)

    async def test_run_index_counts_the_steps_of_an_agent_run(self, store: Checkpointer) -> None:
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
            ModelResponse(
                tool_calls=[*calls, ToolCall(name="pay", arguments={"amount": 9}, id="p")]
            ),
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

    async def test_tool_steps_count_intents_not_attempts(self, store: Checkpointer) -> None:
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

    async def test_the_budget_follows_its_records(self, store: Checkpointer) -> None:
        """The budget columns are what the records say (``budget.after``): the limits a
        model result or a stop records, each raise after them above the limit (an unset
        limit stays unset), in one append or several; other records change nothing."""
        limits = {"max_cost": 1.5, "max_tokens": None, "max_model_calls": 3}
        lease = await store.acquire("run-1", holder("w1"), ttl=30)
        model = ev("m1", fp="f", response={"text": "", "usage": [1, 1]}, budget=limits)
        await store.append(model, lease=lease)
        assert _budget(await info_of(store)) == (1.5, None, 3)
        await store.append(ev("m2", fp="g", response={"text": ""}), lease=lease)
        assert _budget(await info_of(store)) == (1.5, None, 3)
        stop = ev("budget1", Phase.INTENT, limit="max_model_calls", spent={}, before="m3",
                  budget=dict(limits, max_model_calls=2))  # fmt: skip
        await store.append(stop, lease=lease)
        assert _budget(await info_of(store)) == (1.5, None, 2)
        await store.release(lease)
        raised = ev("budget1", Phase.APPROVAL, limits={"max_model_calls": 5, "max_tokens": 9},
                    by="ana", reason="")  # fmt: skip
        await store.append(raised)
        assert _budget(await info_of(store)) == (1.5, None, 5)
        lower = ev("budget2", Phase.INTENT, limit="max_cost", spent={}, before="m9",
                   budget=dict(limits, max_model_calls=5))  # fmt: skip
        lowered = ev("budget2", Phase.APPROVAL, limits={"max_cost": 1.0}, by="ana", reason="")
        await store.append(lower, lowered)  # a raise never lowers a limit
        assert _budget(await info_of(store)) == (1.5, None, 5)

    async def test_refused_batches_add_no_steps(self, store: Checkpointer) -> None:
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

    # -- submitted runs: claims and parking ------------------------------------------------

    async def test_submit_then_claim_returns_task_agent_and_lease(
        self, store: Checkpointer
    ) -> None:
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

    async def test_live_claim_is_not_claimed_again(self, store: Checkpointer) -> None:
        """While a claim's lease is live, another claim (by anyone) finds nothing."""
        await store.submit("job-1", "t")
        assert await store.claim(holder("w1"), ttl=30) is not None
        assert await store.claim(holder("w2"), ttl=30) is None
        assert await store.claim(holder("w1"), ttl=30) is None
        assert (await info_of(store, "job-1")).attempts == 1

    async def test_expired_claim_is_claimed_again_without_counting_against_the_run(
        self, store: Checkpointer
    ) -> None:
        """A claim that lapsed with no tool in flight is given back: attempts stay, token + 1,
        the old lease fenced, one lapse noted."""
        await store.submit("job-1", "t")
        first = await store.claim(holder("w1"), ttl=0.05)
        assert first is not None
        await asyncio.sleep(0.2)
        second = await store.claim(holder("w2"), ttl=30)
        assert second is not None
        assert (second.attempts, second.lease.token) == (1, first.lease.token + 1)
        assert second.in_flight is None
        with pytest.raises(LeaseLost):
            await store.append(ev("m1", run_id="job-1"), lease=first.lease)
        await store.append(ev("m1", run_id="job-1"), lease=second.lease)
        info = await info_of(store, "job-1")
        assert (info.lease_owner, info.attempts, info.lapses) == ("w2", 1, 1)

    async def test_claim_that_lapsed_with_a_tool_in_flight_counts_against_the_run(
        self, store: Checkpointer
    ) -> None:
        """A claim that lapsed while a tool step was submitted without an outcome counts: the
        next claim is attempt 2 and names the step, and the reason says so."""
        first = await _lapsed_in_tool(store, "m1.t1")
        second = await store.claim(holder("w2"), ttl=30)
        assert second is not None
        assert (second.attempts, second.in_flight) == (2, "m1.t1")
        assert first.lease.token + 1 == second.lease.token
        info = await info_of(store, "job-1")
        assert (info.attempts, info.lapses) == (2, 0)
        assert info.reason == "its worker died while its tool step m1.t1 was in flight"

    async def test_only_a_tool_steps_last_attempt_can_be_in_flight(
        self, store: Checkpointer
    ) -> None:
        """A tool step whose later attempt has its result, a step resolved by a person and a
        streamed model attempt's marker are not in flight: the lapse does not count."""
        await store.submit("job-1", "t")
        claim = await store.claim(holder("w1"), ttl=0.05)
        assert claim is not None
        records = [
            ev("m1", run_id="job-1"),
            ev("m1.t1", Phase.INTENT, run_id="job-1"),
            ev("m1.t1", Phase.SUBMITTED, run_id="job-1"),
            ev("m1.t1/2", Phase.SUBMITTED, run_id="job-1"),
            ev("m1.t1/2", Phase.RESULT, run_id="job-1"),
            ev("m1.t2", Phase.INTENT, run_id="job-1"),
            ev("m1.t2", Phase.SUBMITTED, run_id="job-1"),
            ev("m1.t2", Phase.RESOLUTION, run_id="job-1"),
            ev("m2/1", Phase.SUBMITTED, run_id="job-1"),
        ]
        await store.append(*records, lease=claim.lease)
        await asyncio.sleep(0.2)
        again = await store.claim(holder("w2"), ttl=30)
        assert again is not None
        assert (again.attempts, again.in_flight) == (1, None)

    async def test_run_whose_workers_died_in_its_tool_is_parked_saying_so(
        self, store: Checkpointer
    ) -> None:
        """Claims that lapsed while the run's tool was in flight park it, naming the step."""
        await _lapsed_in_tool(store, "m1.t1", max_attempts=1)
        assert await store.claim(holder("w2"), ttl=30, max_attempts=1) is None
        info = await info_of(store, "job-1")
        assert info.status is RunStatus.PARKED
        assert info.reason == (
            "parked after 1 claims without reaching a stable state; last failure: its worker"
            " died while its tool step m1.t1 was in flight"
        )

    async def test_lapses_in_a_row_with_no_new_record_park_the_run(
        self, store: Checkpointer
    ) -> None:
        """Lapses with no tool in flight park the run at max_lapses only when it wrote nothing
        in between: a record written during a claim starts the count at one again."""
        await store.submit("job-1", "t")
        limits = {"max_attempts": 5, "max_lapses": 3}
        for lapses, writes in ((0, False), (1, True), (1, False), (2, False)):
            claim = await store.claim(holder("w1"), ttl=0.05, **limits)
            assert claim is not None
            assert (claim.attempts, (await info_of(store, "job-1")).lapses) == (1, lapses)
            if writes:
                await store.append(ev("m1", run_id="job-1"), lease=claim.lease)
            await asyncio.sleep(0.2)
        assert await store.claim(holder("w1"), ttl=30, **limits) is None
        info = await info_of(store, "job-1")
        assert (info.status, info.attempts, info.lapses) == (RunStatus.PARKED, 0, 3)
        assert info.reason is not None
        assert info.reason.startswith("parked: its worker died 3 times in a row while none")

    async def test_claim_skips_runs_nobody_submitted(self, store: Checkpointer) -> None:
        """Runs a Session or the harness created (no task) are never claimed by workers."""
        lease = await store.acquire("solo", holder("s"), ttl=30)
        await store.append(ev("m1", run_id="solo"), lease=lease)
        await store.release(lease)
        await store.append(ev("m1", run_id="harness"))
        assert await store.claim(holder("w1"), ttl=30) is None

    async def test_suspended_run_is_claimable_again_once_approved(
        self, store: Checkpointer
    ) -> None:
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

    async def test_run_claimed_max_attempts_times_is_parked(self, store: Checkpointer) -> None:
        """Claimed max_attempts times without a stable state: parked with the reason, unclaimed."""
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

    async def test_claim_that_parks_a_run_claims_the_next(self, store: Checkpointer) -> None:
        """A claim that parks an exhausted run goes on to claim the next run needing work."""
        await store.submit("job-1", "t1")
        first = await store.claim(holder("w1"), ttl=30, max_attempts=1)
        assert first is not None
        assert first.lease.run_id == "job-1"
        await store.release(first.lease)  # back in the queue, ahead of job-2
        await store.submit("job-2", "t2")
        second = await store.claim(holder("w1"), ttl=30, max_attempts=1)
        assert second is not None
        assert second.lease.run_id == "job-2"
        assert (await info_of(store, "job-1")).status is RunStatus.PARKED

    async def test_submit_of_an_existing_run_id_is_a_usage_error(self, store: Checkpointer) -> None:
        """submit() refuses a run id already submitted or in the journal; nothing changes."""
        await store.submit("job-1", "first")
        with pytest.raises(UsageError, match="job-1"):
            await store.submit("job-1", "second")
        await store.append(ev("m1", run_id="solo"))
        with pytest.raises(UsageError, match="solo"):
            await store.submit("solo", "late")
        assert [(r.run_id, r.task) for r in await store.runs()] == [
            ("job-1", "first"),
            ("solo", None),
        ]

    async def test_set_status_records_and_keeps_the_reason(self, store: Checkpointer) -> None:
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

    # -- the index follows the journal: a person's decision, a closed run ------------------

    async def test_waiting_status_is_set_only_while_the_awaited_record_is_missing(
        self,
        store: Checkpointer,
    ) -> None:
        """set_status(waits_for=...) marks the run waiting, unless the record is there already."""
        lease = await store.acquire("run-1", holder("a"), ttl=30)
        await store.append(
            ev("m1.t1", Phase.INTENT, decision=Decision.REQUIRE_APPROVAL), lease=lease
        )
        waits = ("m1.t1", Phase.APPROVAL)
        assert await store.set_status("run-1", RunStatus.SUSPENDED, lease=lease, waits_for=waits)
        assert (await info_of(store)).status is RunStatus.SUSPENDED
        await store.append(ev("m1.t1", Phase.APPROVAL), status=RunStatus.RUNNING)  # a person
        # A pass that read the journal before the approval must not write its older view.
        assert not await store.set_status(
            "run-1", RunStatus.SUSPENDED, lease=lease, waits_for=waits
        )
        assert (await info_of(store)).status is RunStatus.RUNNING

    async def test_waiting_status_is_fenced_by_the_lease(self, store: Checkpointer) -> None:
        """A loop's status write with a lease that was taken over changes nothing."""
        stale = await store.acquire("run-1", holder("a"), ttl=30)
        await store.append(ev("m1.t1", Phase.SUBMITTED), lease=stale)
        await store.acquire("run-1", holder("b"), ttl=30, force=True)
        with pytest.raises(LeaseLost):
            await store.set_status(
                "run-1", RunStatus.UNCERTAIN, lease=stale, waits_for=("m1.t1", Phase.RESOLUTION)
            )
        assert (await info_of(store)).status is RunStatus.RUNNING

    async def test_a_stable_status_starts_the_claim_count_anew(self, store: Checkpointer) -> None:
        """set_status() to suspended or uncertain ends the run's count of claims, as append does."""
        await store.submit("run-1", "task")
        claim = await store.claim(holder("w"), ttl=30)
        assert claim is not None
        assert (await info_of(store)).attempts == 1
        await store.set_status("run-1", RunStatus.UNCERTAIN, lease=claim.lease)
        assert (await info_of(store)).attempts == 0

    async def test_a_closed_run_takes_no_decision(self, store: Checkpointer) -> None:
        """An append without a lease (a person's decision) on a closed run writes nothing."""
        await closed_run(store)
        before = await store.load("run-1")
        with pytest.raises(RunClosed, match=r"run-1.*closed"):
            await store.append(ev("m1.t1", Phase.APPROVAL), status=RunStatus.RUNNING)
        assert await store.load("run-1") == before
        info = await info_of(store)
        assert (info.status, info.events) == (RunStatus.CLOSED, len(before))

    @pytest.mark.parametrize("status", [s for s in RunStatus if s is not RunStatus.CLOSED])
    async def test_a_closed_run_takes_no_other_status(
        self, store: Checkpointer, status: RunStatus
    ) -> None:
        """set_status() never reopens a closed run; closed again is allowed (a reason, say)."""
        await closed_run(store)
        with pytest.raises(RunClosed):
            await store.set_status("run-1", status, reason="reopen")
        assert (await info_of(store)).status is RunStatus.CLOSED
        assert await store.set_status("run-1", RunStatus.CLOSED, reason="abandoned by ana")
        assert (await info_of(store)).reason == "abandoned by ana"

    async def test_a_closed_run_is_never_claimed(self, store: Checkpointer) -> None:
        """A submitted run that closed is not claimed, whatever its lease."""
        await store.submit("run-1", "task")
        await closed_run(store)
        assert await store.claim(holder("w"), ttl=30) is None

    async def test_run_looks_one_run_up_by_id(self, store: Checkpointer) -> None:
        """run() is the run's line in the index, as runs() lists it; None for an unknown run."""
        await store.append(ev("m1", run_id="a"))
        await store.submit("b", "task", agent="payer")
        assert await store.run("a") == await info_of(store, "a")
        found = await store.run("b")
        assert found is not None
        assert (found.task, found.agent, found.events) == ("task", "payer", 0)
        assert await store.run("nope") is None


def _budget(info: RunInfo) -> tuple[float | None, int | None, int | None]:
    return (info.budget_cost, info.budget_tokens, info.budget_model_calls)


async def _lapsed_in_tool(store: Checkpointer, step_id: str, max_attempts: int = 5) -> Claim:
    """Submit ``job-1``, claim it and let the claim lapse while tool ``step_id`` is in flight."""
    await store.submit("job-1", "t")
    claim = await store.claim(holder("w1"), ttl=0.05, max_attempts=max_attempts)
    assert claim is not None
    intent = ev(step_id, Phase.INTENT, run_id="job-1")
    submitted = ev(step_id, Phase.SUBMITTED, run_id="job-1")
    await store.append(ev("m1", run_id="job-1"), intent, submitted, lease=claim.lease)
    await asyncio.sleep(0.2)
    return claim
