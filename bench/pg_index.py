"""The PostgreSQL run index at scale, before and after claims ordered by ``queued_at``.

    python bench/pg_index.py                      # 100,000 runs, a 200-step run (about 2 min)
    python bench/pg_index.py --runs 20000 --steps 50 --claims 100   # a quicker look
    python bench/pg_index.py --before 1c6f0db     # the code to compare with (a git revision)

One throwaway PostgreSQL (``asiento.testing.postgres``, durable settings) serves
every measurement, each in a schema of its own. The code before is extracted with
``git archive REV src`` and run in a child process on that source; the code after is
this checkout's; more children run the code after with other fill factors of ``runs``
(``--fillfactors``, by default 100, PostgreSQL's default) to show what it adds. Each
child:

1. drives one run of ``--steps`` model+tool steps (the real ``Agent`` loop, a scripted
   model) alone in the table, and counts the updates of ``runs`` and how many were
   HOT (``pg_stat_user_tables``, read once the child's connections have closed);
2. fills ``runs`` with ``--runs`` runs (95 % closed, 5 % queued), then drives the
   same run among them (its row on a full page), and counts again;
3. claims 256 runs (in flight) and appends ``--appends`` records to each, as steps
   would, counting the updates, the WAL they wrote and the size of ``runs_claimable``;
4. times ``--claims`` claims of one run and of 64 runs (each released right after),
   with those 256 runs in flight.

Figures and ratios (after / before) measured in the same run; never pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
IN_FLIGHT = 256  # runs leased while the claims are timed (4 workers x concurrency 64)
SETTLE_SECONDS = 20.0  # how long to wait for a closed backend's statistics


# -- the child: one version of asiento in one schema ---------------------------------------


def _script(steps: int) -> Any:
    from asiento import ModelResponse, ToolCall
    from asiento.testing import ScriptedGateway

    asks = [
        ModelResponse(text="", tool_calls=[ToolCall(name="step", arguments={"n": n})])
        for n in range(steps)
    ]
    return ScriptedGateway([*asks, ModelResponse(text="done")])


def _updates(dsn: str) -> tuple[int, int]:
    """``runs``'s (updates, HOT updates), read by this checkout's ``hot_updates``."""
    hot_updates: Callable[[str], tuple[int, int]] = _this_checkouts_postgres().hot_updates
    return hot_updates(dsn)


@functools.cache
def _this_checkouts_postgres() -> ModuleType:
    """This checkout's ``asiento.testing.postgres``, loaded from its file: the child's
    ``asiento`` may be the code before, which has no ``hot_updates``."""
    path = ROOT / "src" / "asiento" / "testing" / "postgres.py"
    spec = importlib.util.spec_from_file_location("asiento.testing._postgres_now", path)
    assert spec is not None
    assert spec.loader is not None
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _settled(dsn: str, at_least: int) -> tuple[int, int]:
    """The counts once every closed backend's statistics arrived (a bounded wait)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    counts = _updates(dsn)
    while counts[0] < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
        counts = _updates(dsn)
    time.sleep(0.5)  # the last flush may trail the first that crossed the line
    return _updates(dsn)


async def _drive(dsn: str, run_id: str, steps: int) -> None:
    from asiento import Agent, FinalStep, Session, tool
    from asiento.journal.postgres import PostgresCheckpointer

    @tool(idempotent=True)
    def step(n: int) -> int:
        """A trivial tool."""
        return n

    store = await PostgresCheckpointer.connect(dsn, max_size=1)
    try:
        session = Session(run_id, _script(steps), store)
        agent = Agent(tools=[step], max_turns=steps + 1)
        done = [s async for s in agent.run("count", session=session)]
        assert isinstance(done[-1], FinalStep)
    finally:
        await store.close()


def _hot_run(dsn: str, run_id: str, steps: int) -> dict[str, int]:
    before = _settled(dsn, 0)
    asyncio.run(_drive(dsn, run_id, steps))
    after = _settled(dsn, before[0] + 2 * steps)
    return {"updates": after[0] - before[0], "hot": after[1] - before[1]}


