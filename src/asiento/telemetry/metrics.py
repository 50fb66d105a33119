"""A worker's metrics, on the OpenTelemetry metrics API (docs/fleet.md, "Metrics").

The instruments come from ``opentelemetry.metrics.get_meter("asiento")``, so they
report to whatever ``MeterProvider`` the process sets globally, now or later (the
API's proxy binds them when one is set): a Prometheus reader (``asiento worker
--metrics-port``), an OTLP exporter to a collector, or a test's in-memory reader.
With the API and no SDK configured they are the API's no-ops; without
``opentelemetry-api`` installed, every function here returns at once and
``counted`` hands the store back untouched.

Each fact is recorded where it is known: a claim and the runs in flight by the
worker, the store's writes by ``counted`` (the worker's view of its store), a
renewal's lag by the session that renews, a park by whoever parks (the store's
claim, or the worker for a run whose agent it lacks), a quota wait by the ``Quota``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final, cast

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Meter, Observation

    from ..journal.base import Checkpointer

#: The operations ``asiento.worker.commits`` counts: the worker's writes to its store.
WRITES: Final = ("append", "claim", "release", "renew", "set_status")
# Seconds: from a few milliseconds late to later than any lease should tolerate.
_LAG_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_WAIT_BUCKETS: Final = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# The GenAI conventions' advice for gen_ai.client.operation.duration and token.usage.
_CALL_BUCKETS: Final = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
_TOKEN_BUCKETS: Final = (
    1,
    4,
    16,
    64,
    256,
    1024,
    4096,
    16384,
    65536,
    262144,
    1048576,
    4194304,
    16777216,
    67108864,
)


class _WorstLag:
    """The largest renewal lag since the last collection: what ``...renewal_lag.max`` shows."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # renewals on many loops, collection on a reader's thread
        self._worst: float | None = None

    def note(self, lag: float) -> None:
        with self._lock:
            self._worst = lag if self._worst is None else max(self._worst, lag)

    def observe(self, _options: CallbackOptions) -> Iterable[Observation]:
        from opentelemetry.metrics import Observation

        with self._lock:
            worst, self._worst = self._worst, None
        return [] if worst is None else [Observation(worst)]


