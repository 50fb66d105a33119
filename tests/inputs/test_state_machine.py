"""A Hypothesis state machine over steps, approvals, crashes, reopenings and rival sessions.

Up to six runs share one SQLite journal. Each run's script is drawn by Hypothesis: turns of
calls to ``lookup`` (idempotent), ``send`` (not idempotent) and ``pay`` (not idempotent,
needs a person's approval), then a final answer. The rules drive passes (some crashed
in-process: a tool or the model raising a ``BaseException`` before or after its effect,
or the caller breaking out of the steps and closing them), approve or deny, resolve an
uncertain step with the truth, reopen the journal, and let a second session try to drive
a run the first one holds.

The model is a few dicts: what state each tool step must be in (new, awaiting, approved,
denied, done, unknown, retry), which model answers are recorded, the run's status, and
how many times each effect really happened. Passes are predicted from the model, then
compared with what happened and with the journal read back. A pass broken by the caller
is a crash at a point the model does not choose, so its effect on the journal is read
back and checked against the transitions a crash may make.

``ASIENTO_HYPOTHESIS=large`` runs 2,000 examples instead of the 100 that CI runs.
"""

from __future__ import annotations

import asyncio
import copy
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from asiento import (
    Agent,
    ApprovalError,
    ApprovalStep,
    Decision,
    FinalStep,
    ModelRequest,
    ModelResponse,
    ModelStep,
    Phase,
    RunLocked,
    RunStatus,
    Session,
    SqliteCheckpointer,
    StepEvent,
    ToolCall,
    ToolStep,
    UncertainEffect,
    UsageError,
    approve,
    deny,
    require_approval_for,
    resolve,
    tool,
)
from asiento.replay import step_state
from asiento.testing import ScriptedGateway

T = TypeVar("T")

MAX_RUNS = 6  # runs started per example; passes go to the open ones first
KINDS = ("lookup", "send", "pay")
# What a script's calls are drawn from: approvals are rarer, so runs also get to close.
DRAWN_KINDS = ("lookup", "send", "lookup", "send", "pay")
NOT_IDEMPOTENT = ("send", "pay")
CRASHES = ("tool_before", "tool_after", "model", "break")
SCRIPTS = st.lists(
    st.lists(st.sampled_from(DRAWN_KINDS), min_size=1, max_size=2), min_size=1, max_size=3
)
WHICH = st.integers(0, MAX_RUNS)  # MAX_RUNS: any run, whatever its state

