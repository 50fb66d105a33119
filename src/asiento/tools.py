"""``@tool``: a Python function the model may call, with a schema from its type hints.

Non-idempotent is the default: a tool must declare itself safe to repeat.

Every kind of tool carries out its steps through one protocol, ``Runner``:
``prepare`` freezes what the step will do into its intent, ``execute`` does it
once, ``reconcile`` decides what a step submitted with no recorded outcome may do
next. A plain function is the trivial case (``FunctionRunner``); an effect
(``asiento.effects.Effect``) prepares a payload and an idempotency key, publishes
it and reconciles by key or lookup; other kinds of tools (MCP tools, another
framework's) bring their own runner. The loop walks the same path for all.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import inspect
import math
import os
import queue
import re
import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, get_type_hints, overload

import pydantic

from . import _isolated, outcomes
from .errors import AsientoError, IsolatedToolDied, UsageError
from .model import ToolSchema
from .payloads import Intent, Outcome

ToolFunction = Callable[..., Any]

_T = TypeVar("_T")


class ToolArgumentsError(AsientoError, ValueError):
    """The model's arguments do not fit the tool's signature."""


class PrepareFailed(AsientoError):
    """A runner could not prepare the step: the message is the step's recorded outcome."""


class ToolTimedOut(AsientoError):
    """A tool step ran past its timeout and its wait was given up (docs/fleet.md).

    An async tool is cancelled; a sync tool's thread cannot be stopped and is left to
    finish alone, its result dropped. So the step may or may not have happened.
    """

    def __init__(self, tool: str, seconds: float) -> None:
        self.tool, self.seconds = tool, seconds
        super().__init__(f"tool {tool!r} timed out after {seconds:g} s")


@dataclass(frozen=True, slots=True)
class Again:
    """Reconciled: execute the step again, as a new attempt (``via`` says how)."""

    via: str


@dataclass(frozen=True, slots=True)
class Found:
    """Reconciled: the step's outcome was found where it happened (a lookup)."""

    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Unknown:
    """Reconciled: nobody can tell whether it happened; ``why`` says what was missing."""

    why: str = ""


Reconciled = Again | Found | Unknown


class Runner(Protocol):
    """How a kind of tool carries out its steps: the one path the loop walks for all.

    ``prepares``: whether ``prepare`` freezes something ``execute`` depends on, so the
    intent is made durable before the step executes (as an effect's payload is).
    """

    prepares: bool

    def prepare(self, tool: Tool, run_id: str, step_id: str, intent: Intent) -> Intent:
        """The intent with what the execution needs frozen in it; ``PrepareFailed`` if
        it cannot be prepared (the step's outcome, nothing runs)."""
        ...

    async def execute(
        self,
        tool: Tool,
        intent: Intent,
        kwargs: Mapping[str, Any] | None,
        *,
        via: str,
        attempts: int,
    ) -> Outcome:
        """Do the step once (``kwargs``: the arguments, validated already, or None).

        An exception other than the outcomes it returns leaves the step submitted,
        for ``reconcile`` to settle on resume.
        """
        ...

    async def reconcile(
        self, tool: Tool, intent: Intent, *, age: float | None, attempts: int
    ) -> Reconciled:
        """A non-idempotent step was submitted and no outcome recorded: what now.

        ``age``: seconds since its first submission, on the store's clock.
        """
        ...


class FunctionRunner:
    """A plain function: nothing to prepare, call it once, and nothing can reconcile it.

    Whatever the function raises is its recorded outcome. Submitted with no outcome,
    it runs again only if it is idempotent, which the replay table decides before
    ever asking ``reconcile``.
    """

    prepares: bool = False

    def prepare(self, tool: Tool, run_id: str, step_id: str, intent: Intent) -> Intent:
        return intent

    async def execute(
        self,
        tool: Tool,
        intent: Intent,
        kwargs: Mapping[str, Any] | None,
        *,
        via: str,
        attempts: int,
    ) -> Outcome:
        try:
            if kwargs is None:
                return outcomes.of_value(await tool.invoke(intent.args))
            return outcomes.of_value(await tool.call_validated(kwargs))
        except ToolArgumentsError as exc:
            return Outcome.failed(str(exc))
        except IsolatedToolDied:  # not an outcome: it may have happened (the replay table)
            raise
        except Exception as exc:
            return Outcome.failed(f"{type(exc).__name__}: {exc}")

    async def reconcile(
        self, tool: Tool, intent: Intent, *, age: float | None, attempts: int
    ) -> Reconciled:
        return Unknown()


