"""The run index shows each run's budget beside what it spent, and never contradicts the
journal: the budget columns are what the journal's records say (a budgeted run's first
new call of each pass, a stop, a raise), kept by every append and backfilled by the
migration that adds them, on SQLite and PostgreSQL; ``asiento runs`` and the web page
list them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from asiento import (
    Budget,
    BudgetStep,
    Checkpointer,
    FinalStep,
    RunInfo,
    SqliteCheckpointer,
    StepEvent,
    raise_budget,
)
from asiento import budget as budgets
from asiento.journal.postgres import PostgresCheckpointer
from asiento.testing import ScriptedGateway
from asiento.web import create_app
from journal.test_migrations import Recorder, index_rows, postgres_at, sqlite_at
from test_agent import RUN
from test_budget import agent, drive, script

BACKENDS = ["sqlite", "postgres"]


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Checkpointer]:
    """A real journal: an SQLite file, or a schema on the test PostgreSQL."""
    opened: Checkpointer
    if request.param == "sqlite":
        opened = SqliteCheckpointer(request.getfixturevalue("tmp_path") / "runs.db")
    else:
        opened = await PostgresCheckpointer.connect(request.getfixturevalue("pg_dsn"))
    yield opened
    await opened.close()


def shown(info: RunInfo | None) -> tuple[Any, ...]:
    assert info is not None
    return (info.budget_cost, info.budget_tokens, info.budget_model_calls)


def folded(events: list[StepEvent]) -> tuple[Any, ...]:
    """The budget the journal's records say, folded by ``budget.after`` (the one rule)."""
    limits = budgets.after(None, budgets.noted(events)) or {}
    return tuple(limits.get(name) for name in budgets.LIMITS)


async def test_a_budgeted_run_shows_its_budget_before_any_stop(store: Checkpointer) -> None:
    """A budgeted run that never stops shows the budget its first call recorded."""
    steps = await drive(agent(Budget(max_model_calls=50, max_tokens=5000)), gw(), store)
    assert isinstance(steps[-1], FinalStep)
    info = await store.run(RUN)
    assert shown(info) == (None, 5000, 50)
    assert shown(info) == folded(await store.load(RUN))
    assert info is not None
    assert info.budgeted


async def test_a_stop_and_a_raise_show_in_the_index(store: Checkpointer) -> None:
    """Stopped on its budget, the index shows the limits it stopped on and what it
    spent; a person's raise shows at once, before any new pass; every value is what
    the journal's records fold to."""
    steps = await drive(agent(Budget(max_model_calls=3, max_tokens=1000)), gw(), store)
    assert isinstance(steps[-1], BudgetStep)
    info = await store.run(RUN)
    assert shown(info) == (None, 1000, 3)
    assert info is not None
    assert (info.model_calls, info.input_tokens + info.output_tokens) == (3, 45)
    await raise_budget(store, RUN, by="ana", max_model_calls=5, max_cost=9.0)
    assert shown(await store.run(RUN)) == (None, 1000, 5)  # an unset limit stays unset
    assert shown(await store.run(RUN)) == folded(await store.load(RUN))
    steps = await drive(agent(Budget(max_model_calls=3, max_tokens=1000)), gw(), store)
    assert isinstance(steps[-1], BudgetStep)
    assert shown(await store.run(RUN)) == (None, 1000, 5)
    assert shown(await store.run(RUN)) == folded(await store.load(RUN))


async def test_a_run_without_a_budget_shows_none(store: Checkpointer) -> None:
    """No budget in code: nothing is recorded and the index shows no budget."""
    await drive(agent(None), gw(), store)
    info = await store.run(RUN)
    assert shown(info) == (None, None, None)
    assert info is not None
    assert not info.budgeted
    assert all("budget" not in e.payload for e in await store.load(RUN))


def gw() -> ScriptedGateway:
    return ScriptedGateway(script())


# -- journals written before the budget columns ----------------------------------------


async def stopped_and_raised() -> Recorder:
    """A run stopped on its budget and raised, as the loop records it, with no budget in
    its model results (as the asiento before the budget columns wrote them)."""
    recorder = Recorder()
    await drive(agent(Budget(max_model_calls=2, max_cost=1.5)), gw(), recorder)
    await raise_budget(recorder, RUN, by="ana", max_model_calls=4)
    recorder.rows = [_without_budget(row) for row in recorder.rows]
    return recorder


def _without_budget(row: tuple[Any, ...]) -> tuple[Any, ...]:
    run_id, step_id, phase, decision, payload, created_at = row
    record = json.loads(payload)
    if phase == "result" and "response" in record:
        record.pop("budget", None)
        payload = json.dumps(record, separators=(",", ":"))
    return (run_id, step_id, phase, decision, payload, created_at)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_upgraded_journal_shows_the_budgets_its_records_name(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """A journal at the schema before the budget columns, holding a stop and a raise,
    upgrades with each run's budget folded from its records: the stop's limits, raised."""
    recorder = await stopped_and_raised()
    index = index_rows(await recorder.runs(), 2)
    opened: Checkpointer
    if backend == "sqlite":
        path = request.getfixturevalue("tmp_path") / "runs.db"
        sqlite_at(path, 4, recorder.rows, index)
        opened = SqliteCheckpointer(path)
    else:
        dsn = request.getfixturevalue("pg_dsn")
        postgres_at(dsn, 5, recorder.rows, index)
        opened = await PostgresCheckpointer.connect(dsn, max_size=1)
    try:
        assert shown(await opened.run(RUN)) == (1.5, None, 4)
        assert shown(await opened.run(RUN)) == folded(await opened.load(RUN))
    finally:
        await opened.close()


# -- what people see ---------------------------------------------------------------------


async def stopped_file(path: Path) -> None:
    db = SqliteCheckpointer(path)
    try:
        await drive(agent(Budget(max_model_calls=3, max_tokens=1000)), gw(), db)
        await raise_budget(db, RUN, by="ana", max_model_calls=5)
    finally:
        await db.close()


async def test_asiento_runs_shows_spent_against_the_budget(tmp_path: Path) -> None:
    """``asiento runs`` (a real process) lists what the run spent against each limit."""
    path = tmp_path / "runs.db"
    await stopped_file(path)
    env = {**os.environ, "COLUMNS": "250"}
    argv = [sys.executable, "-m", "asiento", "runs", "--store", str(path)]
    table = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=True)
    assert "spent/budget" in table.stdout
    assert "3/5 calls, 45/1,000 tokens" in table.stdout
    listed = subprocess.run(
        [*argv, "--json"], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    (run,) = json.loads(listed.stdout)
    assert (run["budget_model_calls"], run["budget_tokens"], run["budget_cost"]) == (5, 1000, None)


async def test_the_web_list_shows_spent_against_the_budget(tmp_path: Path) -> None:
    """The web page's run list has the same cell."""
    path = tmp_path / "runs.db"
    await stopped_file(path)
    token = "test-token-0123456789abcdef"
    app = create_app(str(path), token=token)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        page = client.get("/", headers={"authorization": f"Bearer {token}"})
    assert page.status_code == 200
    assert "spent/budget" in page.text
    assert "3/5 calls, 45/1,000 tokens" in page.text
