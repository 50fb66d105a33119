"""The crash matrix of effects: real children killed with SIGKILL in every effect window.

Each scenario runs ``child.py`` (one pass over a run that publishes one invoice,
or writes one file) in fresh processes on one SQLite journal. The first child is
armed with ``ASIENTO_CRASH_AT`` and dies there; fresh children resume until the
run closes or stops with ``UncertainEffect`` (a bounded number of passes). The
invoice server lives in this process and counts what really reached it.

Invariant after every resume: the destination holds exactly one invoice, or the
run stopped with ``UncertainEffect`` and it holds at most one. When it stopped,
the test plays the person: ``asiento.resolve(happened=...)``, then resumes.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from asiento import Phase, RunStatus, SqliteCheckpointer, StepEvent, open_store, resolve
from asiento.effects import EffectRecord, effect_records
from asiento.testing import ENV_VAR
from asiento.testing.invoices import InvoiceServer

from .child import REPORT

CHILD = Path(__file__).with_name("child.py")
RUN = "run-1"
KILLED = -signal.SIGKILL
MAX_PASSES = 6
WINDOWS = ("after_prepare", "after_submitted", "after_publish", "after_result")
# The window a crash left the destination in: did the invoice reach it?
APPLIED_AT_CRASH = {
    "after_prepare": 0,
    "after_submitted": 0,
    "after_publish": 1,
    "after_result": 1,
}


@dataclass(frozen=True)
class Route:
    """One reconcile path: what the destination and the effect can do."""

    server_keys: bool
    flags: tuple[str, ...]
    forget_keys: bool = False  # the destination forgot the key before the resume


ROUTES = {
    "key_honoured": Route(True, ("--keys", "--ttl", "3600")),
    "key_expired": Route(True, ("--keys", "--ttl", "0"), forget_keys=True),
    "key_expired_lookup": Route(True, ("--keys", "--ttl", "0", "--lookup"), forget_keys=True),
    "lookup": Route(False, ("--lookup",)),
    "neither": Route(False, ()),
}


@dataclass(frozen=True)
class Expect:
    """What the journal and the destination show once the run closed."""

    via: str | None  # None: a person resolved it, no result record
    attempts: int
    posts: int
    decisions: tuple[bool, ...] = ()  # what the person answers to each UncertainEffect


CONFIRMED_BY_PERSON = Expect(None, 1, 1, decisions=(True,))
RETRIED_BY_PERSON = Expect("publish", 2, 1, decisions=(False,))
LOOKUP_FOUND = Expect("lookup", 1, 1)
LOOKUP_MISSED = Expect("lookup", 2, 1)  # ``via`` names the reconcile path, then it published

EXPECTED = {
    **{(w, r): Expect("publish", 1, 1) for w in ("after_prepare", "after_result") for r in ROUTES},
    ("after_submitted", "key_honoured"): Expect("republish", 2, 1),
    ("after_submitted", "key_expired"): RETRIED_BY_PERSON,
    ("after_submitted", "key_expired_lookup"): LOOKUP_MISSED,
    ("after_submitted", "lookup"): LOOKUP_MISSED,
    ("after_submitted", "neither"): RETRIED_BY_PERSON,
    ("after_publish", "key_honoured"): Expect("republish", 2, 2),
    ("after_publish", "key_expired"): CONFIRMED_BY_PERSON,
    ("after_publish", "key_expired_lookup"): LOOKUP_FOUND,
    ("after_publish", "lookup"): LOOKUP_FOUND,
    ("after_publish", "neither"): CONFIRMED_BY_PERSON,
}


@dataclass
class Scenario:
    """One run driven by successive children against one destination.

    ``db`` is a SQLite file or a PostgreSQL DSN.
    """

    db: Path | str
    argv: list[str]
    ends: list[str] = field(default_factory=list)

    def child(self, crash_at: str | None, *, skew: float = 0.0) -> dict[str, Any]:
        """One pass in a fresh process whose clock is ``skew`` seconds ahead; how it ended
        (``killed`` when SIGKILL hit)."""
        env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
        if crash_at:
            env[ENV_VAR] = crash_at
        argv = [sys.executable, str(CHILD), "--db", str(self.db), "--run", RUN]
        argv += ["--skew", repr(skew), *self.argv]
        proc = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=60, check=False
        )
        if proc.returncode == KILLED:
            ended = {"ended": "killed"}
        else:
            assert proc.returncode in (0, 3), proc.stderr
            ended = json.loads(proc.stdout.strip().splitlines()[-1])
        self.ends.append(ended["ended"])
        return ended


def http_scenario(tmp_path: Path, server: InvoiceServer, route: Route) -> Scenario:
    return Scenario(tmp_path / "runs.db", ["http", "--url", server.invoices_url, *route.flags])


async def journal_of(db: Path) -> tuple[list[StepEvent], list[EffectRecord], RunStatus]:
    store = SqliteCheckpointer(db)
    try:
        events = await store.load(RUN)
        records = await effect_records(store, RUN)
        (info,) = await store.runs()
    finally:
        await store.close()
    return events, records, info.status


def results_of_effect(events: list[StepEvent]) -> list[StepEvent]:
    """The result records of the effect step m1.t1, all attempts."""
    return [e for e in events if e.step_id.startswith("m1.t1") and e.phase is Phase.RESULT]


async def person_resolves(db: Path, step_id: str, happened: bool, server: InvoiceServer) -> None:
    """What a person does after checking the destination by hand."""
    remote_id = server.invoices[0]["id"] if happened else None
    store = SqliteCheckpointer(db)
    try:
        await resolve(store, RUN, step_id, happened=happened, by="ana", remote_id=remote_id)
    finally:
        await store.close()


async def resume_until_settled(
    scenario: Scenario,
    server: InvoiceServer,
    crashes: list[str],
    decisions: list[bool],
) -> None:
    """Resume in fresh children (armed with ``crashes`` in turn) until the run closes.

    After every pass that was not killed, the invariant must hold; an
    ``UncertainEffect`` is answered with the next of ``decisions``.
    """
    for _ in range(MAX_PASSES):
        ended = scenario.child(crashes.pop(0) if crashes else None)
        if ended["ended"] == "killed":
            continue
        held = len(server.invoices)
        if ended["ended"] == "closed":
            assert held == 1, f"closed with {held} invoices at the destination"
            return
        assert ended["ended"] == "uncertain", ended
        assert held <= 1, f"UncertainEffect, but the destination holds {held} invoices"
        assert decisions, f"unexpected UncertainEffect at {ended['step_id']}"
        happened = decisions.pop(0)
        assert held == (1 if happened else 0), "the person's answer must be the truth"
        await person_resolves(scenario.db, ended["step_id"], happened, server)
    pytest.fail(f"the run did not close in {MAX_PASSES} passes: {scenario.ends}")


async def check_closed(db: Path, expect: Expect, server: InvoiceServer) -> None:
    """The run closed; the effect's outcome, path and attempts are as expected."""
    events, (record,), status = await journal_of(db)
    assert status is RunStatus.CLOSED
    (invoice,) = server.invoices
    assert server.posts == expect.posts
    assert (record.status, record.remote_id) == ("confirmed", invoice["id"])
    assert record.attempts == expect.attempts
    results = results_of_effect(events)
    if expect.via is None:
        assert results == []
        return
    (result,) = results
    assert result.payload["via"] == expect.via
    assert result.payload["attempts"] == expect.attempts
    assert result.payload["remote_id"] == invoice["id"]