def _fill(dsn: str, runs: int) -> None:
    """``runs`` runs, 95 % closed and 5 % queued (each queued at its last update, as the
    migration leaves them), and the run to drive in the middle, on a full page."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        queued = conn.execute(
            "SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema()"
            " AND table_name = 'runs' AND column_name = 'queued_at'"
        ).fetchone()
        extra = (", queued_at", ", 1.7e9 + n") if queued else ("", "")
        conn.execute(
            "INSERT INTO runs (run_id, status, events, created_at, updated_at, task, agent"
            f"{extra[0]}) SELECT 'bulk-' || lpad(n::text, 7, '0'),"
            " CASE WHEN n %% 20 = 0 OR n = %(middle)s THEN 'running' ELSE 'closed' END, 10,"
            " 1.7e9 + n, 1.7e9 + n, CASE WHEN n = %(middle)s THEN NULL ELSE 'task ' || n END,"
            f" 'default'{extra[1]} FROM generate_series(1, %(runs)s) AS n",
            {"runs": runs, "middle": runs // 2},
        )
        conn.execute("ANALYZE runs")


async def _in_flight(dsn: str, appends: int) -> Any:
    """Claim IN_FLIGHT runs and append ``appends`` records to each, as their steps would."""
    from asiento import Phase, StepEvent
    from asiento.journal.postgres import PostgresCheckpointer
    from asiento.lease import Holder

    store = await PostgresCheckpointer.connect(dsn, max_size=4)
    claims = []
    for _ in range(IN_FLIGHT // 64):
        claims += await store.claim_many(Holder.here(), limit=64, ttl=3600)
    for n in range(appends):
        for claim in claims:
            event = StepEvent(
                run_id=claim.lease.run_id, step_id=f"m{n + 1}", phase=Phase.RESULT, payload={}
            )
            await store.append(event, lease=claim.lease)
    await store.close()
    return len(claims)


async def _time_claims(dsn: str, claims: int, limit: int) -> list[float]:
    """Milliseconds per claim of ``limit`` runs, each released right after (not timed)."""
    from asiento.journal.postgres import PostgresCheckpointer
    from asiento.lease import Holder

    store = await PostgresCheckpointer.connect(dsn, max_size=1)
    holder, took = Holder.here(), []
    try:
        for _ in range(claims):
            start = time.perf_counter()
            taken = await store.claim_many(holder, limit=limit, ttl=3600)
            took.append((time.perf_counter() - start) * 1000)
            for claim in taken:
                await store.release(claim.lease)
    finally:
        await store.close()
    return took


def _wal(dsn: str) -> int:
    """Bytes of WAL the server has written so far (no other child runs meanwhile)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def _index_sizes(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname, pg_relation_size(oid) FROM pg_class"
            " WHERE relname IN ('runs', 'runs_claimable', 'runs_by_status', 'runs_pkey')"
            " AND relnamespace = current_schema()::regnamespace"
        ).fetchall()
    return {name: int(size) for name, size in rows}


