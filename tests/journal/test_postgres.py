"""What only the PostgreSQL journal has: migrations in the database, processes racing,
connections dying mid-transaction and at COMMIT, fleet claims, opening by URL.

The rest of its behaviour is the conformance suite's (asiento.testing.conformance, run by
test_conformance.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from asiento import (
    Agent,
    FinalStep,
    Holder,
    JournalError,
    JournalTooNew,
    NotAJournal,
    Phase,
    RunLocked,
    RunStatus,
    Session,
    SqliteCheckpointer,
    StepEvent,
    ToolCall,
    UsageError,
    tool,
)
from asiento.journal import _postgres_schema as schema
from asiento.journal.postgres import PostgresCheckpointer
from asiento.journal.url import open_store
from asiento.model import ModelResponse
from asiento.testing import ScriptedGateway

from .pg_server import host_and_port

CHILD = Path(__file__).with_name("pg_child.py")
SECRET = "hunter2-not-a-real-password"


def ev(
    step_id: str, phase: Phase = Phase.RESULT, *, run_id: str = "run-1", **payload: Any
) -> StepEvent:
    """A record with a small payload."""
    return StepEvent(run_id=run_id, step_id=step_id, phase=phase, payload=payload)


def app_name(dsn: str) -> str:
    """The application_name the test's DSN gives its store's connections."""
    return str(conninfo_to_dict(dsn)["application_name"])


@pytest.fixture
async def admin(pg_dsn: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A connection of the test itself to the test's schema, not counted as the store's."""
    conn = await psycopg.AsyncConnection.connect(
        make_conninfo(pg_dsn, application_name="asiento-test-admin"), autocommit=True
    )
    async with conn:
        yield conn


@pytest.fixture
async def store(pg_dsn: str) -> AsyncIterator[PostgresCheckpointer]:
    """An open store on the test's schema, with one pooled connection."""
    async with PostgresCheckpointer(pg_dsn, max_size=1) as opened:
        yield opened


async def rows(admin: psycopg.AsyncConnection[Any], query: str, *args: Any) -> list[Any]:
    """The rows of one query, run by the test's own connection."""
    cur = await admin.execute(query, args)
    return await cur.fetchall()