@pytest.mark.parametrize("route_name", list(ROUTES))
@pytest.mark.parametrize("window", WINDOWS)
async def test_effect_crash_matrix(tmp_path: Path, window: str, route_name: str) -> None:
    """Killed in any effect window, on any reconcile path: one invoice, or Uncertain and ≤ 1."""
    route, expect = ROUTES[route_name], EXPECTED[window, route_name]
    with InvoiceServer(honour_keys=route.server_keys) as server:
        scenario = http_scenario(tmp_path, server, route)
        assert scenario.child(window)["ended"] == "killed"
        assert len(server.invoices) == APPLIED_AT_CRASH[window]
        if route.forget_keys:
            server.expire_keys()
        await resume_until_settled(scenario, server, [], list(expect.decisions))
        assert scenario.ends.count("uncertain") == len(expect.decisions)
        await check_closed(scenario.db, expect, server)
        headers = set(server.headers_seen)
    (_, (record,), _) = await journal_of(scenario.db)
    assert headers == {record.idem_key}, "every POST carried the step's frozen key"


@pytest.mark.parametrize(
    ("route_name", "crashes", "expect"),
    [
        ("key_honoured", ["after_publish", "after_publish"], Expect("republish", 3, 3)),
        ("key_honoured", ["after_submitted", "after_publish"], Expect("republish", 3, 2)),
        ("lookup", ["after_submitted", "after_submitted"], Expect("lookup", 3, 1)),
        ("lookup", ["after_submitted", "after_publish"], Expect("lookup", 2, 1)),
        ("neither", ["after_submitted", "", "after_publish"], Expect(None, 2, 1, (False, True))),
    ],
)
async def test_crash_again_while_reconciling(
    tmp_path: Path, route_name: str, crashes: list[str], expect: Expect
) -> None:
    """A second kill inside the republish, the post-lookup publish or the person's retry."""
    route, crashes = ROUTES[route_name], list(crashes)
    with InvoiceServer(honour_keys=route.server_keys) as server:
        scenario = http_scenario(tmp_path, server, route)
        assert scenario.child(crashes.pop(0))["ended"] == "killed"
        await resume_until_settled(scenario, server, crashes, list(expect.decisions))
        assert scenario.ends.count("killed") == 2
        await check_closed(scenario.db, expect, server)


