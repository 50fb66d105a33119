"""The oracle's checks as pure functions: each flags its broken promise, and only that.

The journals and ledgers here are written by hand, in the shapes the harness
reads from real runs (the campaign tests feed it real ones).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asiento.testing._audit import parse, unsynced_renames
from asiento.testing.invariants import (
    Journal,
    Op,
    RaceRecord,
    RunHistory,
    ToolInfo,
    check_destination,
    check_index,
    check_integrity,
    check_race,
    check_run,
    uncertain_steps,
)

RUN = "r1"
TOOLS = {
    "lookup": ToolInfo(idempotent=True),
    "send": ToolInfo(idempotent=False),
    "bill": ToolInfo(idempotent=False, effect=True, has_lookup=True),
    "post": ToolInfo(idempotent=False, effect=True, honours_keys=True, key_ttl=10.0),
}
FP1, FP2 = "a" * 32, "b" * 32


def rec(payload: dict[str, Any] | None = None, at: float = 0.0) -> tuple[Any, ...]:
    return (None, payload or {}, at)


def journal(*, send_done: bool = True, closed: bool = True) -> dict[str, dict[str, Any]]:
    """m1 asks for lookup and send; m2 answers."""
    j: dict[str, dict[str, Any]] = {
        "m1": {"result": rec({"fp": FP1})},
        "m1.t1": {"intent": rec({"tool": "lookup"}), "submitted": rec(), "result": rec()},
        "m1.t2": {"intent": rec({"tool": "send"}), "submitted": rec()},
    }
    if send_done:
        j["m1.t2"]["result"] = rec({"status": "ok"})
    if closed:
        j["m2"] = {"result": rec({"fp": FP2})}
        j["final"] = {"result": rec({"step": "m2"})}
    return j


def send_done_later() -> dict[str, dict[str, Any]]:
    """The closed journal, send's result written by a pass that started at 100.0."""
    j = journal()
    j["m1.t2"]["result"] = rec({"status": "ok"}, at=200.0)
    return j


def call(step: str, tool: str, attempt: str | None = None) -> dict[str, Any]:
    return {"run": RUN, "step": step, "attempt": attempt or step, "tool": tool, "kind": "call"}


def key(step: str, fp: str) -> dict[str, Any]:
    return {"run": RUN, "key": f"{RUN}:{step}:{fp}"}


CLEAN_EFFECTS = [call("m1.t1", "lookup"), call("m1.t2", "send")]
CLEAN_MODELS = [key("m1", FP1), key("m2", FP2)]


def op(
    before: Journal,
    out: dict[str, Any] | None,
    *,
    at: tuple[int, int] = (0, 0),
    kind: str = "run",
    infra: bool = False,
    status: str | None = None,
) -> Op:
    return Op(kind, None, 0, out, before, status, at[0], at[1], 100.0, infra_fault=infra)


def history(ops: list[Op], **changes: Any) -> RunHistory:
    fields: dict[str, Any] = {
        "run_id": RUN,
        "ops": ops,
        "final": journal(),
        "final_status": "closed",
        "effects": CLEAN_EFFECTS,
        "models": CLEAN_MODELS,
    }
    return RunHistory(**(fields | changes))


CLOSED = {"outcome": "closed", "replayed": False}
ANSWERED = {"outcome": "closed", "replayed": True}


def clean_ops(effects: int = 2) -> list[Op]:
    """A pass that closed (writing ``effects`` ledger lines), then a pass only answered."""
    return [op({}, CLOSED), op(journal(), ANSWERED, at=(effects, 2), status="closed")]


def names(found: list[Any]) -> list[str]:
    return [v.invariant for v in found]


def test_a_clean_run_has_no_violation() -> None:
    """The positive control: one pass that closed, then a pass only answered."""
    assert check_run(history(clean_ops()), TOOLS) == []


def test_a_second_send_is_a_double_effect() -> None:
    """Two ledger lines for one non-idempotent step: effect_once."""
    found = check_run(history(clean_ops(), effects=[*CLEAN_EFFECTS, call("m1.t2", "send")]), TOOLS)
    assert "effect_once" in names(found)
    assert any("send applied 2 times for m1.t2" in v.message for v in found)


