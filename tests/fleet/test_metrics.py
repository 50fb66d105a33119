"""A worker's metrics (docs/fleet.md, "Metrics"): recorded on the OpenTelemetry API, read
back with the real SDK's in-memory reader, and scraped from ``asiento worker
--metrics-port`` over HTTP on 127.0.0.1.

OpenTelemetry's global ``MeterProvider`` can be set once per process: the ``reader``
fixture sets it once for the session, and each test compares the figures after with
those before (the reader's sums are cumulative).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from asiento import (
    Agent,
    App,
    ModelResponse,
    Quota,
    RunStatus,
    SqliteCheckpointer,
    ToolCall,
    Worker,
    submit,
    tool,
)
from asiento.journal.base import Checkpointer
from asiento.lease import Holder
from asiento.testing import ScriptedGateway
from otel_readings import Key, figures, grew, histogram

RELEASES: Key = ("asiento_worker_commits_total", (("operation", "release"),))
APPENDS: Key = ("asiento_worker_commits_total", (("operation", "append"),))

APP = '''
import asyncio
import contextlib
from asiento import Agent, App, ModelResponse, ToolCall, tool
from asiento.journal.base import Checkpointer
from asiento.lease import Holder
from asiento.testing import ScriptedGateway

SCRIPT = [
    ModelResponse(tool_calls=[ToolCall(name="pay", arguments={"amount": 120})]),
    ModelResponse(text="paid"),
]

@tool(idempotent=True)
async def pay(amount: int) -> str:
    """Pay an amount."""
    return "tx-1"

app = App(agents={"billing": Agent(tools=[pay])}, gateway=lambda: ScriptedGateway(SCRIPT))
'''


async def charged(store: Checkpointer, run_id: str, claims: int) -> None:
    """Submit ``run_id`` and count ``claims`` failed claims against it (a test's holder)."""
    await submit(store, run_id, "go")
    for _ in range(claims):
        claim = await store.claim(Holder.here(), ttl=5, max_attempts=claims + 1)
        assert claim is not None
        assert claim.lease.run_id == run_id
        await store.release(claim.lease)


async def test_a_worker_at_concurrency_4_reports_what_it_did(
    reader: InMemoryMetricReader, sqlite_path: Path
) -> None:
    """8 runs at concurrency 4: claims, commits by operation, runs in flight, renewal lag
    and parks by cause (max_attempts, no_agent) are what the worker and the store did.

    The poisoned run comes already claimed twice (its passes failed): the worker's
    first claim parks it for max_attempts inside the store's claim.
    """

    @tool(idempotent=True)
    async def slow(n: int) -> int:
        """Sleeps past two renewals of a 0.6 s lease."""
        await asyncio.sleep(0.5)
        return n

    script = [
        ModelResponse(tool_calls=[ToolCall(name="slow", arguments={"n": 1})]),
        ModelResponse(text="done"),
    ]
    app = App(
        agents={"default": Agent(tools=[slow])},
        gateway=lambda: ScriptedGateway(script),
        lease_ttl=0.6,
        max_attempts=2,
    )
    store = SqliteCheckpointer(sqlite_path)
    await charged(store, "poison", 2)
    healthy = [f"r{n}" for n in range(8)]
    for run_id in healthy:
        await submit(store, run_id, "go")
    await submit(store, "stray", "go", agent="ghost")
    before = figures(reader)
    worker = Worker(store, app, poll=0.01, concurrency=4)
    samples: list[dict[Key, Any]] = []

    async def sample() -> None:
        for _ in range(600):  # at most 30 s
            samples.append(figures(reader))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    try:
        await worker.run(until_idle=True, max_seconds=60)
    finally:
        sampler.cancel()
    after = figures(reader)
    by_id = {r.run_id: r for r in await store.runs()}
    records = sum([len(await store.load(run_id)) for run_id in healthy])
    await store.close()

    assert {by_id[r].status for r in healthy} == {RunStatus.CLOSED}
    assert by_id["poison"].status is RunStatus.PARKED
    assert by_id["stray"].status is RunStatus.PARKED
    claims = grew(before, after, "asiento.worker.claims")
    assert claims == worker.stats.claimed == 8 + 1  # the stray run too, the poison not
    commits = "asiento.worker.commits"
    # Two commits for the model+tool step (intent, then result), one for the answer.
    assert grew(before, after, commits, operation="append") == 3 * 8 < records
    # A closed run's lease goes with its closing append: only the stray's claim is released.
    assert grew(before, after, commits, operation="release") == claims - 8 == 1
    assert grew(before, after, commits, operation="claim") >= 3
    assert grew(before, after, commits, operation="set_status") == 1  # the stray's park
    renewals = grew(before, after, commits, operation="renew")
    assert renewals >= 8
    assert grew(before, after, "asiento.worker.runs_in_flight") == 0
    widest = max(grew(before, s, "asiento.worker.runs_in_flight") for s in samples)
    assert 1 < widest <= 4
    lags, worst = histogram(before, after, "asiento.lease.renewal_lag")
    assert lags == renewals
    assert 0 <= worst < 0.6
    windows = [v for s in samples for (n, _), v in s.items() if n.endswith("renewal_lag.max")]
    assert windows, "no renewal lag was shown as the max of a window"
    assert max(windows) <= worst
    assert grew(before, after, "asiento.runs.parked", cause="max_attempts") == 1
    assert grew(before, after, "asiento.runs.parked", cause="no_agent") == 1
    assert grew(before, after, "asiento.runs.parked", cause="max_lapses") == 0


async def test_a_claim_that_parks_runs_counts_them_by_cause_on_sqlite(
    reader: InMemoryMetricReader, sqlite_store: Checkpointer
) -> None:
    """A claim parks one run for max_attempts and one for max_lapses: each counted once."""
    await parks_by_cause(reader, sqlite_store)


async def test_a_claim_that_parks_runs_counts_them_by_cause_on_postgres(
    reader: InMemoryMetricReader, pg_store: Checkpointer
) -> None:
    """The same on PostgreSQL, whose claim parks and leases in one statement."""
    await parks_by_cause(reader, pg_store)


async def parks_by_cause(reader: InMemoryMetricReader, store: Checkpointer) -> None:
    await submit(store, "lapsing", "go")
    lapsed = await store.claim(Holder.here(), ttl=1.0, max_attempts=5)  # its holder dies
    assert lapsed is not None
    assert lapsed.lease.run_id == "lapsing"
    await charged(store, "poison", 2)  # while "lapsing" is still held
    await asyncio.sleep(1.2)
    before = figures(reader)
    taken = await store.claim_many(Holder.here(), limit=4, ttl=5, max_attempts=2, max_lapses=1)
    after = figures(reader)

    assert taken == []
    assert {r.run_id: r.status for r in await store.runs()} == {
        "poison": RunStatus.PARKED,
        "lapsing": RunStatus.PARKED,
    }
    assert grew(before, after, "asiento.runs.parked", cause="max_attempts") == 1
    assert grew(before, after, "asiento.runs.parked", cause="max_lapses") == 1


async def test_a_request_that_waits_in_a_quota_records_its_wait(
    reader: InMemoryMetricReader,
) -> None:
    """Two requests through a Quota of one: the second's wait (~0.2 s) is recorded."""
    quota = Quota(1)
    before = figures(reader)

    async def request() -> None:
        async with quota.slot():
            await asyncio.sleep(0.2)

    await asyncio.gather(request(), request())
    waits, worst = histogram(before, figures(reader), "asiento.quota.wait")
    assert waits == 2
    assert 0.15 <= worst < 5


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> dict[Key, float]:
    """The asiento samples of the worker's /metrics page, by name and labels."""
    page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found: dict[Key, float] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name.startswith("asiento_"):
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k == "operation"))
                found[(s.name, labels)] = s.value
    return found


