"""Tenants in the tiering library (docs/tenants.md): isolation, shares no other tenant's traffic
takes away, caps that refuse and count, and a tenant drop across every tier."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvoffload.tiering import (
    JobKind,
    Locality,
    Medium,
    ReqContext,
    TieringLedger,
    TierSpec,
    TransferResult,
    WriteBack,
)
from kvoffload.tiering.tenants import PRIMARY, TenantCapReached, TenantLimits, TenantPolicy
from kvoffload.wire.status import TenantStatus
from tests.tiering.conftest import FakeClock, k

A, B, C = "a" * 16, "b" * 16, "c" * 16


def disk_spec(capacity: int = 0) -> TierSpec:
    return TierSpec(
        "disk", Medium.STORAGE, Locality.LOCAL, writeback=WriteBack.HOLD, capacity_keys=capacity
    )


OBJECT = TierSpec("object", Medium.STORAGE, Locality.REMOTE, indexed=False)


def policy(**named: dict[str, TenantLimits]) -> TenantPolicy:
    return TenantPolicy(named={({"A": A, "B": B, "C": C}[n]): v for n, v in named.items()})


class TenantHarness:
    """A ledger whose tier jobs are answered like workers would: cascades land, removals
    remove, probes find what the object tier holds (per tenant, as object names are)."""

    def __init__(self, num_slots=8, specs=(), tenant_policy=None):
        self.clock = FakeClock()
        self.m = TieringLedger(
            num_slots, list(specs), clock=self.clock, tenant_policy=tenant_policy
        )
        self.held: dict[str, set[bytes]] = {spec.name: set() for spec in specs}
        self.objects: set[tuple[str, bytes]] = set()
        self.deletes: list = []
        self._reqs = 0

    def request(self, tenant: str) -> str:
        self._reqs += 1
        req = f"r{self._reqs}"
        self.m.on_new_request(ReqContext(req, tenant=tenant))
        return req

    def store(self, tenant: str, keys: list[bytes]) -> list[bytes]:
        """One request of ``tenant`` stores ``keys`` and finishes; returns what it evicted."""
        req = self.request(tenant)
        out = self.m.prepare_store(req, keys)
        assert out is not None
        self.m.complete_store(req, out.keys_to_store)
        self.m.on_request_finished(req)
        return out.evicted

    def drain(self, max_rounds: int = 100) -> None:
        for _ in range(max_rounds):
            self.m.end_step()
            jobs = self.m.take_submissions()
            if not jobs:
                return
            for job in jobs:
                self.answer(job)
        raise AssertionError("jobs kept coming")

    def answer(self, job) -> None:
        tier = self.m.tiers[job.tier].name
        tenants = job.tenants or [""] * len(job.keys)
        if job.kind is JobKind.CASCADE:
            self.held[tier].update(job.keys)
            self.objects.update(zip(tenants, job.keys, strict=True))
            result = TransferResult(job.job_id, True)
        elif job.kind is JobKind.DELETE:
            self.deletes.append(job)
            self.held[tier].difference_update(job.keys)
            removed = len(job.keys)
            if job.purge_tenant:
                mine = {o for o in self.objects if o[0] == job.purge_tenant}
                removed = len(mine)
                self.objects -= mine
            result = TransferResult(job.job_id, True, removed=removed)
        elif job.kind is JobKind.PROBE:
            found = [
                key for t, key in zip(tenants, job.keys, strict=True) if (t, key) in self.objects
            ]
            absent = [key for key in job.keys if key not in found]
            result = TransferResult(job.job_id, not absent, found or None, absent_keys=absent)
        else:
            result = TransferResult(job.job_id, True)
        self.m.apply_result(tier, result)

    def hits(self, tenant: str, keys: list[bytes], wait_rounds: int = 5) -> int:
        """How many leading keys a fresh request of ``tenant`` finds (waiting for probes and
        promotions like an engine would)."""
        req = self.request(tenant)
        try:
            for _ in range(wait_rounds):
                result = self.m.lookup(req, keys)
                if not result.must_wait:
                    return result.ready_prefix
                self.drain()
            return self.m.lookup(req, keys).ready_prefix
        finally:
            self.m.on_request_finished(req)
            self.drain()

    def tenant(self, tid: str) -> TenantStatus:
        return self.m.snapshot().tenants[tid]


def keys(prefix: int, n: int) -> list[bytes]:
    return [k(prefix * 1000 + i) for i in range(n)]


def test_a_tenant_never_sees_another_tenants_blocks():
    h = TenantHarness(specs=[disk_spec()])
    a_keys = keys(1, 3)
    h.store(A, a_keys)
    h.drain()
    assert h.hits(A, a_keys) == 3
    assert h.hits(B, a_keys) == 0, "B finds none of A's blocks in the pool"
    assert h.hits("", a_keys) == 0, "nor does a request without a tenant"
    h.m.reset_cache()
    assert h.hits(B, a_keys) == 0, "nor on disk"
    assert h.hits(A, a_keys) == 3, "A's come back from disk"


def test_blocks_without_a_tenant_go_to_the_first_tenant_that_finds_them():
    h = TenantHarness(tenant_policy=policy(A={PRIMARY: TenantLimits(share=1)}))
    loose = keys(9, 2)
    h.store("", loose)
    assert h.hits(A, loose) == 2
    assert h.hits(B, loose) == 0, "now A's"
    assert h.tenant(A).tiers[PRIMARY].blocks == 2


def test_a_tenant_inside_its_share_loses_nothing_to_a_flood():
    h = TenantHarness(num_slots=8, tenant_policy=policy(A={PRIMARY: TenantLimits(share=4)}))
    a_keys = keys(1, 4)
    h.store(A, a_keys)
    for i in range(10):
        evicted = h.store(B, keys(2 + i, 3))
        assert not set(evicted) & set(a_keys)
    assert h.hits(A, a_keys) == 4
    a, b = h.tenant(A).tiers[PRIMARY], h.tenant(B).tiers[PRIMARY]
    assert a.blocks == 4 and a.evicted_by_others == 0 and a.evictions == 0
    assert b.blocks == 4 and b.evictions == 26


def test_eviction_takes_from_tenants_over_their_share_first_and_never_below_it():
    h = TenantHarness(
        num_slots=8,
        tenant_policy=policy(
            A={PRIMARY: TenantLimits(share=2)}, B={PRIMARY: TenantLimits(share=2)}
        ),
    )
    h.store(A, keys(1, 5))  # A holds 3 beyond its share
    h.store(B, keys(2, 3))  # the pool is full
    evicted = h.store(C, keys(3, 4))
    assert set(evicted) == set(keys(1, 3)) | {keys(2, 1)[0]}, "A's excess, then B's, oldest first"
    assert h.tenant(A).tiers[PRIMARY].blocks == 2
    assert h.tenant(B).tiers[PRIMARY].blocks == 2
    assert h.store(C, keys(4, 1)) == [keys(3, 1)[0]], "then C's own blocks"


def test_a_tenant_at_its_pool_cap_makes_room_from_its_own_blocks_or_is_refused():
    h = TenantHarness(num_slots=8, tenant_policy=policy(A={PRIMARY: TenantLimits(cap=3)}))
    h.store(B, keys(2, 2))
    assert h.store(A, keys(1, 3)) == []
    assert h.store(A, keys(3, 2)) == keys(1, 2), "A's own oldest, though the pool has room"
    assert h.tenant(A).tiers[PRIMARY].blocks == 3
    req = h.request(A)
    h.m.prepare_load(req, keys(3, 2) + [keys(1, 3)[2]])  # pinned: none can go
    with pytest.raises(TenantCapReached) as refused:
        h.m.prepare_store(req, keys(4, 1))
    assert refused.value.code == "tenant_cap"
    assert h.tenant(A).tiers[PRIMARY].refused == 1
    assert h.tenant(B).tiers[PRIMARY].blocks == 2, "B untouched"


def test_on_disk_the_manager_makes_room_by_share_and_the_worker_never_evicts():
    h = TenantHarness(
        num_slots=4,
        specs=[disk_spec(capacity=6)],
        tenant_policy=policy(A={"disk": TenantLimits(share=3)}),
    )
    a_keys = keys(1, 3)
    h.store(A, a_keys)
    h.drain()
    for i in range(8):
        h.store(B, keys(2 + i, 2))
        h.drain()
        assert len(h.held["disk"]) <= 6, "the tier never holds more than its capacity"
        assert set(a_keys) <= h.held["disk"], "A's blocks stay on disk"
    disk = h.tenant(A).tiers["disk"]
    assert disk.blocks == 3 and disk.evicted_by_others == 0
    assert h.tenant(B).tiers["disk"].blocks == 3
    assert h.m.stats.tier(1).cascade_dropped_tier_full == 0
    assert all(d.kind is JobKind.DELETE and not set(d.keys) & set(a_keys) for d in h.deletes)
    h.m.reset_cache()
    assert h.hits(A, a_keys) == 3


def test_a_tenant_at_its_disk_cap_replaces_its_own_oldest_block():
    h = TenantHarness(
        num_slots=8,
        specs=[disk_spec(capacity=16)],
        tenant_policy=policy(A={"disk": TenantLimits(cap=2)}),
    )
    h.store(A, keys(1, 2))
    h.drain()
    h.store(A, keys(2, 1))
    h.drain()
    assert h.held["disk"] == set(keys(1, 2)[1:] + keys(2, 1))
    assert h.tenant(A).tiers["disk"].blocks == 2


def test_a_tenant_at_its_object_cap_has_its_cascades_refused_and_counted(captured_logs):
    h = TenantHarness(specs=[OBJECT], tenant_policy=policy(A={"object": TenantLimits(cap=2)}))
    h.store(A, keys(1, 3))
    h.drain()
    assert len(h.objects) == 2
    assert h.tenant(A).tiers["object"].refused == 1
    assert h.m.stats.tier(1).cascade_dropped_tenant_cap == 1
    assert any(e["event"] == "tenant_cap_refused" for e in captured_logs)
    assert all(t == A for t, _ in h.objects), "object names carry the tenant"


def test_a_drop_removes_every_block_of_the_tenant_from_every_tier_and_nothing_else():
    h = TenantHarness(num_slots=8, specs=[disk_spec(), OBJECT])
    a_keys, b_keys = keys(1, 3), keys(2, 3)
    h.store(A, a_keys)
    h.store(B, b_keys)
    h.drain()
    h.objects.add((A, k(777)))  # another node's block of A's in the bucket
    drop = h.m.drop_tenant(A)
    assert not drop.finished, "the tiers remove the bytes"
    assert h.hits(A, a_keys) == 0, "a miss everywhere from the call on"
    h.drain()
    (done,) = h.m.take_finished_drops()
    assert done.removed == {"primary": 3, "disk": 3, "object": 4} and done.failed == {}
    assert not h.held["disk"] & set(a_keys) and not [o for o in h.objects if o[0] == A]
    assert h.hits(A, a_keys) == 0
    assert h.hits(B, b_keys) == 3
    h.m.reset_cache()
    assert h.hits(B, b_keys) == 3, "B's disk blocks untouched"


def test_a_drop_waits_for_cascades_in_flight_and_dooms_busy_blocks():
    h = TenantHarness(num_slots=8, specs=[disk_spec()])
    req = h.request(A)
    out = h.m.prepare_store(req, keys(1, 2))
    h.m.complete_store(req, out.keys_to_store)
    (cascade,) = h.m.take_submissions()
    pinned = h.request(A)
    h.m.prepare_load(pinned, keys(1, 1))
    drop = h.m.drop_tenant(A)
    assert drop.waiting_jobs == {cascade.job_id}
    assert h.hits(A, keys(1, 2)) == 0
    h.answer(cascade)  # lands on disk after the drop: removed with the rest
    h.drain()
    (done,) = h.m.take_finished_drops()
    assert done.removed["disk"] == 2 and not h.held["disk"]
    h.m.complete_load(keys(1, 1))
    assert h.store(B, keys(2, 8)) == keys(1, 1), "the doomed block goes first"


# ---- property: random traffic never evicts a block of a tenant inside its share ------------

POOL_SLOTS, DISK_KEYS = 8, 10
SHARES = {A: (3, 4), B: (2, 3), C: (0, 0)}  # (pool slots, disk blocks)
TRAFFIC_POLICY = TenantPolicy(
    named={
        A: {PRIMARY: TenantLimits(3), "disk": TenantLimits(4)},
        B: {PRIMARY: TenantLimits(2), "disk": TenantLimits(3)},
        C: {PRIMARY: TenantLimits(0, cap=5), "disk": TenantLimits(0)},
    }
)


class TenantTraffic(RuleBasedStateMachine):
    """Stores and lookups of three tenants (two with shares in the pool and on disk, one with
    none and a pool cap) against a HOLD disk tier of ``DISK_KEYS`` blocks, tier jobs answered
    in any order. After each step, every block that left the pool or the disk belonged to the
    tenant whose traffic it was, or to a tenant over its share that stays at or above it."""

    def __init__(self) -> None:
        super().__init__()
        self.h = TenantHarness(POOL_SLOTS, [disk_spec(DISK_KEYS)], TRAFFIC_POLICY)
        self.h.m.events.start()
        self.owner: dict[bytes, str] = {}
        self.keys_of: dict[str, list[bytes]] = {t: [] for t in SHARES}
        self.pending: list = []
        self.fresh = 0

    def usage(self) -> tuple[dict[str, int], dict[str, int]]:
        pool = {t: 0 for t in SHARES}
        disk = {t: 0 for t in SHARES}
        for key, tenant in self.owner.items():
            pool[tenant] += key in self.h.m.primary
            disk[tenant] += key in self.h.m.tiers[0].index
        return pool, disk

    def step(self, actors: set[str], action) -> None:
        """Run ``action`` (only a store, a lookup or a step's end evicts, removes or
        cascades) and check who lost blocks."""
        pool_before, disk_before = self.usage()
        waiting = {self.owner[key] for key in self.h.m.cascades.per_tier[0].dirty}
        action()
        new_jobs = self.h.m.take_submissions()
        self.pending += new_jobs
        pool_after, disk_after = self.usage()
        for event in self.h.m.take_events():
            if event.tier != "primary" or not event.removed:
                continue
            for key in event.keys:
                tenant = self.owner[key]
                if tenant in actors:
                    continue
                assert pool_before[tenant] > SHARES[tenant][0], "evicted inside its share"
                assert pool_after[tenant] >= SHARES[tenant][0], "evicted below its share"
        cascading = waiting | {
            self.owner[key] for job in new_jobs if job.kind is JobKind.CASCADE for key in job.keys
        }
        for job in new_jobs:
            if job.kind is not JobKind.DELETE:
                continue
            for key in job.keys:
                tenant = self.owner[key]
                if tenant in actors | cascading:
                    continue
                assert disk_before[tenant] > SHARES[tenant][1], "removed inside its share"
                assert disk_after[tenant] >= SHARES[tenant][1], "removed below its share"

    @rule(tenant=st.sampled_from(sorted(SHARES)), n=st.integers(1, 4), data=st.data())
    def store(self, tenant: str, n: int, data) -> None:
        old = self.keys_of[tenant]
        if old and data.draw(st.booleans()):
            keys = data.draw(st.lists(st.sampled_from(old), min_size=1, max_size=n, unique=True))
        else:
            keys = [k(10_000 + self.fresh + i) for i in range(n)]
            self.fresh += n
            for key in keys:
                self.owner[key] = tenant
            old += keys

        def act() -> None:
            req = self.h.request(tenant)
            try:
                out = self.h.m.prepare_store(req, keys)
            except TenantCapReached:
                out = None
            if out is not None and out.keys_to_store:
                self.h.m.complete_store(req, out.keys_to_store)
            self.h.m.on_request_finished(req)

        self.step({tenant}, act)

    @rule(tenant=st.sampled_from(sorted(SHARES)), data=st.data())
    def lookup(self, tenant: str, data) -> None:
        old = self.keys_of[tenant]
        if not old:
            return
        keys = data.draw(st.lists(st.sampled_from(old), min_size=1, max_size=6, unique=True))

        def act() -> None:
            req = self.h.request(tenant)
            self.h.m.lookup(req, keys)
            self.h.m.on_request_finished(req)

        self.step({tenant}, act)

    @rule(data=st.data())
    def answer(self, data) -> None:
        if not self.pending:
            self.step(set(), self.h.m.end_step)
            return
        picks = data.draw(st.lists(st.integers(0, len(self.pending) - 1), min_size=1, unique=True))
        for job in [self.pending[i] for i in picks]:
            self.pending.remove(job)
            self.h.answer(job)
        self.step(set(), self.h.m.end_step)

    @invariant()
    def tiers_stay_within_their_room(self) -> None:
        assert len(self.h.m.primary) <= POOL_SLOTS
        assert len(self.h.held["disk"]) <= DISK_KEYS, "the disk worker never has to evict"
        assert self.usage()[0][C] <= 5, "C's cap"


TestTenantTraffic = TenantTraffic.TestCase
TestTenantTraffic.settings = settings(
    max_examples=80,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
