"""``@tool(isolated=True)``: a sync tool run in a process of its own.

A tool in C that holds the GIL (a compression or parsing library that never releases
it) stops every thread of the interpreter: the event loop, the store's thread, and
with them every lease renewal of the worker. In a child process it holds only the
child's GIL; the worker waits for its answer on a tool thread, which gives the GIL up.

Each child is a new interpreter (never a fork of the multi-threaded worker itself),
on the worker's ``sys.path``; it imports the tool's module by name and serves one
call at a time, its arguments and result pickled; an idle child is kept for the next
call. It ignores SIGINT and SIGTERM (the worker decides when its calls stop) and, on
Linux, dies with the worker. A call whose wait is given up (a timeout, a
shutdown's grace) kills its child. A child that dies mid-call (a segfault, the OOM
killer) raises ``IsolatedToolDied``: the step stays submitted, and the replay table
settles it on the next pass, as after a crash of the worker (an idempotent tool runs
again, another is uncertain), while the worker and its other runs go on.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from . import context
from .errors import IsolatedToolDied

# Idle children kept for the next calls (more are started when calls overlap).
_KEEP_IDLE = 4


class _Failure:
    """What a child sends back when the tool raised: the exception, or its text if it
    cannot be pickled."""

    def __init__(self, exc: BaseException) -> None:
        self.exc: BaseException | None = exc
        self.text = f"{type(exc).__name__}: {exc}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Failure._of, (self.exc, self.text))

    @staticmethod
    def _of(exc: BaseException | None, text: str) -> _Failure:
        failure = _Failure.__new__(_Failure)
        failure.exc, failure.text = exc, text
        return failure

    def raise_it(self) -> None:
        if self.exc is not None:
            raise self.exc
        raise RuntimeError(self.text)


def _serve(receives: Connection, sends: Connection) -> None:
    """A child: answer calls until the parent goes away (EOF on the pipe)."""
    while True:
        try:
            module, qualname, kwargs, where = receives.recv()
        except (EOFError, OSError):
            return
        token = context.enter(where) if where is not None else None
        try:
            answer: Any = _target(module, qualname)(**kwargs)
        except BaseException as exc:  # the tool's failure is its outcome
            answer = _Failure(exc)
        finally:
            if token is not None:
                context.leave(token)
        try:
            sends.send(answer)
        except Exception as exc:  # the result cannot be pickled
            with contextlib.suppress(Exception):
                sends.send(_Failure(TypeError(f"its result cannot be sent back: {exc}")))


def _target(module: str, qualname: str) -> Any:
    """The function ``qualname`` of ``module`` (the Tool there, or the function itself)."""
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return getattr(found, "fn", found)


class _Child:
    """One child process (a new interpreter) and the parent's ends of its pipes."""

    def __init__(self) -> None:
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or "." for p in sys.path)}
        argv = [sys.executable, "-c", _CHILD_MAIN, str(from_parent), str(to_parent)]
        try:
            self.process = subprocess.Popen(argv, pass_fds=(from_parent, to_parent), env=env)
        finally:
            os.close(from_parent)
            os.close(to_parent)
        self.sends, self.receives = (
            Connection(to_child, readable=False),
            Connection(from_child, writable=False),
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def call(self, module: str, qualname: str, kwargs: dict[str, Any], where: Any) -> Any:
        """Blocking (on a tool thread): send the call, wait for its answer."""
        try:
            self.sends.send((module, qualname, kwargs, where))
            answer = self.receives.recv()
        except (EOFError, OSError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(1)
            raise IsolatedToolDied(
                f"the process of isolated tool {qualname!r} died before it answered"
                f" (exit status {self.process.returncode}); it may or may not have done its work"
            ) from None
        if isinstance(answer, _Failure):
            answer.raise_it()
        return answer

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.process.kill()
            self.process.wait(5)
        self.sends.close()
        self.receives.close()


# What a child runs: serve calls on the two pipes it was given.
_CHILD_MAIN = (
    "import sys; from asiento._isolated import child_main; child_main(*map(int, sys.argv[1:3]))"
)


def child_main(receives: int, sends: int) -> None:
    """A child's life: die with the parent, let the parent decide when to stop, serve."""
    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the worker's graceful stop is not ours
        signal.signal(sig, signal.SIG_IGN)
    _serve(Connection(receives, writable=False), Connection(sends, readable=False))


def _die_with_parent() -> None:
    """Linux: SIGKILL this child when its parent dies (a crash of the worker ends its tools
    too, as it ends its threads); elsewhere it ends at its next read of the pipe."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)


class _Children:
    """The idle children, per process (a forked worker starts its own)."""

    def __init__(self) -> None:
        self._idle: list[_Child] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def take(self) -> _Child:
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._pid = [], os.getpid()
            while self._idle:
                child = self._idle.pop()
                if child.alive():
                    return child
        return _Child()

    def give_back(self, child: _Child) -> None:
        with self._lock:
            if len(self._idle) < _KEEP_IDLE and child.alive():
                self._idle.append(child)
                return
        child.kill()


_children = _Children()


class IsolatedCall:
    """One call of an isolated tool: ``run`` it on a tool thread; ``kill`` gives it up."""

    def __init__(self, module: str, qualname: str, kwargs: dict[str, Any]) -> None:
        self.module, self.qualname, self.kwargs = module, qualname, kwargs
        self.where = context.current_step()
        self._child: _Child | None = None
        self._killed = False
        self._lock = threading.Lock()

    def run(self) -> Any:
        """Blocking: the tool's result from a child, or what it raised."""
        child = _children.take()
        with self._lock:
            if self._killed:
                _children.give_back(child)
                raise IsolatedToolDied(f"isolated tool {self.qualname!r} was given up")
            self._child = child
        try:
            result = child.call(self.module, self.qualname, self.kwargs, self.where)
        except IsolatedToolDied:
            child.kill()
            raise
        except BaseException:
            _children.give_back(child)
            raise
        _children.give_back(child)
        return result

    def kill(self) -> None:
        """Nobody waits any more (a timeout, a shutdown's grace): end the child's work."""
        with self._lock:
            self._killed = True
            child = self._child
        if child is not None:
            child.kill()
