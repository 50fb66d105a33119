"""The graph's own checkpointer, written as a view of the journal for LangGraph's state API.

The journal is what happened, and a pass never reads a checkpoint: it runs the graph
from its start on a checkpointer of its own (in memory), replaying the journal. A graph
compiled with a checkpointer of the user's gets, when a pass ends closed or suspended
for a person, that pass's last checkpoint copied under ``thread_id`` = the run id, so
``graph.get_state({"configurable": {"thread_id": run_id}})`` shows what the journal
holds: the final state once the run is closed, the state at the ``interrupt()`` (with
its interrupt) while a person decides. A pass cut short (a crash, an error, an abandon)
writes nothing there: the view then shows the last pass that ended, never a state the
journal does not have. Copied after the journal's own record, so a process killed in
between leaves the view one pass behind: for a closed run, the next ``durable_run``
replays the run from the journal (asking and running nothing) and copies its close.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver, CheckpointTuple

from ..errors import UsageError

log = logging.getLogger("asiento")


def _delta_channels() -> tuple[type, ...]:
    try:
        from langgraph.channels.delta import DeltaChannel
    except ImportError:  # langgraph before 1.2 has no delta channels: every value is whole
        return ()
    return (DeltaChannel,)


_DELTA = _delta_channels()


def saver_of(graph: Any) -> BaseCheckpointSaver[Any] | None:
    """The checkpointer the user compiled the graph with, if any."""
    saver = getattr(graph, "checkpointer", None)
    return saver if isinstance(saver, BaseCheckpointSaver) else None


def check(graph: Any, who: str) -> None:
    """Refuse a graph whose checkpoint could not be copied whole: a ``DeltaChannel``'s
    value lives in the writes of the checkpoints before it, which only the pass's own
    checkpointer holds."""
    if saver_of(graph) is None or not _DELTA:
        return
    channels = getattr(graph, "channels", {})
    delta = sorted(name for name, c in channels.items() if isinstance(c, _DELTA))
    if delta:
        raise UsageError(
            f"{who}(graph=...): the graph has a checkpointer and DeltaChannel state "
            f"({', '.join(delta)}): asiento writes each pass's last checkpoint to that "
            "checkpointer for get_state, and a DeltaChannel's value is not in its "
            "checkpoint; compile the graph without a checkpointer (the journal is the "
            "run's state), or give those keys an ordinary reducer"
        )


def thread(run_id: str) -> RunnableConfig:
    """Where the run's state is written in the graph's checkpointer: its run id."""
    return {"configurable": {"thread_id": run_id, "checkpoint_ns": ""}}


async def shows_closed(target: BaseCheckpointSaver[Any], run_id: str) -> bool:
    """Whether the run's latest checkpoint in ``target`` is the copy of its closing pass."""
    try:
        latest = await _call(target, "get_tuple", thread(run_id))
    except Exception as exc:  # unreadable: not rewritten blindly either
        log.warning("run %r: could not read the graph's checkpointer: %s", run_id, exc)
        return True
    marked = (latest.metadata or {}).get("asiento") if latest is not None else None
    return isinstance(marked, dict) and marked.get("ended") == "closed"


async def publish(
    source: BaseCheckpointSaver[Any],
    source_thread: str,
    target: BaseCheckpointSaver[Any],
    run_id: str,
    *,
    ended: str,
    values: Mapping[str, Any] | None = None,
) -> None:
    """Copy the pass's last checkpoint (and its pending writes: an interrupt's) from
    ``source`` into the graph's checkpointer ``target``, after the latest one there.
    ``values``: the state the journal recorded, shown instead of the pass's own for the
    channels it names (a replay gives the input's messages new ids; the record's count).

    A checkpointer that cannot take it (a locked file, a closed connection) is logged:
    the journal holds the run, the view lags a pass."""
    found = await source.aget_tuple({"configurable": {"thread_id": source_thread}})
    if found is None:
        return
    try:
        await _copy(found, target, run_id, ended, values)
    except Exception as exc:
        log.warning(
            "run %r: could not write its state to the graph's checkpointer "
            "(get_state shows an earlier pass): %s",
            run_id,
            exc,
        )


async def _copy(
    found: CheckpointTuple,
    target: BaseCheckpointSaver[Any],
    run_id: str,
    ended: str,
    values: Mapping[str, Any] | None,
) -> None:
    latest = await _call(target, "get_tuple", thread(run_id))
    after = latest.config if latest is not None else thread(run_id)
    metadata = {**found.metadata, "asiento": {"run_id": run_id, "ended": ended}}
    checkpoint = found.checkpoint
    if values:
        held = dict(checkpoint["channel_values"])
        held |= {name: value for name, value in values.items() if name in held}
        checkpoint = {**checkpoint, "channel_values": held}
    versions = dict(checkpoint["channel_versions"])
    saved = await _call(target, "put", after, checkpoint, metadata, versions)
    by_task: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for task_id, channel, value in found.pending_writes or ():
        by_task[task_id].append((channel, value))
    for task_id, writes in by_task.items():
        await _call(target, "put_writes", saved, writes, task_id)


async def _call(saver: BaseCheckpointSaver[Any], name: str, *args: Any) -> Any:
    """The saver's async method, or its sync one in a thread: ``SqliteSaver`` has only
    sync ones (LangGraph too calls them from its threads: ``check_same_thread=False``)."""
    try:
        return await getattr(saver, "a" + name)(*args)
    except NotImplementedError:
        return await asyncio.to_thread(getattr(saver, name), *args)