FUNCTION = FunctionRunner()


@dataclass(frozen=True, slots=True)
class Tool:
    """A callable tool with its JSON schema and its repeat-safety declared."""

    name: str
    description: str
    idempotent: bool
    fn: ToolFunction
    arguments_model: type[pydantic.BaseModel]
    runner: Runner = FUNCTION
    # Seconds a step of this tool may take before its wait is given up (None: the
    # session's ``tool_timeout``).
    timeout: float | None = None
    # Run in a process of its own (``_isolated``): a GIL held there stops nothing here.
    isolated: bool = False
    # Asked once: ``inspect.iscoroutinefunction`` on every call costs more than the rest
    # of the dispatch.
    is_async: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_async", inspect.iscoroutinefunction(self.fn))

    @property
    def schema(self) -> ToolSchema:
        parameters = self.arguments_model.model_json_schema(by_alias=True)
        parameters.pop("title", None)
        for prop in parameters.get("properties", {}).values():
            prop.pop("title", None)
        return ToolSchema(name=self.name, description=self.description, parameters=parameters)

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments to call the function with, or ``ToolArgumentsError``."""
        try:
            model = self.arguments_model.model_validate(dict(arguments))
        except pydantic.ValidationError as exc:
            raise ToolArgumentsError(f"invalid arguments for tool {self.name!r}: {exc}") from None
        return {alias: getattr(model, name) for name, alias in _parameters(self.arguments_model)}

    async def invoke(self, arguments: Mapping[str, Any]) -> Any:
        """Run the tool once.

        A sync tool runs in a worker thread, so the event loop goes on renewing
        the run's lease however long the tool takes.
        """
        return await self.call_validated(self.validate(arguments))

    async def call_validated(self, kwargs: Mapping[str, Any]) -> Any:
        """``invoke`` for arguments ``validate`` already returned (validating twice costs)."""
        if self.is_async:
            return await self.fn(**kwargs)
        if self.isolated:
            return await _in_child(self.fn, kwargs)
        result = await _in_thread(functools.partial(self.fn, **kwargs))
        if inspect.isawaitable(result):
            return await result
        return result

    @property
    def destructive(self) -> bool:
        """Whether ``require_approval_for_destructive`` asks a person before it runs.

        An MCP tool says so by its annotations (every tool of an untrusted server is);
        a local tool is the user's own code, and is not.
        """
        return False

    @property
    def source(self) -> Any:
        """What a run depends on beyond the tool's schema, as JSON (an MCP tool's server,
        annotations and treatment): part of the run's fingerprint. None for a local tool."""
        return None

    @property
    def effect(self) -> Any:
        """The ``Effect`` this tool publishes through, if it is one (else None)."""
        return getattr(self.runner, "effect", None)

    def with_runner(self, runner: Runner, *, idempotent: bool | None = None) -> Tool:
        """This tool, its steps carried out by ``runner`` (an effect's, an MCP server's)."""
        repeat = self.idempotent if idempotent is None else idempotent
        return dataclasses.replace(self, runner=runner, idempotent=repeat)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


# Sync tools run on threads of asiento's own, so a tool that blocks never holds the
# event loop (which renews the run's lease meanwhile). Most tools are done within a
# millisecond or two: waiting that long for the thread directly skips the loop's
# wake-up round trip (the self-pipe, a callback, a task step), 50-100 µs a call. The
# loop's default executor cannot be waited for that way: its futures are the loop's.
_QUICK_TOOL_SECONDS = 0.002


