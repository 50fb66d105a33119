"""Every script in examples/propiedades runs, holds its property and prints what it measured."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "propiedades"
SCRIPTS = sorted(EXAMPLES.glob("[0-9]*.py"))

# The measured figures each script must print (rows of its table, as regexes).
FIGURES: dict[str, list[str]] = {
    "01_journal": [
        r"m1\s+result\s+\d+",
        r"m1\.t1\s+intent\s+allow\s+\d+",
        r"final\s+result\s+\d+",
        r"10 records, \d+ payload bytes, \d+ bytes per record",
        r"model calls made: 3, tool calls made: 2",
        r"payloads holding a 'messages' key: no",
    ],
    "02_durabilidad": [
        r"1\s+1\s+1\s+killed by SIGKILL\s+← el proceso muere aquí",
        r"2\s+1\s+0\s+closed\s+← solo ocurre lo que no llegó a ocurrir",
        r"3\s+0\s+0\s+already closed\s+← un run cerrado no se reabre",
    ],
    "03_escritura_anticipada": [
        r"intent and result\s+after_result\s+intent \+ submitted \+ result\s+1\s+0\s+no",
        r"neither intent nor result\s+before_intent\s+nothing\s+0\s+1\s+no",
        r"intent, no result, non-idempotent\s+after_submitted\s+intent \+ submitted\s+0\s+0\s+yes",
        r"intent, no result, idempotent\s+after_submitted\s+intent \+ submitted\s+0\s+1\s+no",
    ],
    "04_aprobacion": [
        r"pass 1\s+1\s+0\s+suspended\s+ModelStep · ToolStep\(awaiting_approval, "
        r"require_approval\) · ApprovalStep",
        r"approve\s+running\s+approved by ana, in another process",
        r"pass 2\s+1\s+1\s+closed\s+ToolStep\(ok, approved\) · ModelStep · FinalStep",
        r"pass 3\s+0\s+0\s+closed\s+FinalStep\(replayed=True\)",
    ],
    "07_efectos": [
        r"invoices the server holds: 1",
        r"reconcile path: lookup \(attempts: 1\)",
    ],
    "05_idempotencia_proveedor": [
        r"child: killed by SIGKILL; requests sent 1, answers received 0",
        r"resumed after the SIGKILL\s+m1\s+run-1:m1:[0-9a-f]{32}\s+yes",
        r"same run_id, another task\s+m1\s+run-1:m1:[0-9a-f]{32}\s+no",
        r"same run_id, other instructions\s+m1\s+run-1:m1:[0-9a-f]{32}\s+no",
    ],
    "06_run_cerrado": [
        r"1\s+2\s+1\s+6\s+ModelStep · ToolStep · ModelStep · FinalStep\(replayed=False\)",
        r"2\s+0\s+0\s+6\s+FinalStep\(replayed=True\)",
    ],
    "09_un_conductor": [
        r"A\s+holds run-1 \(fence 1, lease_ttl=2\.0\), in esperar \d+\.\d s, lease renewed; "
        r"then SIGSTOP\s+1\s+0\s+-",
        r"B\s+RunLocked in \d+\.\d+ s, naming A's pid \d+\s+0\s+0\s+-",
        r"C\s+took over \d+\.\d s after A's lease expired, fence 1 → 2; closed\s+2\s+1\s+-",
        r"A\s+SIGCONT, esperar returns: LeaseLost\s+0\s+0\s+0",
        r"K\s+holds run-2 \(fence 1, lease_ttl=30\), in esperar; killed by SIGKILL\s+1\s+0\s+-",
        r"D\s+took over \d+\.\d s after the SIGKILL, with \d+ s of K's lease left, "
        r"fence 1 → 2; closed\s+2\s+1\s+-",
        r"B got: RunLocked: run 'run-1' is being driven by another session \(pid \d+ on ",
        r"A got: LeaseLost: run 'run-1': this session's lease \(token 1\) expired",
    ],
    "10_parada_ordenada": [
        r"pass 1\s+ShutdownRequested, exit 75\s+1\s+1\s+0\s+released\s+running\s+m1\.t1 ok\n",
        r"pass 2\s+closed, exit 0\s+2\s+0\s+1\s+released\s+closed\s+m1\.t1 ok, m2\.t1 ok\n",
        r"cobrar saw the stop requested while it ran: True\n",
    ],
    "11_decision_durante_replay": [
        r"pass 1\s+4\s+0\s+suspended\s+9 steps: … · ModelStep · "
        r"ToolStep\(awaiting_approval, require_approval\) · ApprovalStep",
        r"A reads\s+suspended\s+the journal: 14 records, approval among them: False",
        r"B\s+running\s+asiento approve: exit 0: approved run 'run-1' step 'm4\.t1' \(by ana\)",
        r"A goes on\s+1\s+1\s+closed\s+3 steps: ToolStep\(ok, approved\) · ModelStep · FinalStep",
        r"pass C\s+0\s+0\s+closed\s+1 step: FinalStep\(replayed=True\)",
        r"approve again\s+closed\s+exit 1, records (\d+) → \1\n",
        r"approve again said: Error: run 'run-1' is closed: a closed run cannot be approved",
        r"payments in all: 1\n",
    ],
    "12_abandonar_detiene": [
        r"payments started after asiento abandon returned: 0\n",
        r"payments in all: [1-5] of 6 \(2 before abandon ran\)",
        r"asiento abandon: exit 0: run 'run-1' is closed: abandoned by ana: se paga de más",
        r"A ended: RunAbandoned: run 'run-1' was abandoned by ana: se paga de más while this "
        r"session drove it",
        r"status in the index: closed\n",
        r"a worker afterwards: found work False, claimed 0, model calls and payments 0 ",
    ],
    "15_trazas": [
        r"1\s+killed by SIGKILL\s+1\s+1",
        r"2\s+exit 0\s+1\s+0",
        r"3\s+exit 0\s+0\s+0",
        r"invoke_agent facturas  \[pass\.fence=1, pass\.cause=first, pass\.died=True\]",
        r"invoke_agent facturas  \[pass\.fence=2, pass\.cause=taken_over, run\.status=closed, "
        r"replayed\.model_calls=1, replayed\.tool_calls=1\]",
        r"trace ids: 1",
        r"chat spans: 2, generations the model answered: 2",
        r"execute_tool spans: 1, invoices issued: 1",
        r"spans whose parent is missing: 0",
    ],
    "14_streaming": [
        r"1\s+killed by SIGKILL\s+1\s+killed by SIGKILL",
        r"2\s+exit 0\s+1\s+StreamRestart\(m1, attempt 2\) · \d+ deltas · ModelStep · "
        r"FinalStep\(replayed=False\)",
        r"3\s+exit 0\s+0\s+FinalStep\(replayed=True\)",
        r"pass 2 text equals the recorded answer: True",
        r"records of m1 after pass 2: 1\n",
    ],
    "13_mcp": [
        r"consultar\s+killed by SIGKILL\s+closed\s+2\s+2\s+1\n",
        r"enviar\s+killed by SIGKILL\s+UncertainEffect\s+1\s+1\s+1\n",
        r"cobrar\s+killed by SIGKILL\s+closed\s+2\s+1\s+1\n",
    ],
}
README = EXAMPLES / "README.md"


def test_every_property_has_a_script() -> None:
    """The glob finds every script FIGURES names (a renamed script is not silently skipped)."""
    assert {p.stem for p in SCRIPTS} >= set(FIGURES)


def test_every_script_is_listed_in_the_readme() -> None:
    """Each script has its paragraph in examples/propiedades/README.md."""
    listed = set(re.findall(r"^- `(\d\d_\w+)\.py` — \*\*", README.read_text(), re.MULTILINE))
    assert listed == {p.stem for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_example_measures_its_property(script: Path) -> None:
    """The script exits 0, says its property holds, and prints the figures it measured."""
    env = {k: v for k, v in os.environ.items() if k != "ASIENTO_CRASH_AT"}
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert re.search(r"^OK: ", proc.stdout, re.MULTILINE), output
    assert "FAIL" not in proc.stdout, output
    for figure in FIGURES.get(script.stem, [r"\d"]):
        assert re.search(figure, proc.stdout), f"{figure!r} not in:\n{output}"