def age_first_submission(db: Path, seconds: float) -> None:
    """Move the first submitted record of m1.t1 ``seconds`` into the past (time went by)."""
    with sqlite3.connect(db) as conn:
        changed = conn.execute(
            "UPDATE journal SET created_at = created_at - ? WHERE run_id = ? AND step_id = ?"
            " AND phase = 'submitted'",
            (seconds, RUN, "m1.t1"),
        ).rowcount
    conn.close()
    assert changed == 1


async def test_key_age_counts_from_the_first_submission(tmp_path: Path) -> None:
    """A fresh republish does not renew the key: its age runs from the first submitted record."""
    route = ROUTES["key_honoured"]  # key_ttl 3600 s, no lookup
    with InvoiceServer(honour_keys=True) as server:
        scenario = http_scenario(tmp_path, server, route)
        assert scenario.child("after_submitted")["ended"] == "killed"
        assert scenario.child("after_submitted")["ended"] == "killed"  # republish m1.t1/2
        age_first_submission(scenario.db, 7200)
        server.expire_keys()
        ended = scenario.child(None)
        assert (ended["ended"], ended["step_id"]) == ("uncertain", "m1.t1/2")
        assert server.posts == 0
        await resume_until_settled(scenario, server, [], [False])
        await check_closed(scenario.db, Expect("publish", 3, 1), server)


# -- clocks: a key's age is judged on one clock, conservatively ----------------------------

TTL = 3600.0  # the effect's key_ttl; its default margin is 360 s
KEYED = ["--keys", "--ttl", repr(TTL)]
DAY = 86400.0
# (writer's clock, resumer's clock), seconds ahead of the true time.
SKEWED = {
    "writer 30 s ahead": (30.0, 0.0),
    "resumer 30 s behind": (0.0, -30.0),
    "both": (30.0, -30.0),
}


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """The journal of one scenario: a SQLite file, or a PostgreSQL schema of its own."""
    if request.param == "sqlite":
        return tmp_path / "runs.db"
    return str(request.getfixturevalue("pg_dsn"))