class _ToolThreads:
    """The threads sync tools run on: started as calls need them, up to ``size``.

    Not a ``ThreadPoolExecutor``: its threads are joined when the interpreter exits,
    so one tool that never returns would keep a stopped worker alive for ever. These
    are daemon threads. A call whose wait was given up (a timeout, a shutdown's grace)
    still holds its thread: ``abandon`` lets one more start in its place, so a hung
    tool takes one thread and never a slot of the others. ``size`` is
    ``ThreadPoolExecutor``'s default, min(32, CPUs + 4), or more when a worker drives
    more runs at once (``tool_threads_at_least``).
    """

    def __init__(self) -> None:
        self.size = min(32, (os.cpu_count() or 1) + 4)
        self._reset()

    def _reset(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._started = 0
        self._abandoned: set[Future[Any]] = set()

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((future, call))
        if self._idle.acquire(blocking=False):  # an idle thread takes it
            return future
        with self._lock:
            if self._started < self.size + len(self._abandoned):
                self._started += 1
                name = f"asiento-tool-{self._started}"
                threading.Thread(target=self._work, name=name, daemon=True).start()
        return future

    def abandon(self, future: Future[Any]) -> None:
        """Nobody waits for ``future`` any more: its thread no longer counts as one."""
        with self._lock:
            if not future.done():
                self._abandoned.add(future)

    def at_least(self, count: int) -> None:
        self.size = max(self.size, count)

    def forget(self) -> None:
        """In a forked child: the parent's threads do not exist here."""
        self._reset()

    def _work(self) -> None:
        jobs, idle = self._jobs, self._idle
        while True:
            future, call = jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    result = call()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                if future in self._abandoned:
                    with self._lock:
                        self._abandoned.discard(future)
            del future, call  # drop the result before waiting for the next call
            idle.release()


_threads = _ToolThreads()
os.register_at_fork(after_in_child=_threads.forget)


def tool_threads_at_least(count: int) -> None:
    """Let ``count`` sync tools run at once (a worker driving ``count`` runs): no run's
    tool waits for a thread another run's slow tool holds."""
    _threads.at_least(count)


async def _in_thread(call: Callable[[], Any]) -> Any:
    """``call()`` on a tool thread, with the caller's context variables (as ``to_thread``)."""
    future = _threads.submit(functools.partial(contextvars.copy_context().run, call))
    try:
        return future.result(timeout=_QUICK_TOOL_SECONDS)
    except TimeoutError:  # still running (or the tool's own TimeoutError: raised again here)
        pass
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:  # the wait was given up: the thread cannot be stopped
        if not future.cancel():
            _threads.abandon(future)
        raise


async def _in_child(fn: ToolFunction, kwargs: Mapping[str, Any]) -> Any:
    """``fn(**kwargs)`` in a child process, waited for on a tool thread (the GIL free)."""
    call = _isolated.IsolatedCall(fn.__module__, fn.__qualname__, dict(kwargs))
    try:
        return await _in_thread(call.run)
    except asyncio.CancelledError:
        call.kill()
        raise


async def within(step: Awaitable[_T], seconds: float | None, tool: str) -> _T:
    """``step``'s result, or ``ToolTimedOut`` once it has taken ``seconds``."""
    if seconds is None:
        return await step
    bound = asyncio.timeout(seconds)
    try:
        async with bound:
            return await step
    except TimeoutError:
        if bound.expired():
            raise ToolTimedOut(tool, seconds) from None
        raise


def check_count(value: Any, where: str, *, least: int) -> int:
    """A whole number of at least ``least`` (never a bool), or ``UsageError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UsageError(f"{where} takes an int >= {least}, got {value!r}")
    return value


def check_seconds(seconds: Any, where: str) -> float:
    """A duration that must be given (a lease, a grace period), or ``UsageError``."""
    if seconds is None or isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise UsageError(f"{where} takes seconds (a number > 0), got {seconds!r}")
    checked = check_timeout(seconds, where)
    assert checked is not None
    return checked


def check_timeout(seconds: Any, where: str) -> float | None:
    """A timeout as given (None: none), or ``UsageError`` naming ``where``."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise UsageError(f"{where} takes seconds (a number) or None, got {seconds!r}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise UsageError(f"{where} must be a finite number of seconds > 0, got {seconds!r}")
    return float(seconds)


@overload
def tool(fn: ToolFunction, /) -> Tool: ...


@overload
def tool(
    *,
    idempotent: bool = False,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
    isolated: bool = False,
) -> Callable[[ToolFunction], Tool]: ...


def tool(
    fn: ToolFunction | None = None,
    /,
    *,
    idempotent: bool = False,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = None,
    isolated: bool = False,
) -> Tool | Callable[[ToolFunction], Tool]:
    """Turn a function into a ``Tool``; ``@tool`` and ``@tool(idempotent=True)`` both work.

    ``timeout``: seconds a step may take before its wait is given up; an idempotent
    tool's step then fails (the model is told), any other is uncertain (docs/fleet.md).
    ``isolated``: run the (sync, top-level) function in a process of its own, so that
    C code holding the GIL there cannot stop this process's leases (docs/fleet.md).
    """
    seconds = check_timeout(timeout, "@tool(timeout=...)")

    def wrap(f: ToolFunction) -> Tool:
        if not callable(f):
            raise UsageError(f"@tool decorates a function, got {f!r}")
        if not isinstance(idempotent, bool):
            raise UsageError(f"@tool(idempotent=...) takes True or False, got {idempotent!r}")
        if not isinstance(isolated, bool):
            raise UsageError(f"@tool(isolated=...) takes True or False, got {isolated!r}")
        if isolated:
            _check_isolatable(f)
        tool_name = f.__name__ if name is None else name
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", tool_name):
            raise UsageError(f"tool name {tool_name!r} must be 1-64 letters, digits, _ or -")
        summary, params = _parse_docstring(inspect.getdoc(f) or "")
        model = _arguments_model(f, tool_name, params)
        return Tool(
            tool_name,
            description or summary,
            idempotent,
            f,
            model,
            timeout=seconds,
            isolated=isolated,
        )

    return wrap(fn) if fn is not None else wrap


def _check_isolatable(f: ToolFunction) -> None:
    """An isolated tool's child imports the function by name: a sync one, at top level."""
    where = f"@tool(isolated=True) on {getattr(f, '__qualname__', f)!r}"
    if inspect.iscoroutinefunction(f):
        raise UsageError(f"{where}: an async tool holds no thread to isolate; make it a def")
    qualname = getattr(f, "__qualname__", "")
    if "<" in qualname or not getattr(f, "__module__", None):
        raise UsageError(
            f"{where}: its process imports the function by name, so it must be defined at"
            " the top level of a module (not inside a function, not a lambda)"
        )


def _arguments_model(
    f: ToolFunction, tool_name: str, docs: Mapping[str, str]
) -> type[pydantic.BaseModel]:
    try:
        hints = get_type_hints(f)
    except Exception as exc:
        raise UsageError(f"tool {tool_name!r}: cannot resolve its type hints: {exc}") from exc
    fields: dict[str, Any] = {}
    for param in inspect.signature(f).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise UsageError(
                f"tool {tool_name!r}: *args and **kwargs cannot be described to a model"
            )
        default = ... if param.default is param.empty else param.default
        annotation = hints.get(param.name, Any)
        field = pydantic.Field(default, description=docs.get(param.name), alias=param.name)
        fields[_field_name(param.name)] = (annotation, field)
    config = pydantic.ConfigDict(extra="forbid", populate_by_name=False)
    try:
        return pydantic.create_model(f"{tool_name}_arguments", __config__=config, **fields)
    except Exception as exc:
        raise UsageError(f"tool {tool_name!r}: its signature has no JSON schema: {exc}") from exc


@functools.cache
def _parameters(model: type[pydantic.BaseModel]) -> tuple[tuple[str, str], ...]:
    """(field name, parameter name) of each argument: the parameter is the field's alias."""
    return tuple((name, field.alias or name) for name, field in model.model_fields.items())


def _field_name(name: str) -> str:
    """A pydantic field name for a parameter; names BaseModel already uses get a suffix."""
    return f"{name}__arg" if hasattr(pydantic.BaseModel, name) else name


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The summary paragraph and the ``Args:`` descriptions of a Google-style docstring."""
    summary = doc.split("\n\n", 1)[0].strip()
    params: dict[str, str] = {}
    in_args, current, indent = False, "", 0
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            in_args, current = True, ""
            continue
        if not in_args or not line.strip():
            continue
        if not line[0].isspace():
            in_args = False
            continue
        width = len(line) - len(line.lstrip())
        match = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
        if match and (not current or width <= indent):
            current, indent = match.group(1), width
            params[current] = match.group(2).strip()
        elif current:
            params[current] = f"{params[current]} {line.strip()}".strip()
    return summary, params