class _Waiting:
    """How many runs wait for a person (suspended, uncertain), read from the store of the
    worker running in this process when a reader collects: nothing is asked otherwise."""

    _READ_SECONDS: Final = 2.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._source: tuple[Any, asyncio.AbstractEventLoop] | None = None

    def watch(self, store: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        with self._lock:
            self._source = None if loop is None else (store, loop)

    def observe(self, _options: CallbackOptions) -> Iterable[Observation]:
        from opentelemetry.metrics import Observation

        with self._lock:
            source = self._source
        if source is None:
            return []
        store, loop = source
        if _running_loop() is loop:  # collected on the worker's own loop: it cannot wait
            return []
        found: list[Observation] = []
        for status in ("suspended", "uncertain"):
            if loop.is_closed():
                return found
            asked = asyncio.run_coroutine_threadsafe(_count(store, status), loop)
            try:
                found.append(Observation(asked.result(self._READ_SECONDS), {"status": status}))
            except Exception:  # a busy or stopped loop, a store away: no figure this time
                asked.cancel()
                return found
        return found


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _count(store: Any, status: str) -> int:
    from ..events import RunStatus

    return len(await store.runs(status=RunStatus(status)))


class _Instruments:
    """The worker's instruments, made once from the global meter."""

    def __init__(self, meter: Meter) -> None:
        self.runs_in_flight = meter.create_up_down_counter(
            "asiento.worker.runs_in_flight", "{run}", "Runs this worker is driving now."
        )
        self.claims = meter.create_counter(
            "asiento.worker.claims", "{run}", "Runs this worker claimed."
        )
        self.commits = meter.create_counter(
            "asiento.worker.commits",
            "{commit}",
            "Writes this worker made to its store, by operation.",
        )
        self.renewal_lag = meter.create_histogram(
            "asiento.lease.renewal_lag",
            "s",
            "How late a lease renewal committed past the moment it was due.",
            explicit_bucket_boundaries_advisory=_LAG_BUCKETS,
        )
        self.worst_lag = _WorstLag()
        meter.create_observable_gauge(
            "asiento.lease.renewal_lag.max",
            [self.worst_lag.observe],
            "s",
            "The largest renewal lag since the previous collection (scrape).",
        )
        self.waiting = _Waiting()
        meter.create_observable_gauge(
            "asiento.runs.waiting",
            [self.waiting.observe],
            "{run}",
            "Runs waiting for a person: an approval or a budget raise (suspended), or an "
            "uncertain effect; read from the store at each collection.",
        )
        self.parked = meter.create_counter(
            "asiento.runs.parked", "{run}", "Runs this process parked, by cause."
        )
        # A traced run's steps and passes (Agent(telemetry=...)): docs/observability.md.
        self.model_duration = meter.create_histogram(
            "gen_ai.client.operation.duration",
            "s",
            "How long a model call a pass paid for took (replayed calls are not calls).",
            explicit_bucket_boundaries_advisory=_CALL_BUCKETS,
        )
        self.model_tokens = meter.create_histogram(
            "gen_ai.client.token.usage",
            "{token}",
            "Tokens a paid model call was billed for, by type (input, output).",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS,
        )
        self.tool_duration = meter.create_histogram(
            "asiento.tool.duration",
            "s",
            "How long a tool that ran took, by tool and outcome.",
            explicit_bucket_boundaries_advisory=_CALL_BUCKETS,
        )
        self.passes = meter.create_counter(
            "asiento.passes", "{pass}", "Passes over runs, by why they began."
        )
        self.passes_ended = meter.create_counter(
            "asiento.passes.ended",
            "{pass}",
            "Passes by how they left the run (closed, awaiting_approval, uncertain...).",
        )
        self.quota_wait = meter.create_histogram(
            "asiento.quota.wait",
            "s",
            "How long a model request waited in a Quota before it was sent.",
            explicit_bucket_boundaries_advisory=_WAIT_BUCKETS,
        )


def _instruments() -> _Instruments | None:
    try:
        from opentelemetry import metrics
    except ImportError:  # no opentelemetry-api: nothing is recorded, nothing is paid
        return None
    return _Instruments(metrics.get_meter("asiento"))


_ON: Final = _instruments()


def watch_waiting(store: Any, loop: asyncio.AbstractEventLoop | None) -> None:
    """The store whose runs waiting for a person ``asiento.runs.waiting`` reads (on
    ``loop``, the worker's), or none (``loop`` None: the worker stopped)."""
    if _ON is not None:
        _ON.waiting.watch(store, loop)


def claimed(runs: int = 1) -> None:
    """The worker claimed ``runs`` runs."""
    if _ON is not None:
        _ON.claims.add(runs)


@contextlib.contextmanager
def driving() -> Iterator[None]:
    """One run is in flight for the body."""
    if _ON is None:
        yield
        return
    _ON.runs_in_flight.add(1)
    try:
        yield
    finally:
        _ON.runs_in_flight.add(-1)


def committed(operation: str) -> None:
    """A write to the store (one of ``WRITES``) returned: it committed."""
    if _ON is not None:
        _ON.commits.add(1, {"operation": operation})


def renewed(lag: float) -> None:
    """A lease renewal committed ``lag`` seconds after it was due."""
    if _ON is not None:
        lag = max(lag, 0.0)
        _ON.renewal_lag.record(lag)
        _ON.worst_lag.note(lag)


def parked(cause: str) -> None:
    """A run was parked, for ``cause`` (``max_attempts``, ``max_lapses``, ``no_agent``)."""
    if _ON is not None:
        _ON.parked.add(1, {"cause": cause})


def quota_waited(seconds: float) -> None:
    """A request waited ``seconds`` in a ``Quota`` before it could be sent."""
    if _ON is not None:
        _ON.quota_wait.record(max(seconds, 0.0))


def model_called(
    seconds: float, attributes: dict[str, Any], tokens: tuple[int, int] | None
) -> None:
    """A paid model call took ``seconds``; ``tokens`` (input, output) when it answered."""
    if _ON is None:
        return
    _ON.model_duration.record(max(seconds, 0.0), attributes)
    if tokens is not None:
        for kind, count in zip(("input", "output"), tokens, strict=True):
            _ON.model_tokens.record(count, {**attributes, "gen_ai.token.type": kind})


def tool_ran(seconds: float, tool: str, outcome: str) -> None:
    """A tool ran for ``seconds`` and ended ``outcome`` (applied, failed, uncertain...)."""
    if _ON is not None:
        attributes = {"gen_ai.tool.name": tool, "asiento.outcome": outcome}
        _ON.tool_duration.record(max(seconds, 0.0), attributes)


def pass_began(cause: str) -> None:
    """A traced pass began, for ``cause`` (first, resumed, decided, taken_over)."""
    if _ON is not None:
        _ON.passes.add(1, {"asiento.pass.cause": cause})


def pass_ended(status: str) -> None:
    """A traced pass ended, leaving its run ``status``."""
    if _ON is not None:
        _ON.passes_ended.add(1, {"asiento.run.status": status})


def counted(store: Checkpointer) -> Checkpointer:
    """``store``, its writes counted in ``asiento.worker.commits`` (itself, without OTel)."""
    if _ON is None:
        return store
    return cast("Checkpointer", _Counted(store))


class _Counted:
    """A store whose writes that return are counted; everything else is the store's own.

    One call is one write transaction, except that SQLite may commit appends of
    several runs in one transaction (group commit) and splits a large
    ``claim_many`` into transactions of 16 claims: the count is then of the writes
    asked, which is at least the transactions made.
    """

    def __init__(self, store: Checkpointer) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def __repr__(self) -> str:
        return repr(self._store)

    async def append(self, *args: Any, **kwargs: Any) -> None:
        await self._store.append(*args, **kwargs)
        committed("append")

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        claim = await self._store.claim(*args, **kwargs)
        committed("claim")
        return claim

    async def claim_many(self, *args: Any, **kwargs: Any) -> Any:
        claims = await self._store.claim_many(*args, **kwargs)
        committed("claim")
        return claims

    async def release(self, *args: Any, **kwargs: Any) -> None:
        await self._store.release(*args, **kwargs)
        committed("release")

    async def renew(self, *args: Any, **kwargs: Any) -> Any:
        lease = await self._store.renew(*args, **kwargs)
        committed("renew")
        return lease

    async def set_status(self, *args: Any, **kwargs: Any) -> bool:
        changed = await self._store.set_status(*args, **kwargs)
        committed("set_status")
        return changed
