"""Leases: who holds a run, fencing tokens, takeover of the dead and the expired."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from asiento import (
    Checkpointer,
    Decision,
    DuplicateRecord,
    Holder,
    Lease,
    LeaseLost,
    Phase,
    RunLocked,
    RunStatus,
    Savings,
    UsageError,
)
from asiento.lease import hostname

from ._build import dead_pid, ev, holder, info_of


class LeaseTests:
    """acquire, renew, release and the lease an append is made under."""

    async def test_acquire_creates_the_run_with_token_one(self, store: Checkpointer) -> None:
        """The first acquire of an unknown run creates its row and returns fencing token 1."""
        lease = await store.acquire("run-1", holder("a"), ttl=30)
        assert (lease.run_id, lease.token, lease.owner) == ("run-1", 1, "a")
        info = await info_of(store)
        assert (info.status, info.events, info.fence, info.lease_owner) == (
            RunStatus.RUNNING,
            0,
            1,
            "a",
        )
        assert info.lease_expires is not None
        assert info.lease_expires > time.time() + 20

    async def test_the_index_names_where_the_holder_runs(self, store: Checkpointer) -> None:
        """The run index says which process holds the lease (host and pid), taken by
        acquire and by a worker's claim, and forgets it once the lease is given back."""
        lease = await store.acquire("run-1", holder("far", host="worker-3/b00t", pid=4242), ttl=30)
        info = await info_of(store)
        assert (info.lease_host, info.lease_pid) == ("worker-3/b00t", 4242)
        await store.release(lease)
        info = await info_of(store)
        assert (info.lease_owner, info.lease_host, info.lease_pid) == (None, None, None)
        await store.submit("job-1", "t", agent="a")
        claim = await store.claim(holder("w", host="worker-4/b00t", pid=77), ttl=30)
        assert claim is not None
        claimed = await info_of(store, "job-1")
        assert (claimed.lease_host, claimed.lease_pid) == ("worker-4/b00t", 77)

    async def test_live_holder_on_this_host_locks_the_run(self, store: Checkpointer) -> None:
        """Another owner of a live process on this host gets RunLocked naming the holder."""
        await store.acquire("run-1", holder("a"), ttl=30)
        with pytest.raises(RunLocked, match=rf"run-1.*pid {os.getpid()}"):
            await store.acquire("run-1", holder("other"), ttl=30)
        assert (await info_of(store)).lease_owner == "a"

    async def test_same_owner_acquires_again_with_a_new_token(self, store: Checkpointer) -> None:
        """The same owner may take its own lease again; the token still grows."""
        first = await store.acquire("run-1", holder("a"), ttl=30)
        again = await store.acquire("run-1", holder("a"), ttl=30)
        assert again.token == first.token + 1

    async def test_other_host_is_taken_over_only_after_expiry(self, store: Checkpointer) -> None:
        """A holder on another host locks the run until its lease expires, then token+1."""
        first = await store.acquire("run-1", holder("far", host="elsewhere", pid=1), ttl=0.5)
        with pytest.raises(RunLocked, match="elsewhere"):
            await store.acquire("run-1", holder("b"), ttl=30)
        deadline = time.monotonic() + 5
        while True:
            try:
                taken = await store.acquire("run-1", holder("b"), ttl=30)
                break
            except RunLocked:
                assert time.monotonic() < deadline, "the expired lease was never taken over"
                await asyncio.sleep(0.05)
        assert taken.token == first.token + 1
        assert (await info_of(store)).lease_owner == "b"

    async def test_dead_holder_on_this_host_is_taken_over_at_once(
        self, store: Checkpointer
    ) -> None:
        """A holder whose process is gone from this host is taken over before its expiry."""
        pid, started = dead_pid()
        gone = Holder(owner="gone", host=hostname(), pid=pid, started=started)
        first = await store.acquire("run-1", gone, ttl=300)
        taken = await store.acquire("run-1", holder("b"), ttl=30)
        assert taken.token == first.token + 1

    async def test_dead_holder_recorded_without_its_pid_namespace_waits_for_expiry(
        self,
        store: Checkpointer,
    ) -> None:
        """A row from before namespaces were recorded ("host/boot") proves no death: RunLocked."""
        pid, started = dead_pid()
        old_host = hostname().rsplit("/pidns:", 1)[0]
        old = Holder(owner="old", host=old_host, pid=pid, started=started)
        await store.acquire("run-1", old, ttl=300)
        with pytest.raises(RunLocked, match=rf"pid {pid} on {old_host}"):
            await store.acquire("run-1", holder("b"), ttl=30)
        assert (await info_of(store)).lease_owner == "old"

    async def test_stale_lease_appends_nothing(self, store: Checkpointer) -> None:
        """After a takeover, the old lease's append raises LeaseLost and writes nothing."""
        pid, started = dead_pid()
        gone = Holder(owner="old", host=hostname(), pid=pid, started=started)
        old = await store.acquire("run-1", gone, ttl=300)
        await store.append(ev("m1", n=1), lease=old)
        new = await store.acquire("run-1", holder("new"), ttl=30)
        before = await info_of(store)
        with pytest.raises(LeaseLost, match=rf"run-1.*token {old.token}"):
            await store.append(ev("m2", n=2), ev("m2.t1", Phase.INTENT), lease=old)
        assert [e.step_id for e in await store.load("run-1")] == ["m1"]
        after = await info_of(store)
        assert (after.events, after.fence, after.lease_owner) == (1, new.token, "new")
        assert after.lease_expires == before.lease_expires
        await store.append(ev("m2", n=3), lease=new)
        assert [e.payload for e in await store.load("run-1")] == [{"n": 1}, {"n": 3}]

    async def test_expired_lease_appends_nothing(self, store: Checkpointer) -> None:
        """A lease past its expiry, even not taken over, cannot write."""
        lease = await store.acquire("run-1", holder("a"), ttl=0.05)
        await asyncio.sleep(0.2)
        with pytest.raises(LeaseLost):
            await store.append(ev("m1"), lease=lease)
        assert await store.load("run-1") == []
        assert (await info_of(store)).events == 0

    async def test_renew_extends_a_current_lease(self, store: Checkpointer) -> None:
        """renew() moves the expiry forward; a stale lease cannot be renewed."""
        lease = await store.acquire("run-1", holder("a"), ttl=5)
        before = (await info_of(store)).lease_expires
        renewed = await store.renew(lease, ttl=60)
        after = (await info_of(store)).lease_expires
        assert before is not None
        assert after is not None
        assert after > before + 30
        assert renewed.token == lease.token
        stale = Lease(run_id="run-1", token=lease.token - 1, owner="a", expires=0)
        with pytest.raises(LeaseLost):
            await store.renew(stale, ttl=60)

    async def test_release_frees_the_run_and_adds_savings(self, store: Checkpointer) -> None:
        """release() lets another holder in at once and adds what the pass saved."""
        lease = await store.acquire("run-1", holder("a"), ttl=300)
        await store.release(lease, savings=Savings(calls=2, input_tokens=30, output_tokens=4))
        info = await info_of(store)
        assert (info.lease_owner, info.lease_expires) == (None, None)
        second = await store.acquire("run-1", holder("b"), ttl=300)
        await store.release(second, savings=Savings(calls=1, input_tokens=5, output_tokens=1))
        await store.release(second, savings=Savings(calls=9, input_tokens=9, output_tokens=9))
        info = await info_of(store)
        saved = (info.replayed_calls, info.saved_input_tokens, info.saved_output_tokens)
        assert saved == (3, 35, 5)

    async def test_the_closing_append_gives_the_lease_up(self, store: Checkpointer) -> None:
        """append(status=CLOSED, release=...) records, closes and releases in one commit:
        the lease is free and the pass's savings added, as a release right after would."""
        lease = await store.acquire("run-1", holder("a"), ttl=300)
        await store.append(ev("m1"), lease=lease)
        saved = Savings(calls=2, input_tokens=30, output_tokens=4, cost=0.5)
        await store.append(ev("final"), status=RunStatus.CLOSED, lease=lease, release=saved)
        info = await info_of(store)
        assert (info.status, info.events, info.lease_owner, info.lease_expires) == (
            RunStatus.CLOSED,
            2,
            None,
            None,
        )
        assert (info.replayed_calls, info.saved_input_tokens, info.saved_output_tokens) == (
            2,
            30,
            4,
        )
        assert info.saved_cost == pytest.approx(0.5)
        await store.release(lease)  # a release after it finds nothing left to give up
        assert (await info_of(store)).replayed_calls == 2

    async def test_closing_appends_of_many_runs_at_once(self, store: Checkpointer) -> None:
        """Closing appends of several runs committed together (group commit) each give
        their own lease up, beside a plain append that keeps its lease."""
        leases = [await store.acquire(f"run-{n}", holder(f"h{n}"), ttl=300) for n in range(4)]
        closing = [
            store.append(
                ev("final", run_id=lease.run_id),
                status=RunStatus.CLOSED,
                lease=lease,
                release=Savings(calls=n),
            )
            for n, lease in enumerate(leases[:3])
        ]
        await asyncio.gather(*closing, store.append(ev("m1", run_id="run-3"), lease=leases[3]))
        for n in range(3):
            info = await info_of(store, f"run-{n}")
            assert (info.status, info.lease_owner, info.replayed_calls) == (
                RunStatus.CLOSED,
                None,
                n,
            )
        kept = await info_of(store, "run-3")
        assert (kept.status, kept.lease_owner, kept.events) == (RunStatus.RUNNING, "h3", 1)

    async def test_a_refused_closing_append_gives_nothing_up(self, store: Checkpointer) -> None:
        """A closing append under a lease no longer current, or with a record already
        there, writes nothing: no record, no status, no release, no savings."""
        old = await store.acquire("run-1", holder("a"), ttl=300)
        lease = await store.acquire("run-1", holder("b"), ttl=300, force=True)
        await store.append(ev("m1"), lease=lease)
        with pytest.raises(LeaseLost):
            await store.append(
                ev("final"), status=RunStatus.CLOSED, lease=old, release=Savings(calls=1)
            )
        with pytest.raises(DuplicateRecord):
            await store.append(
                ev("m1"),
                ev("final"),
                status=RunStatus.CLOSED,
                lease=lease,
                release=Savings(calls=1),
            )
        info = await info_of(store)
        assert (info.status, info.events, info.lease_owner, info.replayed_calls) == (
            RunStatus.RUNNING,
            1,
            "b",
            0,
        )
        assert [e.step_id for e in await store.load("run-1")] == ["m1"]

    async def test_only_the_closing_append_releases(self, store: Checkpointer) -> None:
        """release= with no lease, or without status=CLOSED, is a UsageError: a run left
        open goes back to the queue by release(). Nothing is written."""
        lease = await store.acquire("run-1", holder("a"), ttl=300)
        for kwargs in (
            {"status": RunStatus.CLOSED},
            {"lease": lease},
            {"lease": lease, "status": RunStatus.SUSPENDED},
            {"lease": lease, "status": RunStatus.CLOSED, "release": 3},
        ):
            with pytest.raises(UsageError, match="release"):
                await store.append(ev("final"), **{"release": Savings(calls=1)} | kwargs)
        info = await info_of(store)
        assert (info.status, info.events, info.lease_owner) == (RunStatus.RUNNING, 0, "a")

    async def test_append_with_the_lease_extends_it(self, store: Checkpointer) -> None:
        """An append under a valid lease pushes lease_expires forward by the lease's ttl."""
        lease = await store.acquire("run-1", holder("a"), ttl=2)
        before = (await info_of(store)).lease_expires
        await asyncio.sleep(0.1)
        await store.append(ev("m1"), lease=lease)
        after = (await info_of(store)).lease_expires
        assert before is not None
        assert after is not None
        assert before + 0.05 < after < time.time() + 2.5

    async def test_append_without_a_lease_ignores_the_lease(self, store: Checkpointer) -> None:
        """The harness appends without a lease whoever holds the run, and changes no lease."""
        await store.acquire("run-1", holder("a"), ttl=300)
        held = await info_of(store)
        await store.append(ev("m1.t1", Phase.APPROVAL, decision=Decision.APPROVED))
        after = await info_of(store)
        assert (after.events, after.lease_owner, after.fence) == (1, "a", held.fence)
        assert after.lease_expires == held.lease_expires

    async def test_force_takes_a_live_lease(self, store: Checkpointer) -> None:
        """acquire(force=True) takes the lease from a live holder, whose appends are refused."""
        live = await store.acquire("run-1", holder("a"), ttl=30)
        taken = await store.acquire("run-1", holder("b"), ttl=30, force=True)
        assert taken.token == live.token + 1
        with pytest.raises(LeaseLost):
            await store.append(ev("m1"), lease=live)
        assert await store.load("run-1") == []
