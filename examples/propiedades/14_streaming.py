"""Streaming: the words come as they are written; a cut stream is announced, never mixed.

An agent answers in one long streamed model step (``StreamingScriptedGateway``,
in pieces of 4 characters). Three processes, one SQLite file:

1. pass 1 runs with ``stream=True`` and is killed with SIGKILL after it showed
   three pieces of the answer: nothing of that step was recorded;
2. pass 2 resumes with ``stream=True``: before the new attempt's first piece it
   yields ``StreamRestart`` (a UI drops the half answer it showed), then the whole
   answer in pieces, then the durable ``ModelStep``; the model is asked again
   (without ``asiento gateway`` the cut generation was paid and is paid again);
3. pass 3 resumes without streaming: the run is closed, nothing is asked.

Each process counts the generations it started in an fsynced file.

    python examples/propiedades/14_streaming.py
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from _medir import ending, lines, pass_child, report, reported, run_pass, table, tally, verdict

from asiento import (
    Agent,
    Delta,
    FinalStep,
    ModelRequest,
    ModelResponse,
    ModelStep,
    Session,
    SqliteCheckpointer,
    StreamPart,
    StreamRestart,
)
from asiento.testing import StreamingScriptedGateway

RESPUESTA = "La factura 42 está pagada desde el lunes; no hace falta volver a enviarla."
CORTE = 3  # pass 1 dies after showing this many pieces


class Contando(StreamingScriptedGateway):
    """Writes ``sent KEY`` to an fsynced file before each generation it starts."""

    def __init__(self, log: Path) -> None:
        super().__init__([ModelResponse(text=RESPUESTA)], chunk=4, pause=0.002)
        self.log = log

    async def stream(
        self, request: ModelRequest, *, idempotency_key: str
    ) -> AsyncIterator[StreamPart | ModelResponse]:
        tally(self.log, f"sent {idempotency_key}")
        async for item in super().stream(request, idempotency_key=idempotency_key):
            yield item


async def vuelta(db: Path, work: Path, n: int) -> None:
    """Pass ``n`` (1: streamed, killed mid-stream; 2: streamed; 3: plain)."""
    store = SqliteCheckpointer(db)
    session = Session("run-1", Contando(work / f"model.{n}"), store)
    shown: list[str] = []
    seen: list[str] = []
    items: AsyncIterator[Any] = Agent().run("¿está pagada la 42?", session=session, stream=n < 3)
    async for item in items:
        if isinstance(item, StreamRestart):
            seen.append(f"StreamRestart({item.step_id}, attempt {item.attempt})")
        elif isinstance(item, Delta):
            shown.append(item.text)
            if n == 1 and len(shown) == CORTE:
                os.kill(os.getpid(), signal.SIGKILL)
        elif isinstance(item, ModelStep):
            seen.append(f"{len(shown)} deltas · ModelStep")
        elif isinstance(item, FinalStep):
            seen.append(f"FinalStep(replayed={item.replayed})")
            final = item.text
    records = len(await store.load_step("run-1", "m1"))
    await store.close()
    report({"seen": seen, "text": "".join(shown), "final": final, "records": records})


def main() -> int:
    if run_pass(vuelta):
        return 0
    rows, seen = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for n in (1, 2, 3):
            proc = pass_child(__file__, work, n)
            got = reported(proc) or {"seen": [ending(proc)], "text": "", "final": None}
            got["calls"] = len(lines(work / f"model.{n}", "sent "))
            seen[n] = got
            rows.append((n, ending(proc), got["calls"], " · ".join(got["seen"])))
    headers = ["pass", "ended", "generations started", "what the caller saw"]
    table("run-1: one streamed model step, cut by SIGKILL in pass 1", headers, rows)
    print(f"pieces shown before the kill: {CORTE}")
    print(f"pass 2 text equals the recorded answer: {seen[2]['text'] == seen[2]['final']}")
    print(f"records of m1 after pass 2: {seen[2].get('records')}")
    problems = []
    if [seen[n]["calls"] for n in (1, 2, 3)] != [1, 1, 0]:
        problems.append(f"generations per pass: {[seen[n]['calls'] for n in (1, 2, 3)]}")
    if not seen[2]["seen"] or not seen[2]["seen"][0].startswith("StreamRestart(m1"):
        problems.append(f"pass 2 did not announce the restart first: {seen[2]['seen']}")
    if seen[2]["text"] != RESPUESTA or seen[2]["final"] != RESPUESTA:
        problems.append("pass 2 did not show the whole recorded answer")
    if seen[3]["seen"] != ["FinalStep(replayed=True)"]:
        problems.append(f"pass 3 saw {seen[3]['seen']}, not the closed run")
    return verdict(
        problems, "a cut stream is announced and asked again; the journal holds one answer"
    )


if __name__ == "__main__":
    sys.exit(main())
