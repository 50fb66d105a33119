"""An in-process wake-up for ``wait_for_work``: what one store object's own submit, release
or status change rings, so a worker on the same object need not wait out its poll."""

from __future__ import annotations

import asyncio
import contextlib


class WakeUp:
    """Rung when a run may have become claimable; ``wait`` returns on a ring or a timeout.

    Only this store object's writes ring it: another process's submit is seen at the
    next poll (the timeout), as before.
    """

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _current(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._event is None or self._loop is not loop:  # an Event belongs to one loop
            self._event, self._loop = asyncio.Event(), loop
        return self._event

    def ring(self) -> None:
        with contextlib.suppress(RuntimeError):  # no loop running: nobody is waiting
            self._current().set()

    async def wait(self, timeout: float) -> None:
        event = self._current()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(0.0, timeout))
        event.clear()