def time_passes(db: Path | str, seconds: float) -> None:
    """``seconds`` go by on every clock: every time recorded for the run moves that far back."""
    if isinstance(db, Path):
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE journal SET created_at = created_at - ?", (seconds,))
        conn.close()
        return
    with psycopg.connect(db) as pg:
        found = pg.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema ="
            " current_schema() AND table_name = 'journal' AND data_type = 'double precision'"
        ).fetchall()
        for (column,) in found:  # created_at, and the server's written_at where there is one
            pg.execute(f"UPDATE journal SET {column} = {column} - %s", (seconds,))


async def outcome_of(db: Path | str) -> tuple[RunStatus, list[StepEvent]]:
    """The run's status and its effect step's result records."""
    store = await open_store(db)
    try:
        (info,) = await store.runs()
        return info.status, results_of_effect(await store.load(RUN))
    finally:
        await store.close()


def published_then_killed(
    db: Path | str, server: InvoiceServer, flags: list[str], skew: float
) -> Scenario:
    """A writer whose clock is ``skew`` ahead publishes one invoice, and dies before the result."""
    scenario = Scenario(db, ["http", "--url", server.invoices_url, *flags])
    assert scenario.child("after_publish", skew=skew)["ended"] == "killed"
    assert len(server.invoices) == 1
    return scenario


@pytest.mark.parametrize("skews", list(SKEWED))
async def test_a_key_just_past_its_ttl_is_not_republished_whatever_the_clocks(
    db: Path | str, skews: str
) -> None:
    """The key just past its TTL, with the writer's clock ahead or the resumer's behind:
    no second invoice, but UncertainEffect saying the key is too old."""
    writer, resumer = SKEWED[skews]
    with InvoiceServer(honour_keys=True) as server:
        scenario = published_then_killed(db, server, KEYED, writer)
        time_passes(db, TTL + 1)
        server.expire_keys()  # the destination kept the key for its TTL, then forgot it
        ended = scenario.child(None, skew=resumer)
        assert len(server.invoices) == 1, "an expired key was trusted: a second invoice"
        assert ended["ended"] == "uncertain", ended
        assert "old; the destination keeps keys 3600s" in ended["why"]
        assert server.posts == 1
    status, results = await outcome_of(db)
    assert (status, results) == (RunStatus.UNCERTAIN, [])


async def test_a_key_just_past_its_ttl_is_looked_up(db: Path | str) -> None:
    """The same with a lookup: the invoice is found and recorded, nothing is published again."""
    with InvoiceServer(honour_keys=True) as server:
        scenario = published_then_killed(db, server, [*KEYED, "--lookup"], 30.0)
        time_passes(db, TTL + 1)
        server.expire_keys()
        assert scenario.child(None, skew=-30.0)["ended"] == "closed"
        (invoice,) = server.invoices
        assert server.posts == 1
    status, (result,) = await outcome_of(db)
    assert status is RunStatus.CLOSED
    assert (result.payload["via"], result.payload["remote_id"]) == ("lookup", invoice["id"])


async def test_a_writer_a_day_ahead_cannot_make_an_expired_key_look_fresh(db: Path | str) -> None:
    """A writer's clock a day ahead and the key past its TTL: on SQLite the age reads
    negative (never fresh), on PostgreSQL the server's clock says how old it is."""
    with InvoiceServer(honour_keys=True) as server:
        scenario = published_then_killed(db, server, KEYED, DAY)
        time_passes(db, TTL + 1)
        server.expire_keys()
        ended = scenario.child(None)
        assert len(server.invoices) == 1, "an expired key was trusted: a second invoice"
        assert ended["ended"] == "uncertain", ended
        assert server.posts == 1


async def test_on_sqlite_a_negative_age_is_not_fresh(tmp_path: Path) -> None:
    """The local clock went back a day since the key was first sent: its age cannot be
    trusted, even though the destination still remembers it."""
    with InvoiceServer(honour_keys=True) as server:
        scenario = published_then_killed(tmp_path / "runs.db", server, KEYED, DAY)
        ended = scenario.child(None)
        assert ended["ended"] == "uncertain", ended
        assert "from the future" in ended["why"]
        assert (len(server.invoices), server.posts) == (1, 1)


