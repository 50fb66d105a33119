"""A child process for the PostgreSQL tests: one store, one job, results on stdout.

    python pg_child.py DSN open                open the store
    python pg_child.py DSN race TAG            append run "race" step m1, payload by=TAG
    python pg_child.py DSN claim N             claim N runs (ttl 60 s), print their ids
    python pg_child.py DSN hold TTL            take run-1's lease, append m1, then wait
                                               for "append" on stdin and try m2 with it
    python pg_child.py DSN append              append run-1 m1 and m1.t1 (crash tests)

open, race and claim print "ready", then wait for a line on stdin before they
act, so that the parent can start them all at the same instant. Each line
printed is then one result (ok, duplicate, held N, lease-lost, a run id).
"""

from __future__ import annotations

import asyncio
import sys

from asiento import DuplicateRecord, Holder, LeaseLost, Phase, StepEvent
from asiento.journal.postgres import PostgresCheckpointer


def say(*words: object) -> None:
    print(*words, flush=True)


def ready() -> None:
    """Say so, and block until the parent says go: the children then race."""
    say("ready")
    sys.stdin.readline()


def event(run_id: str, step_id: str, phase: Phase = Phase.RESULT, **payload: object) -> StepEvent:
    return StepEvent(run_id=run_id, step_id=step_id, phase=phase, payload=payload)


async def main(dsn: str, job: str, *args: str) -> None:
    if job == "open":
        ready()
        store = await PostgresCheckpointer.connect(dsn)
        await store.close()
        say("ok")
        return
    async with PostgresCheckpointer(dsn) as store:
        if job == "race":
            ready()
            try:
                await store.append(event("race", "m1", by=args[0]))
                say("ok")
            except DuplicateRecord:
                say("duplicate")
        elif job == "claim":
            ready()
            for _ in range(int(args[0])):
                claim = await store.claim(Holder.here(), ttl=60)
                say(claim.lease.run_id if claim else "none")
        elif job == "hold":
            lease = await store.acquire("run-1", Holder.here(), ttl=float(args[0]))
            await store.append(event("run-1", "m1", by="child"), lease=lease)
            say("held", lease.token)
            if sys.stdin.readline().strip() == "append":
                try:
                    await store.append(event("run-1", "m2", by="child"), lease=lease)
                    say("written")
                except LeaseLost:
                    say("lease-lost")
        elif job == "append":
            await store.append(event("run-1", "m1"), event("run-1", "m1.t1", Phase.INTENT))
            say("ok")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