def spawn(dsn: str, *args: str, **env: str) -> subprocess.Popen[str]:
    """A pg_child.py process on the test's schema."""
    return subprocess.Popen(
        [sys.executable, str(CHILD), dsn, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def finish(child: subprocess.Popen[str]) -> None:
    """Kill the child if it still runs, and reap it and its pipes."""
    with contextlib.suppress(ProcessLookupError):
        child.kill()
    child.communicate(timeout=10)


def outputs(children: list[subprocess.Popen[str]]) -> list[list[str]]:
    """Start the children at once (when all are ready), then each one's lines."""
    for child in children:
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    results = []
    for child in children:
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0, out
        results.append(out.split("\n")[:-1])
    return results


@pytest.fixture
def admin_sync(pg_dsn: str) -> Any:
    """A blocking connection of the test to its schema."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


# -- migrations ---------------------------------------------------------------------------


async def test_migrations_are_recorded_in_the_database(
    store: PostgresCheckpointer, admin: psycopg.AsyncConnection[Any], pg_dsn: str
) -> None:
    """Opening records each applied migration in asiento_schema, once, however often."""
    versions = list(range(1, schema.SCHEMA_VERSION + 1))
    assert await rows(admin, "SELECT version FROM asiento_schema ORDER BY version") == [
        (v,) for v in versions
    ]
    await store.append(ev("m1"))
    async with PostgresCheckpointer(pg_dsn) as again:
        assert await again.load("run-1") == await store.load("run-1")
    assert len(await rows(admin, "SELECT version FROM asiento_schema")) == len(versions)


async def test_newer_schema_is_refused(
    store: PostgresCheckpointer, admin: psycopg.AsyncConnection[Any], pg_dsn: str
) -> None:
    """A database migrated by a newer asiento raises JournalTooNew, without the password."""
    await store.append(ev("m1"))
    newer = schema.SCHEMA_VERSION + 1
    await admin.execute("INSERT INTO asiento_schema (version) VALUES (%s)", (newer,))
    with pytest.raises(JournalTooNew, match=f"schema {newer}") as info:
        await PostgresCheckpointer.connect(make_conninfo(pg_dsn, password=SECRET))
    assert SECRET not in str(info.value)
    assert [e.step_id for e in await store.load("run-1")] == ["m1"]


async def test_tables_asiento_did_not_create_are_refused(
    admin: psycopg.AsyncConnection[Any], pg_dsn: str
) -> None:
    """A schema with someone else's journal table is not touched: NotAJournal."""
    await admin.execute("CREATE TABLE journal (id int)")
    with pytest.raises(NotAJournal, match="journal or runs"):
        await PostgresCheckpointer.connect(pg_dsn)
    found = await rows(admin, "SELECT to_regclass('asiento_schema'), to_regclass('runs')")
    assert found == [(None, None)]


def test_processes_opening_a_new_database_at_once(
    pg_dsn: str, admin_sync: psycopg.Connection[Any]
) -> None:
    """Four processes opening an empty schema at the same instant all succeed, migrating once."""
    results = outputs([spawn(pg_dsn, "open") for _ in range(4)])
    assert results == [["ok"]] * 4
    found = admin_sync.execute("SELECT version FROM asiento_schema ORDER BY version").fetchall()
    assert found == [(v,) for v in range(1, schema.SCHEMA_VERSION + 1)]


# -- processes racing for the same record -------------------------------------------------


async def test_primary_key_race_between_processes(store: PostgresCheckpointer) -> None:
    """Four processes append the same (run, step, phase) at once: exactly one wins."""
    children = [spawn(store.dsn, "race", f"child-{n}") for n in range(4)]
    results = await asyncio.to_thread(outputs, children)
    assert sorted(r[0] for r in results) == ["duplicate"] * 3 + ["ok"]
    winner = f"child-{[r[0] for r in results].index('ok')}"
    [record] = await store.load("race")
    assert record.payload == {"by": winner}
    [run] = await store.runs()
    assert run.events == 1


async def test_claims_of_many_processes_never_overlap(store: PostgresCheckpointer) -> None:
    """Three worker processes claiming at once take six submitted runs, each exactly once."""
    for n in range(6):
        await store.submit(f"job-{n}", f"task {n}")
    children = [spawn(store.dsn, "claim", "2") for _ in range(3)]
    results = await asyncio.to_thread(outputs, children)
    claimed = sorted(run_id for lines in results for run_id in lines)
    assert claimed == [f"job-{n}" for n in range(6)]
    assert all(r.attempts == 1 and r.fence == 1 for r in await store.runs())


async def test_claim_skips_a_run_locked_by_another_transaction(
    store: PostgresCheckpointer, admin: psycopg.AsyncConnection[Any]
) -> None:
    """A claim does not wait for a row another worker is claiming: it takes the next run."""
    await store.submit("first", "a")
    await store.submit("second", "b")
    async with admin.transaction():
        await admin.execute("SELECT 1 FROM runs WHERE run_id = 'first' FOR UPDATE")
        claim = await asyncio.wait_for(store.claim(Holder.here(), ttl=60), timeout=5)
        assert claim is not None
        assert claim.lease.run_id == "second"
    claim = await store.claim(Holder.here(), ttl=60)
    assert claim is not None
    assert (claim.lease.run_id, claim.task) == ("first", "a")


# -- connections that die ------------------------------------------------------------------


async def store_backends(admin: psycopg.AsyncConnection[Any], dsn: str) -> list[int]:
    """The server pids of the store's connections."""
    found = await rows(
        admin, "SELECT pid FROM pg_stat_activity WHERE application_name = %s", app_name(dsn)
    )
    return [pid for (pid,) in found]


async def terminate(admin: psycopg.AsyncConnection[Any], pid: int) -> None:
    """pg_terminate_backend(pid), and wait (5 s at most) until it is gone."""
    await admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))


