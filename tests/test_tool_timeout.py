"""Tool timeouts: ``@tool(timeout=...)`` and ``Session(tool_timeout=...)`` end a wait.

Past its timeout an idempotent tool's step fails and the model is told; any other
tool's step is uncertain, and stays so on resume: it is never run again blindly. A
sync tool's thread cannot be stopped: it is left to finish alone, and another
thread takes its place, so hung tools never starve the others (tests/fleet/test_hung.py
proves the same in a worker process, with SIGTERM's grace).
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from asiento import App, RunStatus, Session, UncertainEffect, UsageError, tool
from asiento.agent import Agent
from asiento.testing import ScriptedGateway
from asiento.tools import _threads
from sqlite_files import Journal
from test_agent import RUN, TASK, asks, done, drive, scripted, tool_messages

HANG_LIMIT = 20.0  # seconds a hung tool of these tests waits before it gives up


class Hanging:
    """A sync tool that waits until ``release`` is set (bounded); it counts its calls."""

    def __init__(self, name: str, *, idempotent: bool, timeout: float | None = 0.2) -> None:
        self.release = threading.Event()
        self.calls: list[str] = []

        def body(text: str) -> str:
            self.calls.append(text)
            self.release.wait(HANG_LIMIT)
            return "returned at last"

        body.__doc__ = "Hang until released."
        self.tool = tool(idempotent=idempotent, name=name, timeout=timeout)(body)


async def test_an_idempotent_tool_past_its_timeout_fails_and_the_model_is_told(
    journal: Journal,
) -> None:
    lookup = Hanging("lookup", idempotent=True)
    gw = scripted([asks(("lookup", {"text": "x"})), done()])
    try:
        steps = await drive(Agent(tools=[lookup.tool]), gw, journal.open())
    finally:
        lookup.release.set()
    assert lookup.calls == ["x"]
    assert steps[-1].text == "all done"  # type: ignore[union-attr]
    assert tool_messages(gw.calls[-1][0]) == ["error: tool 'lookup' timed out after 0.2 s"]


async def test_a_non_idempotent_tool_past_its_timeout_is_uncertain_and_never_run_again(
    journal: Journal,
) -> None:
    pay = Hanging("pay", idempotent=False)
    store = journal.open()
    agent = Agent(tools=[pay.tool])
    try:
        with pytest.raises(UncertainEffect, match=r"It timed out after 0\.2 s"):
            await drive(agent, scripted([asks(("pay", {"text": "ana"})), done()]), store)
        (info,) = await store.runs()
        assert info.status is RunStatus.UNCERTAIN
        assert info.reason == (
            "tool 'pay' (step m1.t1): it timed out after 0.2 s, and may or may not have happened"
        )
        with pytest.raises(UncertainEffect):  # resumed: still uncertain, not run again
            await drive(agent, scripted([asks(("pay", {"text": "ana"})), done()]), journal.open())
    finally:
        pay.release.set()
    assert pay.calls == ["ana"]


async def test_an_async_tool_past_its_timeout_is_cancelled(journal: Journal) -> None:
    seen: list[str] = []

    @tool(idempotent=True, timeout=0.1)
    async def fetch(text: str) -> str:
        """Wait far longer than allowed."""
        try:
            await asyncio.sleep(HANG_LIMIT)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return "late"

    gw = scripted([asks(("fetch", {"text": "x"})), done()])
    await drive(Agent(tools=[fetch]), gw, journal.open())
    assert seen == ["cancelled"]
    assert tool_messages(gw.calls[-1][0]) == ["error: tool 'fetch' timed out after 0.1 s"]


async def test_the_sessions_tool_timeout_applies_unless_the_tool_sets_its_own(
    journal: Journal,
) -> None:
    slow = Hanging("slow", idempotent=True, timeout=None)
    own = Hanging("own", idempotent=True, timeout=0.3)
    gw = scripted([asks(("slow", {"text": "a"}), ("own", {"text": "b"})), done()])
    session = Session(RUN, gw, journal.open(), tool_timeout=0.1)
    try:
        [s async for s in Agent(tools=[slow.tool, own.tool]).run(TASK, session=session)]
    finally:
        slow.release.set()
        own.release.set()
    assert tool_messages(gw.calls[-1][0]) == [
        "error: tool 'slow' timed out after 0.1 s",
        "error: tool 'own' timed out after 0.3 s",
    ]


async def test_without_a_timeout_a_slow_tool_is_waited_for(journal: Journal) -> None:
    @tool(idempotent=True)
    def slow(text: str) -> str:
        """Slower than the timeouts above, but given no limit."""
        threading.Event().wait(0.3)
        return f"read {text}"

    gw = scripted([asks(("slow", {"text": "x"})), done()])
    await drive(Agent(tools=[slow]), gw, journal.open())
    assert tool_messages(gw.calls[-1][0]) == ["read x"]


async def test_hung_sync_tools_never_starve_the_others_of_threads() -> None:
    """More hung tools than the pool has threads: a quick one still gets a thread."""
    hung = [Hanging(f"hung{n}", idempotent=True, timeout=None) for n in range(_threads.size + 2)]

    @tool
    def quick() -> str:
        """Done at once."""
        return "quick"

    waits = [asyncio.ensure_future(h.tool.invoke({"text": "x"})) for h in hung]
    try:
        await asyncio.sleep(0.05)
        for wait in waits:  # a timeout (or a shutdown's grace) gives the waits up
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        assert await asyncio.wait_for(quick.invoke({}), HANG_LIMIT / 2) == "quick"
    finally:
        for h in hung:
            h.release.set()


def test_a_hung_sync_tool_does_not_keep_the_process_from_exiting(tmp_path: Any) -> None:
    """Tool threads are daemons: a process whose tool never returns still exits."""
    script = textwrap.dedent(
        """
        import asyncio, threading
        from asiento import tool

        @tool(idempotent=True)
        def hang() -> str:
            '''Never returns (well: after 60 s).'''
            threading.Event().wait(60)
            return "late"

        async def main() -> None:
            try:
                await asyncio.wait_for(hang.invoke({}), 0.2)
            except TimeoutError:
                print("gave up", flush=True)

        asyncio.run(main())
        """
    )
    done_ = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=False
    )
    assert (done_.returncode, done_.stdout) == (0, "gave up\n"), done_.stderr


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "5", True])
def test_a_timeout_that_is_not_positive_seconds_is_refused(bad: Any) -> None:
    with pytest.raises(UsageError, match=r"@tool\(timeout=\.\.\.\)"):
        tool(timeout=bad)(lambda: None)
    with pytest.raises(UsageError, match=r"Session\(tool_timeout=\.\.\.\)"):
        Session(RUN, ScriptedGateway([]), object(), tool_timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"App\(tool_timeout=\.\.\.\)"):
        App(agents={}, gateway=ScriptedGateway([]), tool_timeout=bad)
    with pytest.raises(UsageError, match=r"App\(shutdown_grace=\.\.\.\)"):
        App(agents={}, gateway=ScriptedGateway([]), shutdown_grace=bad)