def test_an_idempotent_rerun_before_its_result_is_fine() -> None:
    """lookup may run twice when its result was never recorded; not once it was."""
    rerun = [call("m1.t1", "lookup"), *CLEAN_EFFECTS]
    assert check_run(history(clean_ops(3), effects=rerun), TOOLS) == []
    after = [*CLEAN_EFFECTS, call("m1.t1", "lookup")]
    found = check_run(history(clean_ops(), effects=after), TOOLS)
    assert any("lookup ran again for m1.t1, whose outcome was recorded" in v.message for v in found)


def test_a_recorded_answer_requested_again() -> None:
    """A model key whose answer the journal held is asked again: model_once."""
    found = check_run(history(clean_ops(), models=[*CLEAN_MODELS, key("m1", FP1)]), TOOLS)
    assert names(found) == ["model_once"]


def test_uncertain_if_and_only_if_an_unknown_step_nothing_settles() -> None:
    """Send submitted without result: the pass must stop uncertain, naming m1.t2."""
    open_send = journal(send_done=False, closed=False)
    assert uncertain_steps(open_send, TOOLS, 0.0) == {"m1.t2"}
    stopped = {"outcome": "uncertain", "step": "m1.t2"}
    ops = [op({}, None), op(open_send, stopped, at=(2, 1))]
    asked = [key("m1", FP1)]
    ok = history(ops, final=open_send, final_status="uncertain", models=asked)
    assert check_run(ok, TOOLS) == []
    written_by_the_pass = journal()
    written_by_the_pass["m1.t2"]["result"] = rec({"status": "ok"}, at=200.0)
    went_on = history([op({}, None), op(open_send, CLOSED, at=(2, 1))], final=written_by_the_pass)
    assert "uncertain_iff" in names(check_run(went_on, TOOLS))
    wrong = history([op({}, None), op(open_send, stopped | {"step": "m1.t1"}, at=(2, 1))])
    assert "uncertain_iff" in names(check_run(wrong, TOOLS))
    groundless = history([op(journal(), stopped, at=(2, 2))])
    assert "uncertain_iff" in names(check_run(groundless, TOOLS))


def test_a_killed_writers_commit_that_surfaced_late_is_allowed_for() -> None:
    """A record created before the pass started, missing from its snapshot after a killed
    op (SQLite recovered the killed writer's commit), justifies the pass's UncertainEffect;
    without a killed op before it, the same history is a violation."""
    open_send = journal(send_done=False, closed=False)
    unseen = {step: dict(phases) for step, phases in open_send.items()}
    del unseen["m1.t2"]["submitted"]
    stopped = {"outcome": "uncertain", "step": "m1.t2"}
    asked = [key("m1", FP1)]
    late = history(
        [op({}, None), op(unseen, stopped, at=(1, 1))],
        final=open_send,
        final_status="uncertain",
        effects=[call("m1.t1", "lookup")],
        models=asked,
    )
    assert check_run(late, TOOLS) == []
    no_killed_writer = history(
        [op({}, CLOSED), op(unseen, stopped, at=(1, 1))],
        final=open_send,
        final_status="uncertain",
        effects=[call("m1.t1", "lookup")],
        models=asked,
    )
    assert "uncertain_iff" in names(check_run(no_killed_writer, TOOLS))


def test_what_can_be_reconciled_is_not_uncertain() -> None:
    """An effect with a lookup, or a live key, is settled without a person; an old key is not."""
    j: dict[str, dict[str, Any]] = {
        "m1.t1": {"intent": rec({"tool": "bill"}), "submitted": rec(at=0.0)},
        "m1.t2": {"intent": rec({"tool": "post"}), "submitted": rec(at=0.0)},
    }
    assert uncertain_steps(j, TOOLS, now=5.0) == set()
    assert uncertain_steps(j, TOOLS, now=20.0) == {"m1.t2"}