async def terminate_sleepers(admin: psycopg.AsyncConnection[Any], dsn: str, times: int) -> int:
    """Terminate the store's backend each time it sleeps in a trigger, ``times`` times."""
    done = 0
    deadline = time.monotonic() + 20
    while done < times and time.monotonic() < deadline:
        found = await rows(
            admin,
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
            " AND wait_event = 'PgSleep'",
            app_name(dsn),
        )
        for (pid,) in found:
            await terminate(admin, pid)
            done += 1
        await asyncio.sleep(0.02)
    return done


# The first ``times`` records of step 'slow' sleep (a sequence counts across rollbacks).
SLOW = """
CREATE SEQUENCE slow_count;
CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.step_id = 'slow' AND nextval('slow_count') <= {times} THEN
        PERFORM pg_sleep(10);
    END IF;
    RETURN NEW;
END $$;
"""

# Fires for each record of step 'slow' before the INSERT completes.
DURING_APPEND = "CREATE TRIGGER slow BEFORE INSERT ON journal FOR EACH ROW EXECUTE FUNCTION slow()"

# Deferred: fires inside COMMIT itself.
DURING_COMMIT = """
CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON journal
DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow()
"""


async def test_connection_killed_between_appends(
    store: PostgresCheckpointer, admin: psycopg.AsyncConnection[Any]
) -> None:
    """After its idle connection is terminated, the next append works on a new one."""
    await store.append(ev("m1"))
    [old] = await store_backends(admin, store.dsn)
    await terminate(admin, old)
    await store.append(ev("m2"), ev("m2.t1", Phase.INTENT))
    [new] = await store_backends(admin, store.dsn)
    assert new != old
    await terminate(admin, new)
    assert [e.step_id for e in await store.load("run-1")] == ["m1", "m2", "m2.t1"]
    [run] = await store.runs()
    assert run.events == 3


@pytest.mark.parametrize("trigger", [DURING_APPEND, DURING_COMMIT], ids=["insert", "commit"])
async def test_connection_killed_once_the_batch_is_retried_whole(
    store: PostgresCheckpointer, admin: psycopg.AsyncConnection[Any], trigger: str
) -> None:
    """A backend killed mid-append (or mid-COMMIT) once: the batch is written whole, once."""
    await admin.execute(SLOW.format(times=1))
    await admin.execute(trigger)
    await store.append(ev("m1"))
    killer = asyncio.create_task(terminate_sleepers(admin, store.dsn, 1))
    batch = [ev("m2"), ev("slow", n=1), ev("m3")]
    appending = asyncio.create_task(store.append(*batch))
    assert await killer == 1
    await asyncio.wait_for(appending, timeout=20)
    assert [e.step_id for e in await store.load("run-1")] == ["m1", "m2", "slow", "m3"]
    [run] = await store.runs()
    assert run.events == 4


@pytest.mark.parametrize("trigger", [DURING_APPEND, DURING_COMMIT], ids=["insert", "commit"])
async def test_connection_killed_again_and_again_the_batch_lands_once(
    store: PostgresCheckpointer, admin: psycopg.AsyncConnection[Any], trigger: str
) -> None:
    """Killed on four attempts in a row: the fifth lands, and the batch is there once."""
    await admin.execute(SLOW.format(times=4))
    await admin.execute(trigger)
    await store.append(ev("m1"))
    killer = asyncio.create_task(terminate_sleepers(admin, store.dsn, 4))
    appending = asyncio.create_task(store.append(ev("m2"), ev("slow"), ev("m3")))
    assert await killer == 4
    await asyncio.wait_for(appending, timeout=20)
    assert [e.step_id for e in await store.load("run-1")] == ["m1", "m2", "slow", "m3"]
    [run] = await store.runs()
    assert run.events == 4