async def queued(tmp_path: Path, *run_ids: str) -> Path:
    """A journal file with ``run_ids`` submitted to the billing agent, and its app module."""
    (tmp_path / "billing.py").write_text(APP)
    store = SqliteCheckpointer(tmp_path / "runs.db")
    for run_id in run_ids:
        await submit(store, run_id, "pay 120", agent="billing")
    await store.close()
    return tmp_path / "runs.db"


def worker_argv(*extra: str) -> list[str]:
    return [sys.executable, "-m", "asiento", "worker", "--app", "billing:app", *extra]


@pytest.fixture
def env() -> dict[str, str]:
    """This environment without a store or crash points."""
    drop = {"ASIENTO_CRASH_AT", "ASIENTO_STORE"}
    return {k: v for k, v in os.environ.items() if k not in drop}


async def test_asiento_worker_serves_its_metrics_for_a_scrape(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """`asiento worker --metrics-port P` drains 3 runs; /metrics shows 3 claims and the
    commits the store holds; SIGTERM stops it with 75."""
    db = await queued(tmp_path, "a", "b", "c")
    port = free_port()
    argv = worker_argv("--poll", "0.05", "--metrics-port", str(port))
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        seen: dict[Key, float] = {}
        deadline = time.monotonic() + 30
        for _ in range(300):
            if time.monotonic() > deadline or proc.poll() is not None:
                break
            with contextlib.suppress(httpx.TransportError):  # not listening yet
                seen = scrape(port)
            if seen.get(APPENDS) == 3 * 3:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate(timeout=5)[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    store = SqliteCheckpointer(db)
    records = sum([len(await store.load(run_id)) for run_id in "abc"])
    statuses = {r.status for r in await store.runs()}
    await store.close()
    assert statuses == {RunStatus.CLOSED}
    assert seen[("asiento_worker_claims_total", ())] == 3
    # Two commits for each run's model+tool step (intent, then result), one for its answer.
    assert seen[APPENDS] == 3 * 3 < records
    assert RELEASES not in seen  # each run's closing append gave its lease up
    assert seen[("asiento_worker_commits_total", (("operation", "claim"),))] >= 1
    assert seen[("asiento_worker_runs_in_flight", ())] == 0
    assert f"metrics at http://127.0.0.1:{port}/metrics" in err


async def test_a_metrics_port_in_use_stops_the_worker_before_it_claims(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """--metrics-port on a port something listens on: one line naming it, exit 1, no claim."""
    db = await queued(tmp_path, "a")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = worker_argv("--until-idle", "--metrics-port", str(port))
        done = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
        )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"cannot serve metrics on 127.0.0.1 port {port}" in done.stderr
    store = SqliteCheckpointer(db)
    info = await store.run("a")
    await store.close()
    assert info is not None
    assert (info.status, info.fence, info.attempts) == (RunStatus.RUNNING, 0, 0)


async def test_metrics_without_the_extra_name_the_install(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """Without the Prometheus exporter, --metrics-port fails at once naming asiento[metrics]."""
    await queued(tmp_path, "a")
    hide = (
        "import sys; sys.modules['opentelemetry.exporter.prometheus'] = None;"
        " from asiento.cli import main; main()"
    )
    argv = [sys.executable, "-c", hide, "worker", "--app", "billing:app"]
    argv += ["--until-idle", "--metrics-port", str(free_port())]
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "pip install 'asiento[metrics]'" in done.stderr


async def test_runs_waiting_for_a_person_are_read_from_the_store_when_collected(
    reader: InMemoryMetricReader, sqlite_path: Path
) -> None:
    """asiento.runs.waiting: a run suspended for an approval and one stopped uncertain,
    read from the running worker's store when a reader (another thread) collects."""
    from asiento import require_approval_for

    @tool
    def pay(amount: int) -> str:
        """Pay."""
        return "paid"

    script = [ModelResponse(tool_calls=[ToolCall(name="pay", arguments={"amount": 1})])]
    agent = Agent(tools=[pay], policy=require_approval_for("pay"))
    app = App(agents={"default": agent}, gateway=lambda: ScriptedGateway(script))
    store = SqliteCheckpointer(sqlite_path)
    await submit(store, "asks", "go")
    await submit(store, "other", "go")
    await store.set_status("other", RunStatus.UNCERTAIN, reason="a test's")
    worker = Worker(store, app, poll=0.01)
    running = asyncio.create_task(worker.run(max_seconds=10))
    try:
        for _ in range(200):  # at most 10 s: the run stops for its approval
            info = await store.run("asks")
            if info is not None and info.status is RunStatus.SUSPENDED:
                break
            await asyncio.sleep(0.05)
        seen = await asyncio.to_thread(figures, reader)  # a reader's thread, as a scrape
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    after_stop = await asyncio.to_thread(figures, reader)
    await store.close()
    assert seen[("asiento.runs.waiting", (("status", "suspended"),))] == 1
    assert seen[("asiento.runs.waiting", (("status", "uncertain"),))] == 1
    assert ("asiento.runs.waiting", (("status", "suspended"),)) not in after_stop
