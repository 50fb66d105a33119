"""The journal itself: records kept in order, refused whole, read back as written; ages."""

from __future__ import annotations

import time
from typing import ClassVar, Literal

import pytest

import asiento._clock
from asiento import (
    Checkpointer,
    Decision,
    DuplicateRecord,
    Phase,
    RunStatus,
    StepEvent,
    UsageError,
)

from ._build import ev

BAD_BATCHES: dict[str, list[StepEvent]] = {
    "empty": [],
    "mixed-runs": [ev("m1"), ev("m2", run_id="run-2")],
    "same-key-twice": [ev("m1", n=1), ev("m2"), ev("m1", n=2)],
    "nan": [ev("m1"), ev("m2", x=float("nan"))],
    "infinity": [ev("m1", x=[float("inf")])],
    "set": [ev("m1"), ev("m2", x={1, 2})],
    "bytes": [ev("m1", x=b"raw")],
}


ODD_IDS = [
    "ñandú-日本-🧾",
    'it\'s "quoted"',
    "100%_done",
    "a/b/c",
    "with spaces  and\ttabs",
    "x" * 512,
]


BAD_IDS = ["x" * 513, "nul\x00byte", "lone \ud800 surrogate", ""]


class JournalTests:
    """append, load, load_step, final, runs, set_status and age, on one fresh store each."""

    # Which clock judges a record's age: this process's ("local": SQLite, memory) or the
    # store's server's ("server": PostgreSQL).
    store_clock: ClassVar[Literal["local", "server"]] = "local"

    async def test_load_keeps_append_order(self, store: Checkpointer) -> None:
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

    async def test_batch_with_duplicate_records_nothing(self, store: Checkpointer) -> None:
        """A batch whose third record is already taken records none of its records."""
        first = ev("s3", n=0)
        await store.append(first)
        batch = [ev("s1"), ev("s2"), ev("s3", n=1), ev("s4")]
        with pytest.raises(DuplicateRecord, match=r"run-1.*s3.*result") as info:
            await store.append(*batch, status=RunStatus.CLOSED)
        assert (info.value.run_id, info.value.step_id, info.value.phase) == (
            "run-1",
            "s3",
            "result",
        )
        assert await store.load("run-1") == [first]
        [run] = await store.runs()
        assert (run.events, run.status) == (1, RunStatus.RUNNING)

    async def test_duplicate_key_across_appends(self, store: Checkpointer) -> None:
        """The second append of the same (run, step, phase) raises DuplicateRecord."""
        await store.append(ev("m1.t1", Phase.INTENT, x=1))
        with pytest.raises(DuplicateRecord):
            await store.append(ev("m1.t1", Phase.INTENT, x=2))
        assert [e.payload for e in await store.load("run-1")] == [{"x": 1}]

    async def test_same_step_other_phase_or_run_is_not_a_duplicate(
        self, store: Checkpointer
    ) -> None:
        """Only the whole key (run, step, phase) is unique."""
        await store.append(ev("m1.t1", Phase.INTENT))
        await store.append(ev("m1.t1", Phase.RESULT))
        await store.append(ev("m1.t1", Phase.INTENT, run_id="run-2"))
        assert len(await store.load("run-1")) == 2

    async def test_load_step_returns_one_step(self, store: Checkpointer) -> None:
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

    async def test_final_is_none_until_the_final_record(self, store: Checkpointer) -> None:
        """final() is None for an open run and the closing record once it is written."""
        assert await store.final("run-1") is None
        await store.append(ev("m1", text="draft"))
        assert await store.final("run-1") is None
        closing = ev("final", step="m1", text="done")
        await store.append(closing, status=RunStatus.CLOSED)
        assert await store.final("run-1") == closing
        assert await store.final("run-2") is None

    async def test_final_is_the_result_record(self, store: Checkpointer) -> None:
        """final() is the result record of step ``final``, whatever else that step holds."""
        await store.append(ev("final", Phase.INTENT, note="not the end"))
        assert await store.final("run-1") is None
        closing = ev("final", step="m1", text="done")
        await store.append(closing, status=RunStatus.CLOSED)
        assert await store.final("run-1") == closing

    async def test_set_status_on_unknown_run(self, store: Checkpointer) -> None:
        """set_status() on a run the journal does not know is a UsageError."""
        with pytest.raises(UsageError, match="ghost"):
            await store.set_status("ghost", RunStatus.UNCERTAIN)
        assert await store.runs() == []

    async def test_runs_lists_status_and_event_counts(self, store: Checkpointer) -> None:
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

    async def test_append_without_status_keeps_status(self, store: Checkpointer) -> None:
        """An append with no status leaves the run's status as it was."""
        await store.append(ev("m1"), status=RunStatus.SUSPENDED)
        await store.append(ev("m2"))
        [run] = await store.runs()
        assert run.status is RunStatus.SUSPENDED

    @pytest.mark.parametrize("name", list(BAD_BATCHES))
    async def test_invalid_batch_is_refused_whole(self, store: Checkpointer, name: str) -> None:
        """An invalid batch is a UsageError and records nothing at all."""
        with pytest.raises(UsageError):
            await store.append(*BAD_BATCHES[name])
        assert await store.load("run-1") == []
        assert await store.load("run-2") == []
        assert await store.runs() == []

    async def test_append_refuses_what_is_not_a_step_event(self, store: Checkpointer) -> None:
        """append() takes StepEvent records only."""
        with pytest.raises(UsageError):
            await store.append(ev("m1"), {"run_id": "run-1"})  # type: ignore[arg-type]
        assert await store.runs() == []

    @pytest.mark.parametrize("odd", ODD_IDS)
    async def test_odd_ids_round_trip(self, store: Checkpointer, odd: str) -> None:
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

    @pytest.mark.parametrize("bad", BAD_IDS, ids=["513-chars", "nul", "surrogate", "empty"])
    @pytest.mark.parametrize("field", ["run_id", "step_id"])
    async def test_bad_ids_are_refused(self, store: Checkpointer, bad: str, field: str) -> None:
        """Ids over 512 characters, with NUL, lone surrogates or empty are UsageErrors."""
        ids = {"run_id": "run-1", "step_id": "m1", field: bad}
        event = StepEvent(run_id=ids["run_id"], step_id=ids["step_id"], phase=Phase.RESULT)
        with pytest.raises(UsageError, match=field):
            await store.append(event)
        assert await store.runs() == []

    @pytest.mark.parametrize("decision", [None, *Decision])
    async def test_decision_round_trips(
        self, store: Checkpointer, decision: Decision | None
    ) -> None:
        """Every decision, and no decision, reads back as written."""
        event = ev("m1.t1", Phase.INTENT, decision=decision, tool="t")
        await store.append(event)
        [loaded] = await store.load("run-1")
        assert loaded == event
        assert loaded.decision is decision

    async def test_payload_round_trips(self, store: Checkpointer) -> None:
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

    # -- the age of a record: what judges an idempotency key -------------------------------

    async def test_age_counts_from_when_the_record_was_written(self, store: Checkpointer) -> None:
        """A record just written is as old as the time since; a record not there has none."""
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
        self, store: Checkpointer, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Written by a process whose clock is an hour ahead, then read on a true clock: SQLite
        and memory judge on the local clock (the age reads negative), PostgreSQL on the server's
        (the writer's clock does not count): ``store_clock`` says which this store does."""
        monkeypatch.setattr(asiento._clock, "skew", 3600.0)
        await store.append(ev("m1.t1", Phase.SUBMITTED))
        monkeypatch.setattr(asiento._clock, "skew", 0.0)
        age = await store.age("run-1", "m1.t1", Phase.SUBMITTED)
        assert age is not None
        if self.store_clock == "server":
            assert 0.0 <= age < 1800.0
        else:
            assert -3600.0 <= age < -1800.0