@pytest.mark.parametrize("trigger", [DURING_APPEND, DURING_COMMIT], ids=["insert", "commit"])
async def test_connection_killed_past_the_retry_budget_writes_nothing(
    admin: psycopg.AsyncConnection[Any], pg_dsn: str, trigger: str
) -> None:
    """Out of ``retry_for``: JournalError naming the database, and no record of the batch."""
    conninfo = make_conninfo(pg_dsn, password=SECRET)
    async with PostgresCheckpointer(conninfo, max_size=1, retry_for=0) as store:
        await admin.execute(SLOW.format(times=1))
        await admin.execute(trigger)
        await store.append(ev("m1"))
        killer = asyncio.create_task(terminate_sleepers(admin, pg_dsn, 1))
        with pytest.raises(JournalError, match=r"asiento_t_.*kept being lost") as info:
            await store.append(ev("m2"), ev("slow"), ev("m3"), status=RunStatus.CLOSED)
        assert await killer == 1
        assert SECRET not in str(info.value)
        assert [e.step_id for e in await store.load("run-1")] == ["m1"]
        [run] = await store.runs()
        assert (run.events, run.status) == (1, RunStatus.RUNNING)


def test_retry_budget_must_not_be_negative(pg_dsn: str) -> None:
    with pytest.raises(UsageError, match="retry_for"):
        PostgresCheckpointer(pg_dsn, retry_for=-1)


async def test_process_killed_inside_commit_leaves_nothing(store: PostgresCheckpointer) -> None:
    """A process SIGKILLed after its INSERTs, before COMMIT, leaves no record behind."""
    child = spawn(store.dsn, "append", ASIENTO_CRASH_AT="inside_commit")
    await asyncio.to_thread(child.communicate, None, 60)
    assert child.returncode == -signal.SIGKILL
    assert await store.load("run-1") == []
    assert await store.runs() == []
    await asyncio.wait_for(store.append(ev("m1"), ev("m1.t1", Phase.INTENT)), timeout=10)
    assert len(await store.load("run-1")) == 2


class CommitCutter:
    """A TCP proxy to the server that counts the COMMITs its clients send and, when armed,
    forwards one COMMIT and then hangs up without passing the answer on: a commit that
    landed, whose client cannot know it."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.armed = False
        self.cut = 0
        self.commits = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.upstream
        if host.startswith("/"):
            up_reader, up_writer = await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
        else:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        back = asyncio.create_task(self._pump(up_reader, writer))
        try:
            while data := await reader.read(65536):
                self.commits += data.count(b"COMMIT")
                if self.armed and b"COMMIT" in data:
                    self.armed, self.cut = False, self.cut + 1
                    back.cancel()  # from now on nothing reaches the client
                    up_writer.write(data)
                    await up_writer.drain()
                    await asyncio.sleep(0.5)  # the server commits; its answer is dropped
                    break
                up_writer.write(data)
                await up_writer.drain()
        finally:
            back.cancel()
            for w in (writer, up_writer):
                w.close()

    @staticmethod
    async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def test_commit_that_landed_unseen_is_read_back(pg_dsn: str) -> None:
    """A COMMIT whose answer was lost is read back: append succeeds, the batch is there once."""
    cutter = CommitCutter(host_and_port(pg_dsn))
    port = await cutter.start()
    proxied = make_conninfo(pg_dsn, host="127.0.0.1", port=port, sslmode="disable")
    try:
        async with PostgresCheckpointer(proxied, max_size=2) as store:
            await store.append(ev("m1"))
            cutter.armed = True
            await asyncio.wait_for(store.append(ev("m2"), ev("m2.t1", Phase.INTENT)), 20)
            assert cutter.cut == 1
            assert [e.step_id for e in await store.load("run-1")] == ["m1", "m2", "m2.t1"]
            [run] = await store.runs()
            assert run.events == 3
    finally:
        await cutter.close()


async def test_claim_whose_commit_was_cut_off_is_the_claim_returned(pg_dsn: str) -> None:
    """A claim that landed unseen is returned as is; no second run is leased and stranded."""
    cutter = CommitCutter(host_and_port(pg_dsn))
    port = await cutter.start()
    proxied = make_conninfo(pg_dsn, host="127.0.0.1", port=port, sslmode="disable")
    holder = Holder.here()
    try:
        async with PostgresCheckpointer(proxied, max_size=2) as store:
            for run_id in ("first", "second"):
                await store.submit(run_id, f"task {run_id}")
            cutter.armed = True
            claim = await asyncio.wait_for(store.claim(holder, ttl=60), 20)
            assert cutter.cut == 1
            assert claim is not None
            leased = {r.run_id: (r.lease_owner, r.fence, r.attempts) for r in await store.runs()}
            assert leased == {"first": (holder.owner, 1, 1), "second": (None, 0, 0)}
            assert (claim.lease.run_id, claim.lease.token, claim.attempts) == ("first", 1, 1)
            await store.append(ev("m1", run_id="first"), lease=claim.lease)  # the lease works
    finally:
        await cutter.close()


# -- leases between processes ---------------------------------------------------------------


async def test_lease_between_processes(store: PostgresCheckpointer) -> None:
    """A live process's lease locks the run; once expired it is taken over, and fenced off."""
    child = spawn(store.dsn, "hold", "1.0")
    try:
        assert child.stdout is not None
        line = await asyncio.to_thread(child.stdout.readline)
        assert line.split() == ["held", "1"]
        with pytest.raises(RunLocked, match=f"pid {child.pid}"):
            await store.acquire("run-1", Holder.here(), ttl=30)
        lease = await until_acquired(lambda: store.acquire("run-1", Holder.here(), ttl=30))
        assert lease.token == 2
        out, _ = await asyncio.to_thread(child.communicate, "append\n", 30)
        assert out.split() == ["lease-lost"]
    finally:
        finish(child)
    assert [(e.step_id, e.payload) for e in await store.load("run-1")] == [("m1", {"by": "child"})]


