"""The step-overhead benchmark runs, and the counts it prints (never its times) are right."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "step_overhead.py"


def _table_row(output: str, column: str, row: str) -> dict[str, str]:
    """The cells of ``row`` in the first printed table whose header has ``column``."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if column in line.split())
    header = lines[start].split()
    for line in lines[start + 1 :]:
        if not line.strip() or line.startswith("=="):
            break
        cells = line.split()
        if cells[0] == row:
            return dict(zip(header, cells, strict=True))
    raise AssertionError(f"no row {row!r} under the header {header}")


def test_quick_bench_reports_two_commits_per_model_tool_step(tmp_path: Path) -> None:
    """`--quick` exits 0 and counts 2 durable commits per model+tool step at full durability."""
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = _table_row(done.stdout, "commits/step", "asiento-full")
    assert row["commits/step"] == "2", done.stdout
    assert row["wal_commits/step"] == "2", done.stdout
    assert "the resume paid model_calls=1 tool_calls=0" in done.stdout, done.stdout
    for floor in ("same_sql", "least_python"):  # the floors ran (times are figures, not checks)
        for durability in ("full", "process"):
            row = _table_row(done.stdout, "vs_least_python", f"{floor}-{durability}")
            assert float(row["µs/step"]) > 0, done.stdout


@pytest.mark.parametrize("jitter", ["0", "0.5"])
def test_fleet_concurrency_table_closes_every_run(tmp_path: Path, jitter: str) -> None:
    """`bench/fleet.py --concurrency-table` drives every run to its end at each level
    (`--jitter`: answers of unequal times, against the ideal of those times)."""
    bench = BENCH.parent / "fleet.py"
    options = ["--concurrency-table", "1,4", "--quick", "--latency", "0.01", "--dir", str(tmp_path)]
    options += ["--jitter", jitter]
    done = subprocess.run(
        [sys.executable, str(bench), *options],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for level, runs in (("1", "8"), ("4", "8")):
        row = _table_row(done.stdout, "concurrency", level)
        assert (row["runs"], row["closed"]) == (runs, runs), row
        assert 0 < float(row["of_ideal"]) < 1.5, row
        assert 0 < float(row["memory_of_ideal"]) < 1.5, row  # the ceiling ran beside it
    assert ("x U(0.5, 1.5)" in done.stdout) == (jitter == "0.5"), done.stdout


def test_worker_loop_bench_closes_every_run(tmp_path: Path) -> None:
    """`bench/worker_loop.py` drives K runs and the CPU-heavy neighbour to their end."""
    bench = BENCH.parent / "worker_loop.py"
    options = ["--runs", "8", "--steps", "2", "--neighbour-seconds", "0.3", "--dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(bench), *options],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    if "skipped: strace" in done.stdout:
        return
    row = next(line.split() for line in done.stdout.splitlines() if "this checkout" in line)
    assert row[2] == "9", done.stdout  # the 8 runs and the neighbour closed


def test_telemetry_bench_measures_off_on_and_before(tmp_path: Path) -> None:
    """`--telemetry --quick` runs the three rows; a traced run exports 2 spans a step."""
    done = subprocess.run(
        [sys.executable, str(BENCH), "--telemetry", "--quick", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    off = _table_row(done.stdout, "spans/run", "telemetry-off")
    on = _table_row(done.stdout, "spans/run", "telemetry-on")
    before = _table_row(done.stdout, "spans/run", "before-6769d5a")
    steps = 40  # QUICK: 41 chat spans, 40 execute_tool, the pass's and the run's
    assert (off["spans/run"], on["spans/run"]) == ("0", str(2 * steps + 3)), done.stdout
    assert int(on["commits/run"]) == int(off["commits/run"]) + 1
    # Since 6769d5a the closing append gives the lease up: a release commit fewer a run.
    assert int(off["commits/run"]) == int(before["commits/run"]) - 1
    for row in (off, on, before):
        assert float(row["ms/step_process"]) > 0, done.stdout


@pytest.mark.full  # 20 s; tests/integrations/test_langgraph_crashes.py kills in CI
def test_langgraph_kills_bench_prints_both_tables(tmp_path: Path) -> None:
    """`bench/langgraph_kills.py --quick` with one kill a side runs to its end and prints the
    side-by-side counts and the overhead table (its figures are not checked)."""
    bench = BENCH.parent / "langgraph_kills.py"
    options = ["--quick", "--kills", "1", "--reps", "1", "--steps", "5", "--dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(bench), *options],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for heading in ("random SIGKILLs", "duplicated refunds", "re-paid generations", "ms/step over"):
        assert heading in done.stdout, done.stdout
    overhead = done.stdout.split("ms/step over", 1)[1].splitlines()
    row = next(line.split() for line in overhead if line.startswith("asiento "))
    assert float(row[3]) > 0, done.stdout  # ms/step


@pytest.mark.full  # 40 s under valgrind; the fleet bench's worker is smoke-tested above
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_worker_instructions_bench_counts_a_run() -> None:
    """`bench/worker_instructions.py` counts a run's instructions under callgrind."""
    bench = BENCH.parent / "worker_instructions.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--runs", "2,4", "--concurrency", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    row = done.stdout.strip().splitlines()[-1].split()
    assert row[:2] == ["this", "checkout"], done.stdout
    assert float(row[2]) > 0.1, done.stdout  # millions of instructions a run
