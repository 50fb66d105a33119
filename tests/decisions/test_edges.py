"""Where people meet runs: abandon stops a live driver, a closed run stays closed,
a resolution is not refused for a dead holder (issue 12, items 1 to 3).

Real processes throughout: the driver is a child process paying with a real
slow tool, the person is the ``asiento`` command in another process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asiento import (
    Agent,
    App,
    ApprovalStep,
    ModelResponse,
    RunClosed,
    RunStatus,
    Session,
    SqliteCheckpointer,
    ToolCall,
    Worker,
    abandon,
    approve,
    open_store,
    require_approval_for,
    submit,
    tool,
)
from asiento.testing import ScriptedGateway

DRIVER = Path(__file__).with_name("driver.py")
BACKENDS = ["sqlite", "postgres"]


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store both the test and its child processes open: an SQLite file or a DSN."""
    if request.param == "sqlite":
        return str(tmp_path / "runs.db")
    return str(request.getfixturevalue("pg_dsn"))


def asiento_cli(*args: str, store: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ASIENTO_STORE", "ASIENTO_CRASH_AT")}
    argv = [sys.executable, "-m", "asiento", *args, "--store", store]
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


@contextlib.contextmanager
def driving(store: str, folder: Path) -> Iterator[subprocess.Popen[str]]:
    """The paying driver in a child process; killed and reaped at the end, whatever happened."""
    argv = [sys.executable, str(DRIVER), store, "pay-6", str(folder)]
    driver = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield driver
    finally:
        if driver.poll() is None:
            driver.kill()
        if driver.stdout is not None and not driver.stdout.closed:
            driver.communicate(timeout=60)


def charges(folder: Path) -> list[dict[str, float]]:
    path = folder / "charges.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(probe: object, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if probe():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# -- abandon stops the run -----------------------------------------------------------------


async def test_abandon_stops_a_live_driver(store_url: str, tmp_path: Path) -> None:
    """Once `asiento abandon` returns, no payment of the run starts, and the driver stops
    with RunAbandoned naming who abandoned it (failed before: 4 of 6 payments started
    after abandon returned, then a misleading DuplicateRecord)."""
    store = await open_store(store_url)
    await store.submit("pay-6", "pay six times")  # so that the run exists before the driver
    await store.close()
    with driving(store_url, tmp_path) as driver:
        wait_for(lambda: len(charges(tmp_path)) >= 2, "two payments")
        proc = asiento_cli("abandon", "pay-6", "--by", "ana", "--reason", "stop", store=store_url,
                           cwd=tmp_path)  # fmt: skip
        returned = time.time()  # abandon() returned before the command exited
        out, err = driver.communicate(timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "is closed: abandoned by ana: stop" in proc.stdout
    started_after = [c for c in charges(tmp_path) if c["at"] > returned]
    assert started_after == [], (started_after, charges(tmp_path))
    ended = json.loads(out.strip().splitlines()[-1])
    assert ended["ended"] == "abandoned", (ended, err)
    assert "abandoned by ana: stop" in ended["message"]
    assert "DuplicateRecord" not in err + ended["message"]
    store = await open_store(store_url)
    try:
        [info] = [r for r in await store.runs() if r.run_id == "pay-6"]
        assert info.status is RunStatus.CLOSED
        assert info.lease_owner is None
        final = await store.final("pay-6")
        assert final is not None
        assert final.payload["abandoned"]
    finally:
        await store.close()


async def test_abandon_names_the_step_in_flight(tmp_path: Path) -> None:
    """The command lists the step that was submitted with no outcome when it closed the run."""
    db = tmp_path / "runs.db"
    with driving(str(db), tmp_path) as driver:
        wait_for(lambda: len(charges(tmp_path)) >= 1, "a payment")
        driver.send_signal(signal.SIGSTOP)  # stopped inside the payment, its result unrecorded
        proc = asiento_cli("abandon", "pay-6", "--by", "ana", "--reason", "stop", store=str(db),
                           cwd=tmp_path)  # fmt: skip
        driver.send_signal(signal.SIGCONT)
        out, _ = driver.communicate(timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "step 'm1.t1' (charge) was in flight" in proc.stdout, proc.stdout
    ended = json.loads(out.strip().splitlines()[-1])
    assert ended["ended"] == "abandoned"
    assert "'m1.t1'" in ended["message"]  # the outcome it had and could not record
    shown = asiento_cli("show", "pay-6", store=str(db), cwd=tmp_path)
    assert "in flight: m1.t1" in shown.stdout, shown.stdout
    assert "asiento resolve" not in shown.stdout  # a closed run waits for nobody


# -- a closed run stays closed ------------------------------------------------------------


def pay_agent(paid: list[int]) -> Agent:
    @tool()
    def pay(amount: int) -> str:
        """Pay an amount."""
        paid.append(amount)
        return "paid"

    return Agent(tools=[pay], policy=require_approval_for("pay"))


PAY = [ModelResponse(tool_calls=[ToolCall(name="pay", arguments={"amount": 5})]), ModelResponse()]


async def test_decisions_on_a_closed_run_are_refused(store_url: str, tmp_path: Path) -> None:
    """approve / deny on an abandoned run are refused with a clear error and write nothing;
    the run stays closed and no worker claims it (failed before: the run reopened)."""
    paid: list[int] = []
    store = await open_store(store_url)
    await submit(store, "r", "pay", agent="payer")
    session = Session("r", ScriptedGateway(PAY), store)
    steps = [s async for s in pay_agent(paid).run("pay", session=session)]
    waiting = steps[-1]
    assert isinstance(waiting, ApprovalStep)
    await abandon(store, "r", by="ana", reason="not needed")
    before = await store.load("r")
    await store.close()

    for args in (["approve", "r", "m1.t1", "--by", "bo"],
                 ["deny", "r", "m1.t1", "--by", "bo", "--reason", "no"]):  # fmt: skip
        proc = asiento_cli(*args, store=store_url, cwd=tmp_path)
        assert proc.returncode == 1, proc.stdout
        assert "is closed" in proc.stderr
        assert "Traceback" not in proc.stderr

    store = await open_store(store_url)
    try:
        with pytest.raises(RunClosed):
            await approve(store, "r", "m1.t1", by="bo", fingerprint=waiting.fingerprint)
        assert await store.load("r") == before
        [info] = await store.runs()
        assert info.status is RunStatus.CLOSED
        app = App(agents={"payer": pay_agent(paid)}, gateway=ScriptedGateway(PAY))
        worker = Worker(store, app, poll=0.01)
        assert not await worker.run_once()
        assert paid == []
    finally:
        await store.close()


async def test_resolve_on_a_closed_run_is_refused(tmp_path: Path) -> None:
    """resolve on an abandoned run whose effect was in flight is refused and writes nothing."""
    db = tmp_path / "runs.db"
    with driving(str(db), tmp_path) as driver:
        wait_for(lambda: len(charges(tmp_path)) >= 1, "a payment")
        driver.kill()  # inside the payment: submitted, no outcome
        driver.wait(timeout=30)
    store = SqliteCheckpointer(db)
    await abandon(store, "pay-6", by="ana", reason="give up")
    before = await store.load("pay-6")
    proc = asiento_cli("resolve", "pay-6", "m1.t1", "--not-happened", "--by", "bo",
                       store=str(db), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 1
    assert "is closed" in proc.stderr
    assert await store.load("pay-6") == before
    [info] = await store.runs()
    assert info.status is RunStatus.CLOSED
    await store.close()


async def test_a_claim_that_finds_its_run_closed_gives_it_back(tmp_path: Path) -> None:
    """A run whose index an older asiento reopened (closed in the journal, running in the
    index) is claimed once: the claim marks it closed and releases the lease, and no
    worker claims it again (failed before: claimed again and again until parked)."""
    import sqlite3

    db = tmp_path / "runs.db"
    paid: list[int] = []
    store = SqliteCheckpointer(db)
    await submit(store, "r", "pay", agent="payer")
    app = App(agents={"payer": Agent()}, gateway=ScriptedGateway([ModelResponse(text="done")]))
    assert await Worker(store, app, poll=0.01).run_once()
    assert await store.final("r") is not None
    with sqlite3.connect(db) as raw:  # what `asiento approve` did to closed runs before
        raw.execute("UPDATE runs SET status = 'running' WHERE run_id = 'r'")
    worker = Worker(store, app, poll=0.01)
    assert await worker.run_once()  # the claim finds the run closed
    [info] = await store.runs()
    assert (info.status, info.lease_owner) == (RunStatus.CLOSED, None)
    assert not await worker.run_once()
    assert not await Worker(store, app, poll=0.01).run_once()
    assert paid == []
    await store.close()


# -- resolve: an atomic check of who drives the run -----------------------------------------


async def test_resolve_is_not_refused_for_a_dead_holder(store_url: str, tmp_path: Path) -> None:
    """A driver SIGKILLed inside an effect holds a live lease no process is behind:
    `asiento resolve` takes it over instead of saying the run is being driven (failed
    before: refused until the lease expired)."""
    store = await open_store(store_url)
    await store.submit("pay-6", "pay six times")
    await store.close()
    with driving(store_url, tmp_path) as driver:
        wait_for(lambda: len(charges(tmp_path)) >= 1, "a payment")
        driver.kill()
        driver.wait(timeout=30)
    proc = asiento_cli("resolve", "pay-6", "m1.t1", "--happened", "--by", "ana",
                       store=store_url, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    store = await open_store(store_url)
    try:
        [resolution] = [e for e in await store.load("pay-6") if e.phase == "resolution"]
        assert resolution.payload["happened"] is True
        [info] = [r for r in await store.runs() if r.run_id == "pay-6"]
        assert (info.status, info.lease_owner) == (RunStatus.RUNNING, None)
    finally:
        await store.close()


async def test_resolve_is_refused_while_a_live_session_drives(tmp_path: Path) -> None:
    """A live driver may still record the step's own outcome: resolve is refused and
    writes nothing, atomically with the lease (the driver is stopped, not dead)."""
    db = tmp_path / "runs.db"
    with driving(str(db), tmp_path) as driver:
        wait_for(lambda: len(charges(tmp_path)) >= 1, "a payment")
        driver.send_signal(signal.SIGSTOP)
        before = await SqliteCheckpointer(db).load("pay-6")
        proc = asiento_cli("resolve", "pay-6", "m1.t1", "--not-happened", "--by", "ana",
                           store=str(db), cwd=tmp_path)  # fmt: skip
        after = await SqliteCheckpointer(db).load("pay-6")
        driver.send_signal(signal.SIGCONT)
        driver.communicate(timeout=60)
    assert proc.returncode == 1
    assert "being driven right now" in proc.stderr
    assert after == before
    assert [c["n"] for c in charges(tmp_path)] == [0, 1, 2, 3, 4, 5]  # once each
