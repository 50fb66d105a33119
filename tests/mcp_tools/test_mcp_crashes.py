"""MCP tools keep asiento's guarantees: real servers, real clients, agents killed with SIGKILL.

Each test drives one run with ``child.py`` in fresh processes against a server
written with the mcp SDK (``server.py``: over stdio, started by the child, or over
Streamable HTTP on 127.0.0.1 in a process of its own). The server's ledger counts
what it really applied; a held call lets a test kill someone while it is in flight.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from asiento import ApprovalStep

from .rig import RUN, HttpServer, Rig

LIMA = {"city": "Lima"}
NOTE = {"text": "hola"}


def test_read_only_tool_of_a_trusted_server_runs_again_after_a_kill(rig: Rig) -> None:
    """SIGKILL inside a read-only tool of a trusted server: the resumed run calls it again,
    once, with the same key, and closes."""
    rig.hold, rig.flags = "lookup", ("--trusted",)
    rig.kill_inside(rig.start("lookup", LIMA))
    rig.release()
    assert rig.run("lookup", LIMA) == {"ended": "closed", "replayed": False}
    first, again = rig.ledger()
    assert first == again  # the same tool, key and arguments
    assert rig.run("lookup", LIMA)["ended"] == "closed"
    assert len(rig.ledger()) == 2


def test_unannotated_tool_is_uncertain_and_never_runs_again(rig: Rig) -> None:
    """SIGKILL inside a tool with no annotations (the spec's defaults: not idempotent):
    every resume stops with UncertainEffect and the server applied it once."""
    rig.hold, rig.flags = "send_note", ("--trusted",)
    rig.kill_inside(rig.start("send_note", NOTE))
    rig.release()
    for _ in range(2):
        ended = rig.run("send_note", NOTE)
        assert ended["ended"] == "uncertain", ended
        assert ended["step_id"] == "m1.t1"
        assert "not declared to deduplicate" in ended["why"], ended["why"]
    assert len(rig.ledger()) == 1


def test_read_only_tool_of_an_untrusted_server_is_not_run_again(rig: Rig) -> None:
    """An untrusted server's "read-only" tool is treated as non-idempotent: SIGKILL inside
    it is an UncertainEffect, not a second call."""
    rig.hold = "lookup"
    rig.kill_inside(rig.start("lookup", LIMA))
    rig.release()
    assert rig.run("lookup", LIMA)["ended"] == "uncertain"
    assert len(rig.ledger()) == 1


def test_key_honouring_tool_is_reconciled_by_its_key(rig: Rig, http_server: HttpServer) -> None:
    """SIGKILL inside a tool whose server deduplicates by the key in ``_meta``: the resumed
    run calls again with the same key, gets the first call's result, and the server
    applied it exactly once."""
    rig.hold, rig.flags = "transfer", ("--trusted", "--keys", "--ttl", "3600")
    http_server.start()
    rig.kill_inside(rig.start("transfer", {"amount": 5}))
    rig.release()  # the server's first call finishes after the agent died
    assert rig.run("transfer", {"amount": 5})["ended"] == "closed"
    assert len(rig.ledger()) == 1
    result = _result_of(rig, "m1.t1")
    assert result["value"] == "moved 5"
    assert result["via"] == "republish"


def test_key_honouring_tool_waits_while_its_first_call_still_runs(
    rig: Rig, http_server: HttpServer
) -> None:
    """Resumed while the server still runs the killed run's call: the server says
    in-progress, the run waits for it under the same key, and it happened once."""
    rig.hold, rig.flags = "transfer", ("--trusted", "--keys", "--ttl", "3600")
    http_server.start()
    rig.kill_inside(rig.start("transfer", {"amount": 7}))
    resumed = rig.start("transfer", {"amount": 7})
    rig.release()
    assert rig.ended(resumed)["ended"] == "closed"
    assert len(rig.ledger()) == 1
    assert _result_of(rig, "m1.t1")["value"] == "moved 7"


def test_key_outside_its_ttl_is_uncertain(rig: Rig, http_server: HttpServer) -> None:
    """A key-honouring tool whose key may have expired is not called again: UncertainEffect."""
    rig.hold, rig.flags = "transfer", ("--trusted", "--keys", "--ttl", "0")
    http_server.start()
    rig.kill_inside(rig.start("transfer", {"amount": 5}))
    rig.release()
    ended = rig.run("transfer", {"amount": 5})
    assert ended["ended"] == "uncertain"
    assert "idempotency key" in ended["why"]
    assert len(rig.ledger()) == 1


def test_destructive_tool_waits_for_approval_from_the_cli(rig: Rig) -> None:
    """With require_approval_for_destructive, a destructive tool waits for a person; approved
    with ``asiento approve`` it runs exactly once, and the closed run never again."""
    rig.flags = ("--trusted", "--destructive-policy")
    args = {"note_id": "n-1"}
    assert rig.run("delete_note", args) == {"ended": "suspended", "step_id": "m1.t1"}
    assert rig.ledger() == []
    cli = [sys.executable, "-m", "asiento", "approve", RUN, "m1.t1", "--by", "ana"]
    subprocess.run([*cli, "--store", str(rig.db)], check=True, capture_output=True, timeout=60)
    assert rig.run("delete_note", args)["ended"] == "closed"
    assert rig.run("delete_note", args) == {"ended": "closed", "replayed": True}
    assert len(rig.ledger()) == 1


def test_read_only_tool_is_not_destructive_so_no_approval(rig: Rig) -> None:
    """The same policy lets a trusted server's read-only tool run without a person."""
    rig.flags = ("--trusted", "--destructive-policy")
    assert rig.run("lookup", LIMA)["ended"] == "closed"
    assert ApprovalStep  # the policy asked nobody: the run closed in one pass


def test_drift_of_the_servers_tools_is_divergence(rig: Rig) -> None:
    """A run resumed while its server offers a changed tool stops with ReplayDivergence
    naming that tool, and nothing runs."""
    rig.flags = ("--trusted", "--destructive-policy")
    assert rig.run("delete_note", {"note_id": "n-1"})["ended"] == "suspended"
    rig.variant = "drift"
    ended = rig.run("delete_note", {"note_id": "n-1"})
    assert ended["ended"] == "diverged", ended
    assert "changed" in ended["why"], ended["why"]
    assert "'lookup'" in ended["why"], ended["why"]
    assert "'delete_note'" not in ended["why"]
    assert rig.ledger() == []


def test_untrusting_a_server_is_divergence_too(rig: Rig) -> None:
    """The treatment is part of the fingerprint: the same run resumed with the server no
    longer trusted diverges instead of replaying under other rules."""
    rig.flags = ("--trusted", "--destructive-policy")
    assert rig.run("delete_note", {"note_id": "n-1"})["ended"] == "suspended"
    rig.flags = ("--destructive-policy",)
    ended = rig.run("delete_note", {"note_id": "n-1"})
    assert ended["ended"] == "diverged"
    assert "treatment" in ended["why"]


def test_server_killed_mid_call(rig: Rig, http_server: HttpServer) -> None:
    """The server dies with an unannotated call in flight: the run stops (McpCallLost),
    the step stays submitted, and once the server is back the resume is an
    UncertainEffect, never a second call."""
    rig.hold, rig.flags = "send_note", ("--trusted",)
    http_server.start()
    child = rig.start("send_note", NOTE)
    rig.wait_for_ledger(1)
    http_server.kill()
    ended = rig.ended(child)
    assert ended["ended"] == "lost", ended
    rig.release()
    http_server.start()
    assert rig.run("send_note", NOTE)["ended"] == "uncertain"
    assert len(rig.ledger()) == 1


def test_server_down_when_the_run_resumes(rig: Rig, http_server: HttpServer) -> None:
    """A server that is down when a run resumes: a clear error and nothing recorded; with
    the server back the read-only call is made again and the run closes."""
    rig.hold, rig.flags = "lookup", ("--trusted",)
    http_server.start()
    rig.kill_inside(rig.start("lookup", LIMA))
    http_server.kill()
    before = _records(rig)
    ended = rig.run("lookup", LIMA)
    assert ended["ended"] == "unavailable"
    assert "cannot be reached" in ended["why"]
    assert "Nothing was sent" in ended["why"]
    assert _records(rig) == before
    rig.release()
    http_server.start()
    assert rig.run("lookup", LIMA)["ended"] == "closed"
    assert len(rig.ledger()) == 2


def test_sigterm_lets_the_call_in_flight_finish(rig: Rig) -> None:
    """SIGTERM while an MCP call is in flight: the call finishes and is recorded, the run
    stops between steps, and the resumed run does not call it again."""
    rig.hold, rig.flags = "send_note", ("--trusted",)
    child = rig.start("send_note", NOTE)
    rig.wait_for_ledger(1)
    os.kill(child.pid, signal.SIGTERM)
    rig.release()
    assert rig.ended(child) == {"ended": "shutdown"}
    assert _result_of(rig, "m1.t1")["value"] == {"result": "sent: hola"}
    assert rig.run("send_note", NOTE)["ended"] == "closed"
    assert len(rig.ledger()) == 1


def _records(rig: Rig) -> list[tuple[str, str]]:
    import asyncio

    from asiento import SqliteCheckpointer

    async def load() -> list[tuple[str, str]]:
        store = SqliteCheckpointer(rig.db)
        try:
            return [(e.step_id, e.phase.value) for e in await store.load(RUN)]
        finally:
            await store.close()

    return asyncio.run(load())


def _result_of(rig: Rig, step: str) -> dict[str, object]:
    import asyncio

    from asiento import Phase, SqliteCheckpointer

    async def load() -> dict[str, object]:
        store = SqliteCheckpointer(rig.db)
        try:
            events = await store.load(RUN)
        finally:
            await store.close()
        found = [
            e.payload for e in events if e.step_id.split("/")[0] == step and e.phase is Phase.RESULT
        ]
        assert found, events
        return dict(found[-1])

    return asyncio.run(load())