def test_going_on_past_an_uncertain_step() -> None:
    """A pass that ran a tool while the journal said 'unknown' broke effect_once."""
    open_send = journal(send_done=False, closed=False)
    effects = [*CLEAN_EFFECTS, call("m1.t2", "send", "m1.t2/2")]
    passes = [op({}, None), op(open_send, CLOSED, at=(2, 1))]
    h = history(passes, effects=effects, final=send_done_later())
    assert any("went on past uncertain" in v.message for v in check_run(h, TOOLS))


def test_runs_must_end_and_the_index_must_say_how() -> None:
    """A run left running, or a pass whose status the index contradicts: run_ends."""
    assert "run_ends" in names(check_run(history(clean_ops(), final_status="running"), TOOLS))
    lying = [op({}, CLOSED), op(journal(), ANSWERED, at=(2, 2), status="suspended")]
    assert "run_ends" in names(check_run(history(lying), TOOLS))


def test_a_database_error_is_excused_only_under_a_database_fault() -> None:
    """JournalError ends a pass legitimately when the harness cut its connections."""
    error = {"outcome": "error", "type": "JournalError", "message": "connection lost"}
    ops = [op({}, error, infra=True), *clean_ops()]
    ops[1] = op({}, CLOSED)
    assert check_run(history(ops), TOOLS) == []
    ops[0] = op({}, error)
    assert names(check_run(history(ops), TOOLS)) == ["run_ends"]


def test_a_tool_recorded_done_that_never_ran() -> None:
    """A result for send with no ledger line: the outcome was made up."""
    found = check_run(history(clean_ops(), effects=[call("m1.t1", "lookup")]), TOOLS)
    assert any("m1.t2 recorded done, never ran" in v.message for v in found)


def test_submitted_without_intent_is_an_integrity_violation() -> None:
    """The write-ahead record of a step that was never intended."""
    broken = journal()
    broken["m1.t3"] = {"submitted": rec()}
    assert "integrity" in names(check_run(history(clean_ops(), final=broken), TOOLS))


def test_store_wide_checks() -> None:
    """Integrity check text, index counts and destination duplicates are reported."""
    assert check_integrity(["ok"]) == []
    assert names(check_integrity(["*** page 3: btree damaged"])) == ["integrity"]
    assert check_index({"r1": 5}, {"r1": 5}) == []
    assert names(check_index({"r1": 5}, {"r1": 4})) == ["integrity"]
    assert check_destination(["INV-1", "INV-2"]) == []
    assert names(check_destination(["INV-1", "INV-1"])) == ["effect_once"]


def test_race_check_attributes_writes_to_the_stale_holder() -> None:
    """Rows or ledger lines that appeared while only the stale holder ran are violations."""
    before = journal(send_done=False, closed=False)
    fair = RaceRecord(RUN, 1, 2, before, before, [], [], {"outcome": "lease_lost"})
    assert check_race(fair) == []
    wrote = RaceRecord(RUN, 1, 2, before, journal(), [call("m1.t2", "send")], [], None)
    found = check_race(wrote)
    assert {v.invariant for v in found} == {"stale_writes_nothing"}
    assert len(found) == 2
    no_takeover = RaceRecord(RUN, 2, 2, before, before, [], [], None)
    assert check_race(no_takeover)


TRACE = """\
101 fsync(7</w/runs.db-wal>) = 0
101 rename("/w/files/.a.tmp", "/w/files/a") = 0
101 fsync(9</w/files>) = 0
101 fdatasync(7</w/runs.db-wal>) = 0
101 renameat2(AT_FDCWD</w>, "files/.b.tmp", AT_FDCWD</w>, "files/b", RENAME_NOREPLACE) = 0
101 fdatasync(7</w/runs.db-wal>) = 0
"""


def test_fsync_audit_reads_the_order_of_system_calls() -> None:
    """A rename followed by its directory's fsync passes; one the journal overtakes fails."""
    calls = parse(TRACE)
    assert [c.kind for c in calls] == ["fsync", "rename", "fsync", "fsync", "rename", "fsync"]
    renames, found = unsynced_renames(calls, Path("/w/runs.db"))
    assert renames == 2
    assert found == ["/w/files/b renamed, journal committed before /w/files fsynced"]
