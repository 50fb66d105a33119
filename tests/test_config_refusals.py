"""Configuration a worker or a run cannot work with is refused when it is given, naming
the parameter: a lease of 0 s, a max_attempts of 0 or an agents list would otherwise fail
every run's pass in turn, until each was parked for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asiento import (
    Agent,
    App,
    Session,
    SqliteCheckpointer,
    UsageError,
    require_approval_for_destructive,
    tool,
)
from asiento.testing import ScriptedGateway


@tool
def send(to: str) -> str:
    """Send a message."""
    return to


def _app(**options: Any) -> App:
    return App(agents={"default": Agent(tools=[send])}, gateway=ScriptedGateway([]), **options)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"lease_ttl": 0}, r"App\(lease_ttl=\.\.\.\) must be a finite number of seconds > 0"),
        ({"lease_ttl": "30"}, r"App\(lease_ttl=\.\.\.\) takes seconds \(a number > 0\), got '30'"),
        ({"lease_ttl": None}, r"App\(lease_ttl=\.\.\.\) takes seconds"),
        ({"max_attempts": 0}, r"App\(max_attempts=\.\.\.\) takes an int >= 1, got 0"),
        ({"max_attempts": 2.5}, r"App\(max_attempts=\.\.\.\) takes an int >= 1, got 2\.5"),
        ({"max_lapses": -1}, r"App\(max_lapses=\.\.\.\) takes an int >= 0, got -1"),
    ],
)
def test_an_app_a_worker_could_not_run_is_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        _app(**options)


@pytest.mark.parametrize("agents", [[Agent()], {"default": "refunds"}, {1: Agent()}])
def test_agents_that_are_not_named_agents_are_refused(agents: Any) -> None:
    with pytest.raises(UsageError, match=r"App\(agents=\.\.\.\) takes a mapping of names"):
        App(agents=agents, gateway=ScriptedGateway([]))


async def test_a_session_lease_or_wait_that_is_not_seconds_is_refused(tmp_path: Path) -> None:
    store = SqliteCheckpointer(tmp_path / "runs.db")
    try:
        with pytest.raises(UsageError, match=r"Session\(lease_ttl=\.\.\.\) takes seconds"):
            Session("r1", ScriptedGateway([]), store, lease_ttl="5")  # type: ignore[arg-type]
        with pytest.raises(UsageError, match=r"Session\(wait=\.\.\.\) takes seconds >= 0"):
            Session("r1", ScriptedGateway([]), store, wait=-1)
        assert await store.runs() == []
    finally:
        await store.close()


@pytest.mark.parametrize("turns", ["3", 0, True])
def test_max_turns_that_is_not_a_positive_int_is_refused(turns: Any) -> None:
    with pytest.raises(UsageError, match=r"Agent\(max_turns=\.\.\.\)"):
        Agent(max_turns=turns)


def test_destructive_policy_of_what_is_not_tools_is_refused() -> None:
    """A tool's name where the tool goes would have asked nobody: refused."""
    with pytest.raises(UsageError, match=r"takes the agent's tools .*got 'send'"):
        require_approval_for_destructive("send")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"got 'send'"):
        require_approval_for_destructive([send, "send"])  # type: ignore[list-item]
    require_approval_for_destructive([send])  # the tools themselves: fine
