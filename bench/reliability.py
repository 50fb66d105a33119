"""Reliability figures: crash campaigns against the sample agent, counted and tabled.

    python bench/reliability.py                  # --tier ci: a few minutes on 2 cores
    python bench/reliability.py --tier large     # 20,000 SIGKILLs on SQLite, 5,000 on PostgreSQL
    python bench/reliability.py --tier smoke     # under a minute: the tests run this one
    python bench/reliability.py --pg-dsn "host=... dbname=..."   # an existing server
    python bench/reliability.py --no-pg          # SQLite only

The agent is ``asiento.testing.sample`` (idempotent and non-idempotent tools, a
file written with ``write_atomic`` behind an approval, an invoice billed to a
real HTTP server that ignores idempotency keys). Every campaign runs it in real
child processes killed with real SIGKILLs and checks the invariants of
``asiento.testing.invariants`` from outside (see ``asiento.testing.harness``):

- every crash point: each named point at every passage a clean run goes
  through, in every operation (pass, approval), on SQLite and PostgreSQL;
- random SIGKILLs: random armed points and SIGKILLs at random instants; on
  PostgreSQL also connections cut inside commits, connections terminated at
  random instants by the parent, and server restarts (immediate: a crash);
- lease races: a driver stopped past its lease while another takes over;
- decision races: approvals and resolutions (API and ``asiento`` command, the
  deciding process sometimes killed) against a pass resuming the run, then a
  worker drains the store; abandon against a pass that drives the run;
- fsync audit: under strace, every rename is followed by a directory fsync
  before the journal commits the step's result;
- in the ci and large tiers, the hostile-condition campaigns of tests/inputs run
  by pytest (disk full, SQLITE_BUSY from another process, the Hypothesis state
  machine; its large profile in the large tier), counted in a third table.

Then the negative controls: each campaign must catch a deliberately planted
bug (no write-ahead before the effect, no fencing check, no directory fsync,
a loop status written over a person's decision, an abandon without the fence).

The first table must show zero violations; the second, every plant caught.
The exit code is 0 only then. PostgreSQL is started by the script (from the
``pgserver`` package) unless ``--pg-dsn`` names a server.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostile

from asiento.testing import sample
from asiento.testing.harness import CrashHarness
from asiento.testing.invoices import InvoiceServer
from asiento.testing.postgres import start_local_postgres
from asiento.testing.report import Report


@dataclass(frozen=True)
class Tier:
    """How big each campaign is."""

    kills: dict[str, int]
    races: int
    restarts: int
    max_seconds: float
    control_kills: int  # the storm control's budget (0: the matrix alone catches it)
    hypothesis: str | None  # the state machine's profile; None: skip tests/inputs
    decisions: dict[str, int]  # races of each kind of decision (approve, resolve)
    abandons: int  # runs abandoned while a pass drives them


# fmt: off
TIERS = {
    "smoke": Tier(
        kills={"sqlite": 30, "postgresql": 30}, races=1, restarts=1, max_seconds=60.0,
        control_kills=0, hypothesis=None, decisions={"sqlite": 2, "postgresql": 2}, abandons=2,
    ),
    "ci": Tier(
        kills={"sqlite": 1000, "postgresql": 1000}, races=10, restarts=2, max_seconds=600.0,
        control_kills=200, hypothesis="ci", decisions={"sqlite": 10, "postgresql": 25},
        abandons=20,
    ),
    "large": Tier(
        kills={"sqlite": 20_000, "postgresql": 5_000}, races=50, restarts=10,
        max_seconds=7200.0, control_kills=200, hypothesis="large",
        decisions={"sqlite": 2_000, "postgresql": 1_000}, abandons=500,
    ),
}
# fmt: on


class Stores:
    """A fresh store per campaign: a SQLite file, or a PostgreSQL schema (dropped at the end)."""

    def __init__(self, root: Path, pg_dsn: str | None) -> None:
        self.root, self.pg_dsn = root, pg_dsn
        self.schemas: list[str] = []

    def drop(self) -> None:
        if self.pg_dsn is None or not self.schemas:
            return
        with psycopg.connect(self.pg_dsn, autocommit=True) as conn:
            for name in self.schemas:
                conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')

    def new(self, backend: str) -> str:
        name = f"rel_{uuid.uuid4().hex[:12]}"
        if backend == "sqlite":
            return str(self.root / f"{name}.db")
        assert self.pg_dsn is not None
        with psycopg.connect(self.pg_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        self.schemas.append(name)
        return make_conninfo(self.pg_dsn, options=f"-csearch_path={name}", application_name=name)


@contextmanager
def harness(
    stores: Stores,
    root: Path,
    backend: str,
    restart: Callable[[], object] | None,
    plant: str | None = None,
) -> Iterator[CrashHarness]:
    """A harness on a fresh store, with its own invoice server (honouring no keys)."""
    with InvoiceServer(honour_keys=False) as server:
        workdir = Path(tempfile.mkdtemp(prefix=f"{backend}-", dir=root))
        crash = CrashHarness(
            "asiento.testing.sample:factory",
            task=sample.TASK,
            store=stores.new(backend),
            workdir=workdir,
            plant=plant or (),
            env={sample.INVOICES_ENV: server.invoices_url},
            destination=lambda: [invoice["number"] for invoice in server.invoices],
            pg_restart=restart if backend == "postgresql" else None,
            warm_up="asiento.testing.sample:warm_up",
        )
        try:
            yield crash
        finally:
            crash.close()


def campaigns(
    stores: Stores,
    root: Path,
    *,
    backends: list[str],
    tier: Tier,
    seed: int,
    restart: Callable[[], object] | None,
) -> list[Report]:
    reports = []
    for backend in backends:
        with harness(stores, root, backend, restart) as h:
            reports.append(_done(h.matrix()))
        with harness(stores, root, backend, restart) as h:
            kills = tier.kills[backend]
            restarts = tier.restarts if backend == "postgresql" else 0
            storm = h.storm(kills, seed=seed, max_seconds=tier.max_seconds, restarts=restarts)
            reports.append(_done(storm))
        with harness(stores, root, backend, restart) as h:
            reports.append(_done(h.lease_race(tier.races, seed=seed)))
        with harness(stores, root, backend, restart) as h:
            reports.append(_done(h.decision_race(tier.decisions[backend], seed=seed)))
        with harness(stores, root, backend, restart) as h:
            reports.append(_done(h.abandon_race(tier.abandons, seed=seed)))
    with harness(stores, root, "sqlite", restart) as h:
        reports.append(_done(h.fsync_audit()))
    return reports


def controls(stores: Stores, root: Path, tier: Tier, seed: int) -> list[tuple[str, Report]]:
    """Each planted bug against the campaign that must catch it, on SQLite."""
    found = []
    with harness(stores, root, "sqlite", None, plant="no_write_ahead") as h:
        found.append(("no_write_ahead", _done(h.matrix())))
    if tier.control_kills:
        with harness(stores, root, "sqlite", None, plant="no_write_ahead") as h:
            found.append(("no_write_ahead", _done(h.storm(tier.control_kills, seed=seed))))
    with harness(stores, root, "sqlite", None, plant="no_fencing") as h:
        found.append(("no_fencing", _done(h.lease_race(max(1, tier.races // 2), seed=seed))))
    with harness(stores, root, "sqlite", None, plant="no_dir_fsync") as h:
        found.append(("no_dir_fsync", _done(h.fsync_audit())))
    with harness(stores, root, "sqlite", None, plant="stale_status") as h:
        # 10, not 5: with 5, one seed in a few (2685140843) never lands a decision in the
        # window the plant leaves open, and the control is missed though the bug is there.
        races = h.decision_race(
            10, seed=seed, kinds=("approve",), orders=("snapshot",), person_faults=False
        )
        found.append(("stale_status", _done(races)))
    with harness(stores, root, "sqlite", None, plant="unfenced_abandon") as h:
        abandons = h.abandon_race(5, seed=seed, person_faults=False)
        found.append(("unfenced_abandon", _done(abandons)))
    return found


def _done(report: Report) -> Report:
    print(f"  done: {report.campaign} on {report.backend} in {report.seconds:.1f} s", flush=True)
    return report


HEADER = ("campaign", "backend", "trials", "kills", "violations", "seconds")


def table(rows: list[tuple[object, ...]], header: tuple[str, ...]) -> str:
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for n, row in enumerate(cells):
        first = row[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join([first, *rest]))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def campaign_name(report: Report) -> str:
    return report.campaign.replace(" ", "_")


def report_tables(reports: list[Report], planted: list[tuple[str, Report]]) -> str:
    rows = [
        (campaign_name(r), r.backend, r.trials, r.kills, len(r.violations), f"{r.seconds:.1f}")
        for r in reports
    ]
    control_rows = [
        (plant, campaign_name(r), r.trials, r.kills, len(r.violations), _caught(r))
        for plant, r in planted
    ]
    control_header = ("plant", "campaign", "trials", "kills", "violations", "caught")
    return (
        table(rows, HEADER)
        + "\n\nnegative controls (each must be caught)\n"
        + table(control_rows, control_header)
    )


def _caught(report: Report) -> str:
    return "yes" if report.violations else "NO"


def details(reports: list[Report], planted: list[tuple[str, Report]]) -> str:
    out = []
    for r in reports:
        extra = [f"faults: {dict(sorted(r.faults.items()))}"] if r.faults else []
        if r.kills and r.seconds:
            extra.append(f"{r.seconds / r.kills * 1000:.0f} ms per kill, resumes included")
        out.append(f"{r.campaign} on {r.backend}: " + "; ".join(extra + r.notes))
        out += [f"  VIOLATION {v}\n    replay: {v.replay}" for v in r.violations[:20]]
    for plant, r in planted:
        first = r.violations[0] if r.violations else None
        out.append(f"control {plant} / {r.campaign}: first catch: {first}")
    return "\n".join(out)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", choices=sorted(TIERS), default="ci")
    parser.add_argument("--pg-dsn", help="an existing PostgreSQL (its role needs CREATE)")
    parser.add_argument("--no-pg", action="store_true", help="SQLite only")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dir", help="working directory (default: a temporary one)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    tier, seed = TIERS[args.tier], args.seed if args.seed is not None else time.time_ns() % 2**32
    print(f"reliability tier {args.tier}, seed {seed}", flush=True)
    started = time.monotonic()
    cluster = None
    if not args.no_pg and args.pg_dsn is None:
        cluster = start_local_postgres()
    try:
        with tempfile.TemporaryDirectory(prefix="asiento-reliability-", dir=args.dir) as tmp:
            root = Path(tmp)
            dsn = None if args.no_pg else (args.pg_dsn or (cluster.dsn if cluster else None))
            restart = None if cluster is None else functools.partial(cluster.restart, "immediate")
            backends = ["sqlite"] + ([] if dsn is None else ["postgresql"])
            stores = Stores(root, dsn)
            try:
                reports = campaigns(
                    stores, root, backends=backends, tier=tier, seed=seed, restart=restart
                )
                planted = controls(stores, root, tier, seed)
            finally:
                stores.drop()
            hostile_rows = []
            if tier.hypothesis is not None:
                hostile_rows = hostile.run(
                    root, hypothesis_profile=tier.hypothesis, timeout=tier.max_seconds
                )
    finally:
        if cluster is not None:
            cluster.stop()
    print()
    print(report_tables(reports, planted))
    if hostile_rows:
        print("\nhostile conditions and the state machine (tests/inputs, run by pytest)")
        print(hostile_table(hostile_rows))
    print()
    print(details(reports, planted))
    print(f"\ntotal {time.monotonic() - started:.0f} s, seed {seed}")
    clean = all(not r.violations and not r.missed for r in reports)
    clean = clean and all(not h.violations for h in hostile_rows)
    return 0 if clean and all(r.violations for _, r in planted) else 1


def hostile_table(rows: list[hostile.Outcome]) -> str:
    cells = [
        (h.campaign.replace(" ", "_"), h.trials, h.violations, f"{h.seconds:.1f}", h.note)
        for h in rows
    ]
    return table(cells, ("campaign", "trials", "violations", "seconds", "note"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
