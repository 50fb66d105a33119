"""A process that holds a lease and does nothing else, for the PID-namespace tests.

    python ns_holder.py lease DB RUN_ID TTL READY     hold run RUN_ID of the SQLite journal DB
    python ns_holder.py claim KEYS KEY LEASE READY    hold KEY in flight in the proxy's key store
    python ns_holder.py try DB RUN_ID READY           once READY exists: try to take RUN_ID

A holder writes READY (JSON: its pid, host and start time as recorded) once it
holds, then sleeps until it is killed (60 s at most). ``try`` prints ``locked``
or ``taken``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from asiento import Holder, RunLocked, SqliteCheckpointer
from asiento.proxy import KeyStore


def announce(ready: str, holder: Holder) -> None:
    facts = {"pid": holder.pid, "host": holder.host, "started": holder.started}
    Path(ready + ".tmp").write_text(json.dumps(facts))
    os.replace(ready + ".tmp", ready)  # whole, or not there
    time.sleep(60)


async def hold_lease(db: str, run_id: str, ttl: str, ready: str) -> None:
    holder = Holder.here()
    store = SqliteCheckpointer(db)
    await store.acquire(run_id, holder, ttl=float(ttl))
    await store.close()
    announce(ready, holder)


def hold_claim(keys: str, key: str, lease: str, ready: str) -> None:
    holder = Holder.here()
    store = KeyStore(keys, ttl=3600, lease=float(lease), holder=holder)
    assert store.claim("scope", key, "fingerprint").kind == "new"
    store.close()
    announce(ready, holder)


async def try_to_take(db: str, run_id: str, ready: str) -> None:
    deadline = time.monotonic() + 30
    while not Path(ready).exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    store = SqliteCheckpointer(db)
    try:
        await store.acquire(run_id, Holder.here(), ttl=30)
        print("taken")
    except RunLocked:
        print("locked")
    finally:
        await store.close()


if __name__ == "__main__":
    op, *args = sys.argv[1:]
    if op == "lease":
        asyncio.run(hold_lease(*args))
    elif op == "claim":
        hold_claim(*args)
    else:
        asyncio.run(try_to_take(*args))