async def test_killed_holder_is_taken_over_at_once(store: PostgresCheckpointer) -> None:
    """The lease of a process SIGKILLed on this host is taken over before it expires."""
    child = spawn(store.dsn, "hold", "300")
    assert child.stdout is not None
    assert (await asyncio.to_thread(child.stdout.readline)).split() == ["held", "1"]
    finish(child)
    lease = await store.acquire("run-1", Holder.here(), ttl=30)
    assert lease.token == 2
    await store.append(ev("m2"), lease=lease)
    assert [e.step_id for e in await store.load("run-1")] == ["m1", "m2"]


async def until_acquired(acquire: Callable[[], Awaitable[Any]], seconds: float = 10) -> Any:
    """Retry ``acquire`` while the run is locked, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await acquire()
        except RunLocked:
            assert time.monotonic() < deadline, "the lease never expired"
            await asyncio.sleep(0.05)


# -- the agent on PostgreSQL ------------------------------------------------------------------


async def test_agent_runs_and_replays_on_postgres(store: PostgresCheckpointer) -> None:
    """An agent closes a run on PostgreSQL; the second pass answers from the journal alone."""
    sent: list[str] = []

    @tool
    def send(to: str) -> str:
        """Send a message."""
        sent.append(to)
        return f"sent to {to}"

    script = [
        ModelResponse(tool_calls=[ToolCall(name="send", arguments={"to": "ana"}, id="c1")]),
        ModelResponse(text="done"),
    ]
    agent = Agent(instructions="be brief", tools=[send])
    gateway = ScriptedGateway(script)
    steps = [s async for s in agent.run("greet ana", session=Session("run-1", gateway, store))]
    assert isinstance(steps[-1], FinalStep)
    again = ScriptedGateway(script)
    replay = [s async for s in agent.run("greet ana", session=Session("run-1", again, store))]
    assert replay == [FinalStep(run_id="run-1", step_id="m2", text="done", replayed=True)]
    assert (sent, again.calls) == (["ana"], [])
    [run] = await store.runs()
    assert (run.status, run.model_calls, run.lease_owner) == (RunStatus.CLOSED, 2, None)


# -- opening, closing, errors ----------------------------------------------------------------


async def test_store_opens_itself_at_first_use(pg_dsn: str) -> None:
    """A store only constructed opens (and migrates) at its first call."""
    store = PostgresCheckpointer(pg_dsn)
    try:
        await store.append(ev("m1"))
        assert len(await store.load("run-1")) == 1
    finally:
        await store.close()
    with pytest.raises(UsageError, match="closed"):
        await store.load("run-1")


def test_store_belongs_to_the_loop_that_opened_it(pg_dsn: str) -> None:
    """Using a store from another event loop is a UsageError, not a hang or a crash."""
    store = asyncio.run(PostgresCheckpointer.connect(pg_dsn))
    try:
        with pytest.raises(UsageError, match="another event loop"):
            asyncio.run(store.load("run-1"))
    finally:
        with contextlib.suppress(Exception):
            asyncio.run(store.close())


async def test_unreachable_server_names_it_without_password() -> None:
    """A server that does not answer is a JournalError naming it, never its password."""
    url = f"postgresql://asiento:{SECRET}@127.0.0.1:1/journal?connect_timeout=5"
    with pytest.raises(JournalError, match=r"127\.0\.0\.1") as info:
        await PostgresCheckpointer.connect(url)
    assert SECRET not in str(info.value)
    assert "journal" in str(info.value)


def test_bad_connection_string_is_a_usage_error() -> None:
    """A DSN libpq cannot parse is refused at construction."""
    with pytest.raises(UsageError, match="connection string"):
        PostgresCheckpointer("host=x nonsense")


# -- open_store ------------------------------------------------------------------------------


def as_url(dsn: str, scheme: str) -> str:
    """The test's DSN written as a URL of the given scheme (every parameter in the query)."""
    params = conninfo_to_dict(dsn)
    dbname = quote(str(params.pop("dbname", "")))
    query = "&".join(f"{key}={quote(str(value))}" for key, value in params.items())
    return f"{scheme}:///{dbname}?{query}"


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
async def test_open_store_postgres_url(pg_dsn: str, scheme: str) -> None:
    """postgresql:// and postgres:// URLs open a PostgresCheckpointer on that database."""
    store = await open_store(as_url(pg_dsn, scheme))
    try:
        assert isinstance(store, PostgresCheckpointer)
        await store.append(ev("m1"))
        async with PostgresCheckpointer(pg_dsn) as direct:
            assert len(await direct.load("run-1")) == 1
    finally:
        await store.close()


