"""``python -m asiento.testing``: run a crash campaign against an app, or replay a failure.

    python -m asiento.testing matrix --app myapp:make --task "..." --store runs.db
    python -m asiento.testing storm  --app myapp:make --task "..." --store runs.db --kills 500
    python -m asiento.testing race   --app myapp:make --task "..." --store runs.db --trials 5
    python -m asiento.testing audit  --app myapp:make --task "..." --store runs.db
    python -m asiento.testing replay --app myapp:make --task "..." --store runs.db --seed N
    python -m asiento.testing replay ... --case op2:inside_tool@1

The exit code is 1 when an invariant was violated. Run it with the environment
the campaign had (the app reads its configuration from there).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from .harness import CrashHarness
from .report import Report


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m asiento.testing", description=__doc__)
    parser.add_argument("campaign", choices=("matrix", "storm", "race", "audit", "replay"))
    parser.add_argument("--app", required=True, help="module:factory returning (Agent, gateway)")
    parser.add_argument("--task", required=True, help="the task; {run_id} is replaced")
    parser.add_argument("--store", required=True, help="SQLite path or PostgreSQL URL/DSN")
    parser.add_argument("--workdir", help="where ledgers and files go (default: a new temp dir)")
    parser.add_argument("--plant", action="append", default=[], help="a deliberate bug")
    parser.add_argument("--pythonpath", action="append", default=[], help="for the children")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the children")
    parser.add_argument("--warm-up", help="module:function the fork-servers call once")
    parser.add_argument("--op-seconds", help="run=0.03,approve=0.01: random SIGKILLs' scale")
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--case")
    parser.add_argument("--max-seconds", type=float, default=600.0)
    return parser.parse_args(argv)


def run(args: argparse.Namespace, workdir: str) -> Report:
    env = dict(item.split("=", 1) for item in args.env)
    scale = args.op_seconds.split(",") if args.op_seconds else []
    op_seconds = {op: float(t) for op, t in (item.split("=", 1) for item in scale)}
    harness = CrashHarness(
        args.app,
        task=args.task,
        store=args.store,
        workdir=workdir,
        plant=args.plant,
        pythonpath=args.pythonpath,
        env=env,
        warm_up=args.warm_up,
        op_seconds=op_seconds or None,
    )
    try:
        if args.campaign == "matrix":
            return harness.matrix()
        if args.campaign == "storm":
            return harness.storm(args.kills, seed=args.seed, max_seconds=args.max_seconds)
        if args.campaign == "race":
            return harness.lease_race(args.trials, seed=args.seed)
        if args.campaign == "audit":
            return harness.fsync_audit()
        return harness.replay(args.seed, case=args.case)
    finally:
        harness.close()


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.workdir:
        report = run(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="asiento-crash-") as workdir:
            report = run(args, workdir)
    print(report.summary(limit=50))
    return 1 if report.violations or report.missed else 0


if __name__ == "__main__":
    sys.exit(main())