@pytest.mark.parametrize(
    ("writer", "resumer"), [(-DAY, 0.0), (0.0, DAY), (DAY, -DAY)], ids=["behind", "ahead", "both"]
)
async def test_on_postgres_client_clocks_do_not_count(
    pg_dsn: str, writer: float, resumer: float
) -> None:
    """Clients a day off either way: the server's clock says the key is fresh, and the
    resume republishes under it; the destination answers with the same invoice."""
    with InvoiceServer(honour_keys=True) as server:
        scenario = published_then_killed(pg_dsn, server, KEYED, writer)
        assert scenario.child(None, skew=resumer)["ended"] == "closed"
        (invoice,) = server.invoices
        assert server.posts == 2
    status, (result,) = await outcome_of(pg_dsn)
    assert status is RunStatus.CLOSED
    assert (result.payload["via"], result.payload["remote_id"]) == ("republish", invoice["id"])


@pytest.mark.parametrize("window", ["after_submitted", "after_publish"])
async def test_a_key_well_inside_its_ttl_is_republished(db: Path | str, window: str) -> None:
    """Half the TTL gone by, clocks 30 s off both ways: the key is republished, and the run
    closes with exactly one invoice."""
    with InvoiceServer(honour_keys=True) as server:
        scenario = Scenario(db, ["http", "--url", server.invoices_url, *KEYED])
        assert scenario.child(window, skew=30.0)["ended"] == "killed"
        time_passes(db, TTL / 2)
        assert scenario.child(None, skew=-30.0)["ended"] == "closed"
        (invoice,) = server.invoices
    status, (result,) = await outcome_of(db)
    assert status is RunStatus.CLOSED
    assert (result.payload["via"], result.payload["remote_id"]) == ("republish", invoice["id"])


# -- WriteFile -------------------------------------------------------------------------


def writes(log: Path) -> list[str]:
    """The writes the children made (one fsynced line each)."""
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize(
    ("window", "via", "attempts"),
    [
        ("after_prepare", "publish", 1),
        ("after_submitted", "lookup", 2),
        ("after_publish", "lookup", 1),
        ("after_result", "publish", 1),
    ],
)
async def test_write_file_crash_matrix(
    tmp_path: Path, window: str, via: str, attempts: int
) -> None:
    """Killed in any window of WriteFile: the file is written exactly once, found by its hash."""
    root, log = tmp_path / "root", tmp_path / "writes.log"
    (root / "out").mkdir(parents=True)
    target = root / REPORT["path"]
    scenario = Scenario(tmp_path / "runs.db", ["file", "--root", str(root), "--log", str(log)])
    assert scenario.child(window)["ended"] == "killed"
    written = APPLIED_AT_CRASH[window] == 1
    assert target.exists() is written
    inode = target.stat().st_ino if written else None
    assert scenario.child(None)["ended"] == "closed"
    assert target.read_text() == REPORT["content"]
    assert len(writes(log)) == 1, "the file was written exactly once"
    if inode is not None:
        assert target.stat().st_ino == inode, "the resumed run did not replace the file"
    events, (record,), _ = await journal_of(scenario.db)
    (result,) = results_of_effect(events)
    assert (result.payload["via"], result.payload["attempts"]) == (via, attempts)
    assert (record.status, record.attempts) == ("confirmed", attempts)
    assert record.remote_id == result.payload["remote_id"]


async def test_write_file_lookup_ignores_other_content(tmp_path: Path) -> None:
    """A file already at the path with other content is not taken for the effect: it is written."""
    root, log = tmp_path / "root", tmp_path / "writes.log"
    (root / "out").mkdir(parents=True)
    target = root / REPORT["path"]
    target.write_text("an older report\n")
    scenario = Scenario(tmp_path / "runs.db", ["file", "--root", str(root), "--log", str(log)])
    assert scenario.child("after_submitted")["ended"] == "killed"
    assert target.read_text() == "an older report\n"
    assert scenario.child(None)["ended"] == "closed"
    assert target.read_text() == REPORT["content"]
    assert len(writes(log)) == 1
