"""The gateway proxy's in-flight claims across PID namespaces (two containers, one key store).

A proxy in another PID namespace of this host is not provably dead however its
pid looks from here: its claim is waited for while it lives, and taken over
only once its lease runs out when it dies.
"""

from __future__ import annotations

import contextlib
import select
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from asiento.lease import Holder
from asiento.proxy import KeyStore, create_app
from lease.namespaces import holder_argv, kill, ready, start, unshare

from .fake_servers import AsgiServer, FakeProvider, wait_until
from .test_openai import SCRIPT

HELLO = [{"role": "user", "content": "hello"}]
BODY = {"model": "gpt-test", "messages": HELLO}
HEADERS = {"Idempotency-Key": "k-shared", "Authorization": "Bearer sk-test"}


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    """A scripted provider on 127.0.0.1 (the namespaces below share the network)."""
    with FakeProvider(SCRIPT) as p:
        yield p


def proxy_in_a_namespace(upstream: str, db: Path) -> tuple[subprocess.Popen[str], str]:
    """``serve()`` as pid 1 of a new PID namespace, on a free port; the URL it printed."""
    code = "import sys; from asiento.proxy import serve; serve(sys.argv[1], db=sys.argv[2], port=0)"
    argv = [*unshare(), sys.executable, "-c", code, upstream, str(db)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    readable, _, _ = select.select([proc.stderr], [], [], 30)
    line = proc.stderr.readline() if readable else ""
    if "asiento gateway: http://" not in line:
        kill(proc)
    assert "asiento gateway: http://" in line, line
    return proc, line.split()[2]


def test_a_request_in_flight_in_another_namespace_is_waited_for_not_billed_again(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """A proxy here meets the key in flight at a proxy in a container: it waits, then replays."""
    db = tmp_path / "keys.db"
    provider.delay_turn(0, 4.0)
    far, far_url = proxy_in_a_namespace(provider.openai_url, db)
    answers: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: answers.append(
            httpx.post(far_url + "/chat/completions", json=BODY, headers=HEADERS, timeout=60)
        )
    )
    try:
        sender.start()
        wait_until(lambda: provider.billed() == 1)
        with AsgiServer(create_app(provider.openai_url, db=db, wait=60)) as near:
            url = near.url + "/v1/chat/completions"
            here = httpx.post(url, json=BODY, headers=HEADERS, timeout=90)
        sender.join(timeout=60)
    finally:
        kill(far)
    assert provider.billed("k-shared") == 1, "the claim of a live proxy was taken over"
    assert [a.status_code for a in answers] == [200]
    assert here.status_code == 200
    assert here.headers["idempotent-replayed"] == "true"
    assert here.json() == answers[0].json()


def test_a_claim_of_a_killed_proxy_in_another_namespace_waits_for_its_lease(
    tmp_path: Path,
) -> None:
    """Its process gone, but not where this one can see: the key is in flight until the lease."""
    keys = tmp_path / "keys.db"
    argv = holder_argv("claim", keys, "k-shared", 3, tmp_path / "ready")
    holder_proc = start([*unshare(), *argv], tmp_path)
    ready(tmp_path / "ready", holder_proc)
    kill(holder_proc)
    store = KeyStore(keys, ttl=3600, lease=60, holder=Holder.here())
    try:
        with contextlib.closing(sqlite3.connect(keys)) as db:
            [lease_until] = db.execute("SELECT lease_until FROM idempotency_keys").fetchone()
        deadline = time.monotonic() + 30
        while store.claim("scope", "k-shared", "fingerprint").kind == "in_flight":
            assert time.monotonic() < deadline, "the expired claim was never taken over"
            time.sleep(0.05)
        assert time.time() > lease_until, "the claim was taken over before its lease ran out"
    finally:
        store.close()