def child(dsn: str, args: argparse.Namespace) -> None:
    runs, steps, appends, claims = args.runs, args.steps, args.appends, args.claims
    from asiento.journal.postgres import PostgresCheckpointer

    async def migrate() -> None:
        await (await PostgresCheckpointer.connect(dsn, max_size=1)).close()

    asyncio.run(migrate())
    if args.fillfactor:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"ALTER TABLE runs SET (fillfactor = {args.fillfactor})")
    report: dict[str, Any] = {"alone": _hot_run(dsn, "alone", steps)}
    _fill(dsn, runs)
    report["among"] = _hot_run(dsn, f"bulk-{runs // 2:07d}", steps)
    before, wal = _settled(dsn, 0), _wal(dsn)
    flying = asyncio.run(_in_flight(dsn, appends))
    report["wal_per_append"] = (_wal(dsn) - wal) / (flying * appends)
    after = _settled(dsn, before[0] + flying * appends)
    report["fleet"] = {"updates": after[0] - before[0], "hot": after[1] - before[1]}
    report["sizes"] = _index_sizes(dsn)
    report["claim_1"] = asyncio.run(_time_claims(dsn, claims, 1))
    report["claim_64"] = asyncio.run(_time_claims(dsn, max(claims // 4, 5), 64))
    print(json.dumps(report))


# -- the parent: a server, three children, one table ---------------------------------------


def _old_source(revision: str, into: Path) -> Path:
    """``git archive REV src`` unpacked in ``into``: the code before."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "src"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def _schema(admin_dsn: str) -> str:
    name = "bench_index_" + uuid.uuid4().hex[:10]
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{name}"')
    return make_conninfo(admin_dsn, options=f"-csearch_path={name}")


def _measure(admin_dsn: str, source: Path, args: argparse.Namespace, fillfactor: int) -> Any:
    env = dict(os.environ, PYTHONPATH=str(source))
    argv = [sys.executable, str(HERE), "--role", "child", "--dsn", _schema(admin_dsn)]
    argv += ["--runs", str(args.runs), "--steps", str(args.steps), "--appends", str(args.appends)]
    argv += ["--claims", str(args.claims), "--fillfactor", str(fillfactor)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the child on {source} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _hot(part: dict[str, int]) -> str:
    share = part["hot"] / part["updates"] if part["updates"] else 0.0
    return f"{part['updates']:>6} updates, {part['hot']:>6} HOT ({share:.0%})"


def _ms(took: list[float]) -> tuple[float, float]:
    ordered = sorted(took)
    return statistics.median(ordered), ordered[int(0.95 * (len(ordered) - 1))]


def _print(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\nruns index on PostgreSQL: {args.runs:,} runs, a {args.steps}-step run,")
    print(f"{IN_FLIGHT} runs in flight x {args.appends} appends, {args.claims} claims\n")
    for what, label in (
        ("alone", f"{args.steps}-step run alone"),
        ("among", f"{args.steps}-step run among {args.runs:,}"),
        ("fleet", f"{IN_FLIGHT} runs x {args.appends} appends"),
    ):
        print(f"{label}:")
        for name, report in results.items():
            print(f"  {name:<22} {_hot(report[what])}")
    print("\nsizes after the appends (kB): runs, runs_claimable")
    for name, report in results.items():
        sizes = report["sizes"]
        print(f"  {name:<22} {sizes['runs'] // 1024:>7} {sizes['runs_claimable'] // 1024:>7}")
    print("\nWAL per append of a run in flight (bytes):")
    for name, report in results.items():
        print(f"  {name:<22} {report['wal_per_append']:7.0f}")
    print("\nclaim latency, ms (p50 / p95), with the runs in flight:")
    for name, report in results.items():
        one, many = _ms(report["claim_1"]), _ms(report["claim_64"])
        print(f"  {name:<22} 1 run {one[0]:6.2f} / {one[1]:6.2f}   64 runs "
              f"{many[0]:6.2f} / {many[1]:6.2f}")  # fmt: skip
    before, after = results["before"], results["after"]
    print("\nratios after / before:")
    for what in ("alone", "among", "fleet"):
        b, a = before[what], after[what]
        print(f"  {what:<6} HOT share {a['hot'] / max(a['updates'], 1):.2f} vs "
              f"{b['hot'] / max(b['updates'], 1):.2f}")  # fmt: skip
    for key in ("claim_1", "claim_64"):
        print(f"  {key} p50 {_ms(after[key])[0] / _ms(before[key])[0]:.2f}x, "
              f"p95 {_ms(after[key])[1] / _ms(before[key])[1]:.2f}x")  # fmt: skip
    print(f"  WAL per append {after['wal_per_append'] / before['wal_per_append']:.2f}x")
    size = after["sizes"]["runs_claimable"] / before["sizes"]["runs_claimable"]
    print(f"  runs_claimable size {size:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100_000, help="runs in the table (100000)")
    parser.add_argument("--steps", type=int, default=200, help="steps of the driven run (200)")
    parser.add_argument("--appends", type=int, default=20, help="appends per run in flight (20)")
    parser.add_argument("--claims", type=int, default=200, help="claims timed (200)")
    parser.add_argument("--before", default="1c6f0db", help="the revision before (1c6f0db)")
    parser.add_argument(
        "--fillfactors", default="100", help="fill factors to run the code after with too (100)"
    )
    parser.add_argument("--role", choices=["child"], help=argparse.SUPPRESS)
    parser.add_argument("--dsn", help=argparse.SUPPRESS)
    parser.add_argument("--fillfactor", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "child":
        child(args.dsn, args)
        return
    sys.path.insert(0, str(ROOT / "src"))
    from asiento.testing.postgres import PostgresUnavailable, start_local_postgres

    try:
        server = start_local_postgres()
    except PostgresUnavailable as exc:
        raise SystemExit(str(exc)) from exc
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as folder:
            old = _old_source(args.before, Path(folder))
            results = {
                "before": _measure(server.dsn, old, args, 0),
                "after": _measure(server.dsn, ROOT / "src", args, 0),
            }
            for fill in (int(f) for f in args.fillfactors.split(",") if f):
                after = _measure(server.dsn, ROOT / "src", args, fill)
                results[f"after, fillfactor {fill}"] = after
    finally:
        server.stop()
    _print(results, args)
    print(f"\nTotal {time.monotonic() - started:.0f}s.")


if __name__ == "__main__":
    main()
