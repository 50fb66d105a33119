"""The quick-start graph through ``ChatOpenAI`` against a fake OpenAI-compatible server
that counts its invoices, in real processes killed with SIGKILL at each crash point and
resumed until the run closes: each generation billed once per step (twice only for a
kill inside the model call, and then under the same idempotency key, which
``asiento gateway`` answers from the generation it kept), each effect once or
``UncertainEffect``, the final state equal to an uninterrupted run's."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from asiento import SqliteCheckpointer, resolve
from providers.fake_servers import Answer, FakeProvider

from .langgraph_graph import SCRIPT, lines

CHILD = Path(__file__).with_name("langgraph_child.py")
ANSWERS = [Answer(text, tuple(calls)) for text, calls in SCRIPT]


def _pass(
    tmp: Path, url: str, run_id: str, crash_at: str | None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ASIENTO_CRASH_AT"}
    if crash_at:
        env["ASIENTO_CRASH_AT"] = crash_at
    argv = [sys.executable, str(CHILD), str(tmp / "runs.db"), str(tmp / "ledger"), url, run_id]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)


def _drive(
    tmp: Path, url: str, run_id: str, crashes: list[str]
) -> tuple[list[dict[str, Any]], int]:
    """Passes until the run closes: one killed at each of ``crashes``, then clean ones
    (a person settles an uncertain effect as happened, as `asiento resolve` would)."""
    ended: list[dict[str, Any]] = []
    kills = 0
    for crash_at in [*crashes, None, None, None]:
        done = _pass(tmp, url, run_id, crash_at)
        if done.returncode == -signal.SIGKILL:
            kills += 1
            ended.append({"ended": "killed", "at": crash_at})
            continue
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.strip().splitlines()[-1])
        ended.append(out)
        if out["ended"] == "closed":
            return ended, kills
        asyncio.run(_settle(tmp / "runs.db", run_id, out["step"]))
    pytest.fail(f"run {run_id} never closed: {ended}")


async def _settle(db: Path, run_id: str, step_id: str) -> None:
    store = SqliteCheckpointer(db)
    await resolve(
        store, run_id, step_id, happened=True, result="refund of order 42 to ana issued", by="ops"
    )
    await store.close()


@pytest.mark.parametrize(
    "crashes",
    [
        ["after_tool@2"],  # between the refund's effect and its record
        # one pass after another: between super-steps (the lookup recorded, the next ask
        # not made), during a model call (answered, not recorded), then after the refund
        ["after_result@1", "inside_model_call@1", "after_tool@1"],
    ],
    ids=["effect-before-record", "three-kills-in-a-row"],
)
def test_killed_passes_bill_each_generation_once_and_apply_each_effect_once(
    tmp_path: Path, crashes: list[str]
) -> None:
    (tmp_path / "clean").mkdir()
    with FakeProvider(ANSWERS) as clean_provider:  # the uninterrupted run, for its state
        clean, _ = _drive(tmp_path / "clean", clean_provider.openai_url, "r", [])
    with FakeProvider(ANSWERS) as provider:
        ended, kills = _drive(tmp_path, provider.openai_url, "r", crashes)
        keys = list(provider.generations)
    assert kills == len(crashes), ended
    assert ended[-1]["messages"] == clean[-1]["messages"]
    per_key = Counter(keys)
    assert len(per_key) == len(SCRIPT)  # one key per model step, the same on every pass
    repaid = crashes.count("inside_model_call") + sum(
        c.startswith("inside_model_call@") for c in crashes
    )
    assert sum(per_key.values()) == len(SCRIPT) + repaid  # re-asked only when killed inside
    refunds = [line for line in lines(tmp_path / "ledger") if line.startswith("refund")]
    assert refunds == ["refund 42 ana"]  # once, however the passes died
