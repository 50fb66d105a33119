"""The journal conformance suite: what every ``Checkpointer`` backend must pass.

A backend's author runs it with one test file; pytest collects every test of the
suite as a test of the subclass:

    import pytest
    from asiento.testing.conformance import JournalConformance

    class TestMyStore(JournalConformance):
        @pytest.fixture
        def checkpointer_factory(self, tmp_path):
            return lambda: MyStore(tmp_path / "runs")

``checkpointer_factory`` is a fixture returning a function that opens a fresh, empty
store (or returns an awaitable of one, as ``PostgresCheckpointer.connect`` does);
each test opens its own and closes it after. A store that judges the age of a record
on its server's clock rather than this process's says ``store_clock = "server"``.
The suite marks its tests for pytest-asyncio itself, so it runs in strict mode and in
auto mode alike. asiento's own backends (memory, SQLite, PostgreSQL) run it from
here (``tests/journal/test_conformance.py``); see docs/testing.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from inspect import isawaitable

import pytest
import pytest_asyncio

from asiento import Checkpointer

# pytest explains a failed assert only in a module it rewrote, and it rewrites only the
# modules registered before their import: the suite's own, imported right below.
pytest.register_assert_rewrite(*(f"{__name__}.{m}" for m in ("_index", "_journal", "_leases")))

from ._index import IndexTests  # noqa: E402  (after the registration, on purpose)
from ._journal import JournalTests  # noqa: E402
from ._leases import LeaseTests  # noqa: E402

__all__ = ["CheckpointerFactory", "JournalConformance"]

CheckpointerFactory = Callable[[], "Checkpointer | Awaitable[Checkpointer]"]


class JournalConformance(JournalTests, LeaseTests, IndexTests):
    """Every test of the suite; a subclass named ``Test...`` gives ``checkpointer_factory``."""

    pytestmark = pytest.mark.asyncio

    @pytest_asyncio.fixture
    async def store(self, checkpointer_factory: CheckpointerFactory) -> AsyncIterator[Checkpointer]:
        """A fresh, empty store from the subclass's factory, closed after the test."""
        made = checkpointer_factory()
        backend = await made if isawaitable(made) else made
        yield backend
        await backend.close()