async def test_open_store_sqlite_urls_and_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sqlite:/// is relative, sqlite://// absolute, a plain path is SQLite too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    cases = {
        "sqlite:///sub/rel.db": tmp_path / "sub" / "rel.db",
        f"sqlite:///{tmp_path}/abs.db": tmp_path / "abs.db",
        "plain.db": tmp_path / "plain.db",
        str(tmp_path / "other.db"): tmp_path / "other.db",
    }
    for url, path in cases.items():
        store = await open_store(url)
        assert isinstance(store, SqliteCheckpointer)
        await store.append(ev("m1"))
        await store.close()
        assert path.exists(), url
    store = await open_store("sqlite:///fast.db?durability=process")
    assert isinstance(store, SqliteCheckpointer)
    assert store.durability == "process"
    await store.close()


@pytest.mark.parametrize(
    "url",
    [
        "mysql://root@localhost/db",
        f"mysql://root:{SECRET}@localhost/db",
        "sqlite:runs.db",
        "sqlite://",
        "sqlite:///",
        "sqlite:///x.db?durability=sometimes",
        "sqlite:///x.db?colour=blue",
        "",
    ],
)
async def test_open_store_refuses_other_urls(url: str) -> None:
    """Unknown schemes and malformed SQLite URLs are UsageErrors saying what is supported."""
    with pytest.raises(UsageError) as info:
        await open_store(url)
    assert SECRET not in str(info.value)
    if url.startswith("mysql") or url in ("", "sqlite:runs.db"):
        assert "sqlite:///" in str(info.value)
        assert "postgresql://" in str(info.value)