settings.register_profile(
    "asiento-ci",
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "asiento-large",
    max_examples=2000,
    stateful_step_count=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE_NAME = os.environ.get("ASIENTO_HYPOTHESIS", "ci")
PROFILE = settings.get_profile(f"asiento-{PROFILE_NAME}")
# 2,000 examples take about 3 minutes on 2 cores: near the suite's per-test timeout.
pytestmark = [pytest.mark.timeout(3600)] if PROFILE_NAME == "large" else []


class Crash(BaseException):
    """Stands for the process dying: the loop must not catch it."""


@dataclass
class StepModel:
    """One tool step as the journal must show it, and whether its last attempt happened."""

    kind: str
    state: str = "new"  # new, awaiting, approved, denied, done, unknown, retry
    happened: bool = False


@dataclass
class RunModel:
    """What the journal of one run must hold, and what the world saw happen."""

    turns: list[list[str]]
    steps: dict[str, StepModel] = field(default_factory=dict)
    answered: set[str] = field(default_factory=set)
    status: RunStatus | None = None
    closed: bool = False
    effects: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        for t, kinds in enumerate(self.turns):
            for i, kind in enumerate(kinds):
                self.steps[f"m{t + 1}.t{i + 1}"] = StepModel(kind)

    def first(self, state: str) -> str | None:
        return next((ref for ref, s in self.steps.items() if s.state == state), None)


@dataclass(frozen=True)
class Plan:
    """Where the pass crashes: the k-th tool execution, model call, or yielded step."""

    kind: str = "none"
    k: int = 0


@dataclass
class Prediction:
    outcome: str  # closed, replayed, suspended, uncertain, crash
    step: str | None
    model: RunModel
    model_calls: list[str]


def predict(run: RunModel, plan: Plan) -> Prediction:
    """Walk the script as the loop must, on a copy of the model."""
    m, calls = copy.deepcopy(run), list[str]()
    if m.closed:
        return Prediction("replayed", None, m, calls)
    execs = 0
    for t in range(len(m.turns) + 1):
        step = f"m{t + 1}"
        if step not in m.answered:
            if plan.kind == "model" and len(calls) == plan.k:
                return _crashed(m, calls)
            calls.append(step)
            m.answered.add(step)
        if t == len(m.turns):
            m.closed, m.status = True, RunStatus.CLOSED
            return Prediction("closed", None, m, calls)
        for i in range(len(m.turns[t])):
            ref = f"{step}.t{i + 1}"
            outcome, execs = _tool_step(m, ref, plan, execs)
            if outcome is not None:
                outcome.model_calls = calls
                return outcome
    raise AssertionError("unreachable")


def _tool_step(m: RunModel, ref: str, plan: Plan, execs: int) -> tuple[Prediction | None, int]:
    s = m.steps[ref]
    if s.state in ("done", "denied"):
        return None, execs
    if s.state == "awaiting" or (s.state == "new" and s.kind == "pay"):
        s.state, m.status = "awaiting", RunStatus.SUSPENDED
        return Prediction("suspended", ref, m, []), execs
    if s.state == "unknown" and s.kind in NOT_IDEMPOTENT:
        m.status = RunStatus.UNCERTAIN
        return Prediction("uncertain", ref, m, []), execs
    if plan.kind == "tool_before" and execs == plan.k:
        s.state, s.happened = "unknown", False
        return _crashed(m, []), execs
    m.effects[ref] += 1
    if plan.kind == "tool_after" and execs == plan.k:
        s.state, s.happened = "unknown", True
        return _crashed(m, []), execs
    s.state = "done"
    return None, execs + 1


def _crashed(m: RunModel, calls: list[str]) -> Prediction:
    m.status = RunStatus.RUNNING
    return Prediction("crash", None, m, calls)


async def cancel_leftovers() -> None:
    """Cancel the tasks a failed example left running (a session's lease keeper)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def movable(model: RunModel) -> bool:
    """A pass on this run would do something new (not replay, wait or stop at once)."""
    waiting = model.first("awaiting") is not None
    return not (model.closed or waiting or model.status == RunStatus.UNCERTAIN)


def derive(journal: dict[str, dict[Phase, StepEvent]], ref: str) -> str:
    """A tool step's state read back from the journal, in the model's words."""
    records = step_state(journal, ref).records
    if Phase.RESULT in records:
        return "denied" if records[Phase.RESULT].payload["status"] == "denied" else "done"
    if Phase.RESOLUTION in records:
        return "done" if records[Phase.RESOLUTION].payload["happened"] else "retry"
    if Phase.SUBMITTED in records:
        return "unknown"
    intent, approval = records.get(Phase.INTENT), records.get(Phase.APPROVAL)
    if intent is None:
        return "new"
    if intent.decision != Decision.REQUIRE_APPROVAL:
        return "intent-without-submitted"
    if approval is None:
        return "awaiting"
    return "approved" if approval.decision == Decision.APPROVED else "denied"


# What a crash at an unknown point may do to a step: stay, or move along these edges. A
# caller that stops at a yielded step while a tool is ready and not yet started leaves a
# "did not start" resolution: the step moves to retry, as a person's "did not happen".
CRASH_MOVES = {
    "new": {"done", "unknown", "awaiting", "retry"},
    "approved": {"done", "unknown", "retry"},
    "retry": {"done", "unknown"},
    "unknown": {"done", "retry"},  # an idempotent step runs again
    "awaiting": set(),
    "denied": set(),
    "done": set(),
}


def index(events: list[StepEvent]) -> dict[str, dict[Phase, StepEvent]]:
    journal: dict[str, dict[Phase, StepEvent]] = {}
    for record in events:
        journal.setdefault(record.step_id, {})[record.phase] = record
    return journal


class JournalMachine(RuleBasedStateMachine):
    """Two runs on one journal, driven by passes, people, crashes and rival sessions."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="asiento-machine-"))
        self.db = self.dir / "runs.db"
        self.loop = asyncio.new_event_loop()
        self.store = SqliteCheckpointer(self.db, durability="process")
        self.runs: dict[str, RunModel] = {}
        self.world: Counter[tuple[str, str]] = Counter()  # (run, step) -> executions
        self.asked: list[tuple[str, str]] = []  # (run, model step), one per paid call
        self.plan, self.execs = Plan(), 0
        self.agent = self._agent()

    # -- the world: tools and a scripted model that count what really happens ----------------

    def _agent(self) -> Agent:
        def make(kind: str) -> Any:
            def body(ref: str) -> str:
                if self.plan.kind == "tool_before" and self.execs == self.plan.k:
                    raise Crash(ref)
                run, step = ref.split("|")
                self.world[(run, step)] += 1
                if self.plan.kind == "tool_after" and self.execs == self.plan.k:
                    raise Crash(ref)
                self.execs += 1
                return f"{kind} {ref}"

            body.__doc__ = f"The {kind} tool."
            return tool(idempotent=kind == "lookup", name=kind)(body)

        tools = [make(kind) for kind in KINDS]
        return Agent(instructions="machine", tools=tools, policy=require_approval_for("pay"))

    def _gateway(self, run: str, recorded: set[str], paid: list[str]) -> ScriptedGateway:
        turns = self.runs[run].turns

        def answer(request: ModelRequest) -> ModelResponse:
            t = sum(1 for m in request.messages if m.role == "assistant")
            step = f"m{t + 1}"
            assert step not in recorded, f"{run}: recorded answer {step} asked again"
            if self.plan.kind == "model" and len(paid) == self.plan.k:
                self.asked.append((run, step))
                raise Crash(step)
            paid.append(step)
            self.asked.append((run, step))
            if t == len(turns):
                return ModelResponse(text=f"{run} done")
            calls = [
                ToolCall(name=kind, arguments={"ref": f"{run}|{step}.t{i + 1}"})
                for i, kind in enumerate(turns[t])
            ]
            return ModelResponse(tool_calls=calls)

        return ScriptedGateway(answer)

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    # -- rules --------------------------------------------------------------------------

    @initialize(script=SCRIPTS)
    def first_run(self, script: list[list[str]]) -> None:
        self.runs["r0"] = RunModel(script)

    @precondition(lambda self: len(self.runs) < MAX_RUNS)
    @rule(script=SCRIPTS)
    def start(self, script: list[list[str]]) -> None:
        """Another run on the same journal, with a script of its own."""
        self.runs[f"r{len(self.runs)}"] = RunModel(script)

    def _pick(self, which: int, fits: Callable[[RunModel], bool]) -> str:
        """A run where the rule can do something, mostly; any run when ``which`` says so."""
        pool = [run for run, model in self.runs.items() if fits(model)]
        if not pool or which >= MAX_RUNS:
            pool = list(self.runs)
        return pool[which % len(pool)]

    @rule(
        which=WHICH,
        plan=st.one_of(
            st.just(Plan()),
            st.builds(Plan, kind=st.sampled_from(CRASHES), k=st.integers(0, 2)),
        ),
    )
    def drive(self, which: int, plan: Plan) -> None:
        """One pass of a run, crashed as ``plan`` says."""
        self._sync(self._drive(self._pick(which, movable), plan))

    async def _drive(self, run: str, plan: Plan) -> None:
        model = self.runs[run]
        expected = predict(model, plan)
        before = Counter({s: n for (r, s), n in self.world.items() if r == run})
        paid: list[str] = []
        self.plan, self.execs = plan, 0
        session = Session(run, self._gateway(run, set(model.answered), paid), self.store)
        gen = self.agent.run(f"task of {run}", session=session)
        steps: list[Any] = []
        outcome, step = "?", None
        try:
            async for s in gen:
                steps.append(s)
                if plan.kind == "break" and len(steps) == plan.k + 1:
                    outcome = "break"
                    break
        except UncertainEffect as exc:
            outcome, step = "uncertain", exc.step_id.split("/")[0]
        except Crash:
            outcome = "crash"
        finally:
            await gen.aclose()  # type: ignore[attr-defined]
            self.plan = Plan()
        if outcome == "break":
            event("pass: break")
            await self._after_break(run, steps, before)
            return
        if outcome == "?":
            outcome, step = self._ending(steps)
        event(f"pass: {outcome}")
        assert (outcome, step) == (expected.outcome, expected.step), (steps, expected)
        assert paid == expected.model_calls
        if outcome == "replayed":
            last = f"m{len(model.turns) + 1}"
            assert steps == [FinalStep(run_id=run, step_id=last, text=f"{run} done", replayed=True)]
            assert Counter({s: n for (r, s), n in self.world.items() if r == run}) == before
        self.runs[run] = expected.model

    def _ending(self, steps: list[Any]) -> tuple[str, str | None]:
        last = steps[-1]
        if isinstance(last, FinalStep):
            return ("replayed" if last.replayed else "closed"), None
        assert isinstance(last, ApprovalStep), last
        return "suspended", last.step_id

    async def _after_break(self, run: str, steps: list[Any], before: Counter[str]) -> None:
        """The caller stopped at a step: everything yielded is durable; the rest is a crash."""
        journal = index(await self.store.load(run))
        for s in steps:
            self._check_durable(journal, s)
        model = self.runs[run]
        for ref, tool_step in model.steps.items():
            now = derive(journal, ref)
            ran = self.world[(run, ref)] - before[ref]
            if now != tool_step.state:
                moves = CRASH_MOVES[tool_step.state]
                assert now in moves, f"{run} {ref}: {tool_step.state} -> {now}"
            if now != tool_step.state or ran:  # a new attempt: did its effect happen?
                tool_step.happened = ran > 0
            tool_step.state = now
            model.effects[ref] += ran
        model.answered = {sid for sid in journal if "." not in sid and sid != "final"}
        model.closed = "final" in journal
        model.status = self._status_of(model)

    def _check_durable(self, journal: dict[str, dict[Phase, StepEvent]], step: Any) -> None:
        if isinstance(step, ModelStep):
            assert Phase.RESULT in journal.get(step.step_id, {}), step
        elif isinstance(step, ToolStep) and step.status != "awaiting_approval":
            assert derive(journal, step.step_id) in ("done", "denied"), step
        elif isinstance(step, ApprovalStep):
            assert derive(journal, step.step_id) == "awaiting", step
        elif isinstance(step, FinalStep):
            assert "final" in journal, step

    def _status_of(self, model: RunModel) -> RunStatus:
        if model.closed:
            return RunStatus.CLOSED
        if model.first("awaiting") is not None:
            return RunStatus.SUSPENDED
        return RunStatus.RUNNING

    @rule(which=WHICH, approved=st.booleans(), shown=st.sampled_from(["fp", "none", "wrong"]))
    def decide(self, which: int, approved: bool, shown: str) -> None:
        """A person approves or denies the step a run waits on (or one that waits for nothing)."""
        self._sync(
            self._decide(self._pick(which, lambda m: bool(m.first("awaiting"))), approved, shown)
        )

    async def _decide(self, run: str, approved: bool, shown: str) -> None:
        model = self.runs[run]
        ref = model.first("awaiting")
        act = approve if approved else deny
        if ref is None:
            with pytest.raises(ApprovalError):
                await act(self.store, run, next(iter(model.steps)), by="machine")
            return
        [intent] = [e for e in await self.store.load_step(run, ref) if e.phase == Phase.INTENT]
        fp = {"fp": intent.payload["fp"], "none": None, "wrong": "0" * 32}[shown]
        if shown == "wrong":
            with pytest.raises(ApprovalError):
                await act(self.store, run, ref, by="machine", fingerprint=fp)
            return
        await act(self.store, run, ref, by="machine", fingerprint=fp)
        event(f"decided: approved={approved}")
        model.steps[ref].state = "approved" if approved else "denied"
        model.status = RunStatus.RUNNING

    @rule(which=WHICH)
    def settle(self, which: int) -> None:
        """A person resolves an unknown step with the truth (did its last attempt happen?)."""
        self._sync(self._settle(self._pick(which, lambda m: bool(m.first("unknown")))))

    async def _settle(self, run: str) -> None:
        model = self.runs[run]
        ref = model.first("unknown")
        if ref is None:
            with pytest.raises(
                UsageError, match=r"not uncertain|has no step|unknown run|is closed"
            ):
                await resolve(self.store, run, next(iter(model.steps)), happened=True)
            return
        s = model.steps[ref]
        result = f"{s.kind} {run}|{ref}" if s.happened else None
        await resolve(self.store, run, ref, happened=s.happened, by="machine", result=result)
        s.state = "done" if s.happened else "retry"
        model.status = RunStatus.RUNNING
        event(f"resolved: happened={s.happened}")

    @rule()
    def reopen(self) -> None:
        """A new store object on the same file, as a restarted process would open."""
        self._sync(self.store.close())
        self.store = SqliteCheckpointer(self.db, durability="process")

    @rule(which=WHICH)
    def rival(self, which: int) -> None:
        """While one session holds the run, a second one is refused with RunLocked."""
        self._sync(self._rival(self._pick(which, movable)))

    async def _rival(self, run: str) -> None:
        model = self.runs[run]
        expected = predict(model, Plan())
        if expected.outcome in ("replayed", "uncertain") or model.first("awaiting"):
            return  # nothing to contend for: the pass would only replay, stop or wait
        paid: list[str] = []
        session = Session(run, self._gateway(run, set(model.answered), paid), self.store)
        gen = self.agent.run(f"task of {run}", session=session)
        other = SqliteCheckpointer(self.db, durability="process")
        rival_paid: list[str] = []
        try:
            steps = [await anext(gen)]
            await self._contend(run, other, rival_paid)
            assert rival_paid == []
            steps += [s async for s in gen]
        finally:
            await gen.aclose()  # type: ignore[attr-defined]
            await other.close()
        assert self._ending(steps) == (expected.outcome, expected.step)
        assert paid == expected.model_calls
        self.runs[run] = expected.model

    async def _contend(self, run: str, other: SqliteCheckpointer, paid: list[str]) -> None:
        """The rival is refused, unless the holder already closed the run: then it replays."""
        closed = await other.final(run) is not None
        rival = Session(run, self._gateway(run, set(self.runs[run].answered), paid), other)
        steps = self.agent.run(f"task of {run}", session=rival)
        if closed:
            [final] = [s async for s in steps]
            assert isinstance(final, FinalStep)
            assert final.replayed
            event("rival: replayed the closed run")
            return
        with pytest.raises(RunLocked):
            async for _ in steps:
                pass
        event("rival: refused")

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def journal_matches_the_model(self) -> None:
        self._sync(self._check_journal())

    async def _check_journal(self) -> None:
        listed = {info.run_id: info.status for info in await self.store.runs()}
        for run, model in self.runs.items():
            journal = index(await self.store.load(run))
            states = {ref: derive(journal, ref) for ref in model.steps}
            assert states == {ref: s.state for ref, s in model.steps.items()}, run
            answered = {sid for sid in journal if "." not in sid and sid != "final"}
            assert answered == model.answered, run
            assert ("final" in journal) == model.closed, run
            assert listed.get(run) == model.status, run

    @invariant()
    def effects_match_the_model(self) -> None:
        for run, model in self.runs.items():
            for ref, s in model.steps.items():
                ran = self.world[(run, ref)]
                assert ran == model.effects[ref], f"{run} {ref} ran {ran} times"
                if s.kind in NOT_IDEMPOTENT:
                    assert ran <= 1, f"{run} {ref} ({s.kind}) ran {ran} times"

    def teardown(self) -> None:
        try:
            try:
                self._sync(self.store.close())
            finally:
                self._sync(cancel_leftovers())  # only a failed example leaves tasks behind
                self.loop.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


JournalMachine.TestCase.settings = PROFILE
TestJournalMachine = JournalMachine.TestCase


# -- found while building the machine ---------------------------------------------------------


def send_twice_script(run: str) -> list[ModelResponse]:
    calls = [ToolCall(name="send", arguments={"ref": f"{run}|m1.t{i}"}) for i in (1, 2)]
    return [ModelResponse(tool_calls=calls), ModelResponse(text="sent")]


@pytest.mark.parametrize("stop_after", ["ModelStep", "ToolStep"])
async def test_stopping_between_steps_never_drops_a_finished_tool(
    tmp_path: Path, stop_after: str
) -> None:
    """A caller that stops after a step leaves no finished tool unrecorded (no needless doubt).

    The model asks for two sends in one turn. The caller takes one step (the ModelStep,
    or the first ToolStep) and closes the generator, the way ``break`` does. A tool may
    have run before that step was handed over only if its result is recorded; the resumed
    run then closes without ``UncertainEffect`` and each send happened once.
    """
    ran: list[str] = []

    @tool
    def send(ref: str) -> str:
        """Send; not safe to repeat."""
        ran.append(ref)
        return f"sent {ref}"

    agent, db = Agent(tools=[send]), tmp_path / "runs.db"
    store = SqliteCheckpointer(db)
    gen = agent.run("t", session=Session("r", ScriptedGateway(send_twice_script("r")), store))
    async for step in gen:
        if type(step).__name__ == stop_after:
            break
    await gen.aclose()  # type: ignore[attr-defined]
    results = {e.step_id for e in await store.load("r") if e.phase == Phase.RESULT}
    for ref in ran:
        step_id = ref.split("|")[1]
        assert step_id in results, f"{step_id} ran, was not yet announced, and was not recorded"
    again = Session("r", ScriptedGateway(send_twice_script("r")), store)
    steps = [s async for s in agent.run("t", session=again)]
    await store.close()
    assert isinstance(steps[-1], FinalStep)
    assert sorted(ran) == ["r|m1.t1", "r|m1.t2"]
