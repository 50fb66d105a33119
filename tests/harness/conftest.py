"""Fixtures of the harness tests: the plugin's fixture, an invoice server, the sample app.

``crash_harness`` comes from the pytest plugin (``asiento.testing.pytest_plugin``);
it is imported here too, so that these tests run before the ``pytest11`` entry
point is installed (once it is, this conftest's copy simply takes precedence).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from asiento.testing import CrashHarness, sample
from asiento.testing.invoices import InvoiceServer
from asiento.testing.pytest_plugin import crash_harness  # noqa: F401

TESTS = str(Path(__file__).resolve().parent.parent)
SAMPLE = "asiento.testing.sample:factory"

HarnessFactory = Callable[..., CrashHarness]


@pytest.fixture
def invoices() -> Iterator[InvoiceServer]:
    """A billing API on 127.0.0.1 that ignores idempotency keys: only lookups can save us."""
    with InvoiceServer(honour_keys=False) as server:
        yield server


@pytest.fixture
def sample_harness(
    request: pytest.FixtureRequest, invoices: InvoiceServer
) -> Callable[..., CrashHarness]:
    """A harness on the sample agent, its invoices counted at the destination."""
    factory: HarnessFactory = request.getfixturevalue("crash_harness")

    def make(**options: Any) -> CrashHarness:
        return factory(
            SAMPLE,
            task=sample.TASK,
            env={sample.INVOICES_ENV: invoices.invoices_url},
            destination=lambda: [invoice["number"] for invoice in invoices.invoices],
            warm_up="asiento.testing.sample:warm_up",
            **options,
        )

    return make
