"""Un run cerrado no se reabre.

Once the journal holds a FinalStep, resuming the run returns what happened
instead of walking it again: zero model calls, zero tool calls, one
FinalStep(replayed=True), and nothing written. Whoever wants the timeline reads
it with ``Checkpointer.load``.

This process runs the agent to its end; a new process resumes the closed run
with a new gateway and counts its calls.

    python examples/propiedades/06_run_cerrado.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _medir import (
    CountingGateway,
    ending,
    lines,
    model_calls,
    pass_child,
    report,
    reported,
    run_pass,
    table,
    tally,
    verdict,
)

from asiento import (
    Agent,
    FinalStep,
    ModelResponse,
    Session,
    SqliteCheckpointer,
    Step,
    ToolCall,
    tool,
)

RESPUESTAS = [
    ModelResponse(tool_calls=[ToolCall(name="read", arguments={"path": "/x"})]),
    ModelResponse(text="/x dice: hola"),
]


async def vuelta(db: Path, work: Path, n: int) -> None:
    """Drive run-1 once in this process; report the steps yielded and the timeline length."""
    log = work / f"tool.{n}"

    @tool(idempotent=True)
    def read(path: str) -> str:
        """Read a file."""
        tally(log, path)
        return "hola"

    agente = Agent(tools=[read])
    store = SqliteCheckpointer(db)
    gateway = CountingGateway(RESPUESTAS, work / f"model.{n}")
    try:
        pasos = [p async for p in agente.run("lee /x", session=Session("run-1", gateway, store))]
        timeline = await store.load("run-1")
    finally:
        await store.close()
    report(
        {
            "steps": [nombre(p) for p in pasos],
            "text": next((p.text for p in pasos if isinstance(p, FinalStep)), None),
            "timeline": len(timeline),
        }
    )


def nombre(paso: Step) -> str:
    if isinstance(paso, FinalStep):
        return f"FinalStep(replayed={paso.replayed})"
    return type(paso).__name__


def main() -> int:
    if run_pass(vuelta):
        return 0
    rows, seen = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for n in (1, 2):
            proc = pass_child(__file__, work, n)
            seen[n] = reported(proc) or {"steps": [ending(proc)], "text": None, "timeline": 0}
            measured = (model_calls(work / f"model.{n}"), len(lines(work / f"tool.{n}")))
            seen[n]["calls"] = measured
            rows.append((n, *measured, seen[n]["timeline"], " · ".join(seen[n]["steps"])))
    headers = ["pass", "model calls", "tool calls", "Checkpointer.load length", "steps yielded"]
    table("run-1: closed in pass 1, resumed in a new process in pass 2", headers, rows)
    print(f"final answer, pass 1: {seen[1]['text']!r}; pass 2: {seen[2]['text']!r}")
    problems = []
    if seen[2]["calls"] != (0, 0):
        problems.append(f"resuming the closed run made calls: {seen[2]['calls']}")
    if seen[2]["steps"] != ["FinalStep(replayed=True)"]:
        problems.append(f"resuming yielded {seen[2]['steps']}, not one replayed FinalStep")
    if seen[2]["text"] != seen[1]["text"] or seen[1]["text"] is None:
        problems.append("the replayed FinalStep does not carry the recorded answer")
    if not 0 < seen[1]["timeline"] == seen[2]["timeline"]:
        problems.append("the timeline changed (or is empty) after resuming a closed run")
    return verdict(problems, "a closed run is answered from its record; nothing is called again")


if __name__ == "__main__":
    sys.exit(main())
