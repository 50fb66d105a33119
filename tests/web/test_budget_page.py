"""The run page shows a run stopped on its budget and lets a person raise it."""

from __future__ import annotations

import re
from pathlib import Path

from asiento import Budget, FinalStep, Phase, SqliteCheckpointer
from asiento.testing import ScriptedGateway
from sqlite_files import Journal
from test_agent import RUN
from test_budget import STEPS, agent, drive, script, stopped

from .test_app import READ, banner, login, page


async def test_raising_the_budget_on_the_page_then_resuming_pays_only_new_calls(
    tmp_path: Path,
) -> None:
    db = tmp_path / "runs.db"
    journal = Journal(db)
    await stopped(journal, calls=2)
    for store in journal.opened:
        await store.close()
    with page(db) as client:
        shown = client.get(f"/runs/{RUN}", headers=READ).text
        assert "Stopped on its budget" in shown
        assert "max_model_calls\n  spent 2 of 2" in shown or "spent 2 of 2" in shown
        login(client)
        html = client.get(f"/runs/{RUN}").text
        csrf = re.search(r'name="csrf" value="([^"]*)"', html)
        assert csrf is not None
        form = {"run_id": RUN, "csrf": csrf.group(1), "max_model_calls": "50", "reason": "ok"}
        bad = client.post("/budget", data={**form, "max_model_calls": "lots"})
        assert bad.status_code == 400
        assert "must be a number" in bad.text
        huge = client.post("/budget", data={**form, "max_model_calls": "9" * 400})
        assert huge.status_code == 400, huge.text
        assert "must be at most 9223372036854775807" in huge.text
        answer = client.post("/budget", data=form)
        assert answer.status_code == 200, answer.text  # followed to the run page
        assert "budget raised to max_model_calls=50 by ana" in banner(answer.text)
        again = client.post("/budget", data=form)
        assert again.status_code == 409
        assert "not stopped on its budget" in again.text
    store = SqliteCheckpointer(db)
    raises = [e for e in await store.load(RUN) if e.phase is Phase.APPROVAL]
    assert [e.step_id for e in raises] == ["budget1"]
    gw = ScriptedGateway(script())
    steps = await drive(agent(Budget(max_model_calls=2)), gw, store)
    await store.close()
    assert isinstance(steps[-1], FinalStep)
    assert len(gw.calls) == STEPS + 1 - 2
