"""``@tool(isolated=True)``: a sync tool in a process of its own, so a C call holding the
GIL there stops nothing here: the event loop (and so every lease renewal) goes on.

The same GIL-holding call on an ordinary tool thread stops the loop: the documented
limit (docs/fleet.md), shown here beside the remedy.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from asiento import Agent, IsolatedToolDied, RunStatus, UncertainEffect, UsageError, tool
from asiento.tools import Tool
from isolated_tools import (
    GIL_HOLD_N,
    die,
    hold_the_gil,
    isolated_hold,
    pid_file,
    plain_hold,
    refuse,
    sleep_long,
    where,
)
from sqlite_files import Journal
from test_agent import asks, done, drive, scripted, tool_messages


async def ticks_while(tool_: Tool, n: int) -> tuple[int, float]:
    """How often a 10 ms ticker ran on the loop while ``tool_`` ran, and how long it took."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    running = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    ticks, started = 0, time.monotonic()
    await tool_.invoke({"n": n})
    took = time.monotonic() - started
    running.cancel()
    return ticks, took


async def test_a_gil_holding_call_stops_the_loop_unless_isolated() -> None:
    await where.invoke({"text": "warm"})  # a child started and kept, so its start-up is not timed
    started = time.monotonic()
    hold_the_gil(GIL_HOLD_N // 10)
    n = int(GIL_HOLD_N // 10 * min(10.0, 1.0 / max(1e-3, time.monotonic() - started)))  # ~1 s
    plain_ticks, plain_took = await ticks_while(plain_hold, n)
    isolated_ticks, isolated_took = await ticks_while(isolated_hold, n)
    # On a tool thread the loop gets the GIL back only when the C call ends.
    assert plain_ticks <= 3, f"{plain_ticks} ticks in {plain_took:.2f} s: the GIL was free"
    # In a child, the loop runs all along (a tick every 10 ms, give or take a loaded machine).
    assert isolated_ticks >= isolated_took / 0.01 / 4, (isolated_ticks, isolated_took)


async def test_an_isolated_tool_runs_in_another_process_and_its_result_is_recorded(
    journal: Journal,
) -> None:
    gw = scripted([asks(("where", {"text": "hi"}), ("refuse", {"text": "pay"})), done()])
    await drive(Agent(tools=[where, refuse]), gw, journal.open())
    answered, refused = tool_messages(gw.calls[-1][0])
    assert answered.startswith("hi from ")
    assert int(answered.rsplit(" ", 1)[1]) != os.getpid()
    assert refused == "error: ValueError: cannot pay"


async def test_an_isolated_tool_whose_process_dies_is_uncertain_never_rerun(
    journal: Journal,
) -> None:
    """The child dies mid-call: the pass raises IsolatedToolDied (the worker would go on),
    the step stays submitted, and the resumed run is uncertain, the tool not run again."""
    store = journal.open()
    with pytest.raises(IsolatedToolDied, match="'die' died before it answered"):
        await drive(Agent(tools=[die]), scripted([asks(("die", {"text": "x"})), done()]), store)
    with pytest.raises(UncertainEffect):
        await drive(Agent(tools=[die]), scripted([asks(("die", {"text": "x"})), done()]), store)
    (info,) = await store.runs()
    assert info.status is RunStatus.UNCERTAIN


async def test_an_isolated_tool_past_its_timeout_is_killed(
    journal: Journal, tmp_path: Path
) -> None:
    gw = scripted([asks(("sleep_long", {"seconds": 30})), done()])
    await drive(Agent(tools=[sleep_long]), gw, journal.open())
    assert tool_messages(gw.calls[-1][0]) == ["error: tool 'sleep_long' timed out after 0.5 s"]
    marker = tmp_path / "pid"
    call = asyncio.ensure_future(pid_file.invoke({"path": str(marker)}))
    for _ in range(500):  # bounded: 10 s
        if marker.exists() and marker.read_text():
            break
        await asyncio.sleep(0.02)
    pid = int(marker.read_text())
    call.cancel()  # what a timeout or a shutdown's grace does
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(250):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError(f"the child {pid} of a call given up is still alive")


def test_what_cannot_be_isolated_is_refused() -> None:
    async def fetch() -> str:
        """An async tool."""
        return "x"

    def inner() -> str:
        """Defined inside a function."""
        return "x"

    with pytest.raises(UsageError, match="async tool holds no thread"):
        tool(isolated=True)(fetch)
    with pytest.raises(UsageError, match="top level of a module"):
        tool(isolated=True)(inner)
    with pytest.raises(UsageError, match=r"isolated=\.\.\.\) takes True or False"):
        tool(isolated="yes")(inner)  # type: ignore[call-overload]
