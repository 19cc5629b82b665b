"""Tenants through a real service (``kvoffload serve``, its workers, SeaweedFS for the bucket):
shares a flood cannot take, caps that refuse and say so, a drop that empties every tier of one
tenant and nothing else, typed errors for a bad tenant id, and the start-up refusals of
shares and caps that cannot hold."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time

import pytest

from kvoffload.cli import main
from kvoffload.client import KVOffloadClient, KVOffloadError, LookupOutcome
from kvoffload.testing.helpers import free_port, keys_for, wait_until
from kvoffload.testing.metrics import sample_value, scrape_metrics
from kvoffload.testing.s3server import block_object_names, object_section
from kvoffload.testing.service import serve_harness, to_toml
from kvoffload.tiering import LookupResult
from kvoffload.wire import protocol as p
from kvoffload.wire.protocol import ErrorCode
from kvoffload.wire.tenant_ids import TENANT_KEY_ENV, read_key, tenant_id, tenant_key

HIT, MISS = LookupResult.HIT, LookupResult.MISS
SLOTS = 64
SHARE = 16
ALICE, BOB, CAROL = tenant_id("alice"), tenant_id("bob"), tenant_id("carol")


def store(client: KVOffloadClient, req_id: str, tenant: str, keys: list[bytes]) -> None:
    """One request of ``tenant`` stores ``keys`` (the bytes are whatever the slots hold: the
    service checks nothing of them here) in batches of eight."""
    client.new_request(req_id, tenant=tenant)
    for first in range(0, len(keys), 8):
        batch = keys[first : first + 8]
        prepared = client.prepare_store(req_id, batch)
        client.complete_store(req_id, prepared.keys)
    client.finish_request(req_id)


def hits(client: KVOffloadClient, req_id: str, tenant: str, keys: list[bytes]) -> int:
    """How many of ``keys`` a new request of ``tenant`` finds in a row, once no tier is still
    asked or promoting them."""

    def settled() -> LookupOutcome | None:
        outcome = client.lookup(req_id, keys, wait_ms=1000)
        return None if outcome.must_wait else outcome

    client.new_request(req_id, tenant=tenant)
    try:
        return wait_until(settled, what="the lookup's promotions").results.count(HIT)
    finally:
        client.finish_request(req_id)


def test_a_tenant_inside_its_pool_share_keeps_its_prefix_under_another_tenants_flood(
    start_service,
):
    port = free_port()
    service = start_service(
        extra_config=to_toml({"tenants": {"alice": {"pool_slots_share": SHARE}}}),
        service_options=f"metrics_port = {port}",
        num_slots=SLOTS,
    )
    alice, carol = keys_for("alice", SHARE), keys_for("carol", SHARE)
    with service.client("engine") as client:
        store(client, "alice-warm", "alice", alice)
        store(client, "carol-warm", "carol", carol)
        store(client, "bob-flood", "bob", keys_for("bob", 10 * SLOTS))
        assert hits(client, "alice-again", "alice", alice) == SHARE
        assert hits(client, "carol-again", "carol", carol) == 0  # no share: flooded out
        tenants = client.status().tiering.tenants
    assert tenants[ALICE].named and tenants[ALICE].tiers["primary"].blocks == SHARE
    unkeyed = [e for e in service.log_events() if e.get("event") == "tenant_ids_unkeyed"]
    assert len(unkeyed) == 1  # configured tenants without a key: ids guessable from names
    assert tenants[ALICE].tiers["primary"].evicted_by_others == 0
    assert tenants[ALICE].tiers["primary"].share_blocks == SHARE
    assert tenants[CAROL].tiers["primary"].evicted_by_others == SHARE
    assert tenants[BOB].tiers["primary"].evictions > 0
    assert tenants[BOB].tiers["primary"].bytes == tenants[BOB].tiers["primary"].blocks * 65536
    assert tenants[ALICE].lookups_hit == SHARE and tenants[CAROL].lookups_miss >= 1
    families = scrape_metrics(  # published at the manager's next housekeeping turn
        port, lambda f: sample_value(f, "kvoffload_tenant_lookup_keys", tenant=ALICE, result="hit")
    )
    labels = {"tenant": ALICE, "tier": "primary"}
    assert sample_value(families, "kvoffload_tenant_blocks", **labels) == SHARE
    assert sample_value(families, "kvoffload_tenant_share_blocks", **labels) == SHARE
    assert sample_value(families, "kvoffload_tenant_evicted_by_others", **labels) == 0
    by_others = sample_value(
        families, "kvoffload_tenant_evicted_by_others", tenant=CAROL, tier="primary"
    )
    assert by_others == SHARE
    hit = sample_value(families, "kvoffload_tenant_lookup_keys", tenant=ALICE, result="hit")
    assert hit == SHARE and sample_value(families, "kvoffload_tenant_requests", tenant=BOB) == 0
    assert not any("alice" in str(s.labels) for f in families.values() for s in f.samples)


def test_a_tenant_at_its_cap_has_its_stores_refused_counted_and_logged(start_service):
    service = start_service(extra_config=to_toml({"tenants": {"bob": {"pool_slots_cap": 8}}}))
    keys = keys_for("bob", 9)
    with service.client("engine") as client:
        client.new_request("bob", tenant="bob")
        client.prepare_store("bob", keys[:8])  # being written: its own blocks cannot make room
        with pytest.raises(KVOffloadError) as refused:
            client.prepare_store("bob", keys[8:])
        assert refused.value.code is ErrorCode.TENANT_CAP
        client.complete_store("bob", keys[:8])
        client.prepare_store("bob", keys[8:])  # now its least recent block makes the room
        tiers = client.status().tiering.tenants[BOB].tiers
    assert tiers["primary"].refused == 1 and tiers["primary"].cap_blocks == 8
    assert tiers["primary"].blocks == 8 and tiers["primary"].evicted_by_others == 0
    events = wait_until(
        lambda: [e for e in service.log_events() if e.get("event") == "tenant_cap_refused"],
        what="the refusal's log line",
    )
    assert events[0]["tenant"] == BOB and events[0]["tier"] == "primary"
    assert not any("bob" in str(e.get("tenant")) for e in events)


def test_a_bad_tenant_id_gets_a_typed_error_and_the_manager_keeps_serving(start_service):
    service = start_service()
    pid = service.manager_pid()
    with service.client("engine") as client:
        for bad in ("alice", "0123456789ABCDEF", "0" * 15):
            with pytest.raises(KVOffloadError) as error:
                client._call(p.NewRequest, p.NewRequestReply, req_id="r", params={}, tenant=bad)
            assert error.value.code is ErrorCode.BAD_TENANT
            with pytest.raises(KVOffloadError) as error:
                client._call(p.TenantDrop, p.TenantDropped, tenant=bad)
            assert error.value.code is ErrorCode.BAD_TENANT
        with pytest.raises(KVOffloadError) as error:
            client._call(p.TenantDrop, p.TenantDropped, tenant="")
        assert error.value.code is ErrorCode.BAD_TENANT
        store(client, "after", "alice", keys_for("after", 4))
        assert hits(client, "again", "alice", keys_for("after", 4)) == 4
    assert service.manager_pid() == pid


def cli(service, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvoffload ARGS --endpoint`` the service's."""
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", *args, "--endpoint", service.endpoint],
        capture_output=True,
        text=True,
        timeout=60,
    )


def bucket_names(s3, bucket: str, prefix: str) -> list[str]:
    return block_object_names(s3, bucket, prefix)


def test_a_tenant_drop_removes_its_blocks_from_pool_disk_and_bucket_and_nothing_else(
    start_service, s3_server
):
    bucket = s3_server.create_bucket("tenants")
    prefix = f"drop-{time.time_ns()}"
    service = start_service(
        workers=("cpu", "disk", "object"),
        extra_config=to_toml({"object": object_section(s3_server, bucket, prefix)}),
    )
    alice, bob = keys_for("alice", 8), keys_for("bob", 8)
    s3 = s3_server.client()
    with service.client("engine", timeout_s=20.0) as client:
        store(client, "alice", "alice", alice)
        store(client, "bob", "bob", bob)

        def cascaded() -> bool:
            per_tier = client.status().tiering.per_tier
            return per_tier["disk"].cascaded_keys_ok == 16 and (
                per_tier["object"].cascaded_keys_ok == 16
            )

        wait_until(cascaded, what="the cascades to disk and bucket")
        names = bucket_names(s3, bucket, prefix)
        assert len(names) == 16 and not any("alice" in n or "bob" in n for n in names)
        alice_names = [n for n in names if f"/tenants/{ALICE}/" in n]
        assert len(alice_names) == 8
        other_node = alice_names[0].rsplit("/", 1)[0] + "/" + "ab" * 32  # another node's block
        s3.put_object(Bucket=bucket, Key=other_node, Body=b"x")
        status = cli(service, "status")
        assert status.returncode == 0 and ALICE in status.stdout and BOB in status.stdout
        assert "alice" not in status.stdout and "bob" not in status.stdout
        empty = cli(service, "tenant", "drop", "")
        assert empty.returncode == 1 and len(empty.stderr.strip().splitlines()) == 1, empty
        out = cli(service, "tenant", "drop", "alice")
        assert out.returncode == 0, out.stderr
        assert f"tenant {ALICE} dropped" in out.stdout and "alice" not in out.stdout.split()[1:]
        counts = {line.split()[0]: int(line.split()[1]) for line in out.stdout.splitlines()[1:]}
        assert counts == {"primary": 8, "disk": 8, "object": 9}, out.stdout
        assert [n for n in bucket_names(s3, bucket, prefix) if ALICE in n] == []
        assert len(bucket_names(s3, bucket, f"{prefix}/")) == 8  # bob's
        tenants = client.status().tiering.tenants
        assert all(t.blocks == 0 for t in tenants[ALICE].tiers.values())
        assert tenants[BOB].tiers["primary"].blocks == 8
        assert tenants[BOB].tiers["disk"].blocks == 8
        assert hits(client, "alice-again", "alice", alice) == 0
        assert hits(client, "bob-again", "bob", bob) == 8
        client.reset_cache()
        assert hits(client, "alice-disk", "alice", alice) == 0  # not on disk nor in the bucket
        assert hits(client, "bob-disk", "bob", bob) == 8  # promoted from disk
        dropped = client.tenant_drop("alice")  # nothing left: every count 0
        assert dropped.removed == {"primary": 0, "disk": 0, "object": 0}
    log = service.log_path.read_text()
    assert "tenant_dropped" in log and ALICE in log and "alice" not in log.lower()


@pytest.mark.parametrize(
    ("tenants", "named"),
    [
        (
            {"alice": {"pool_slots_share": 40}, "bob": {"pool_slots_share": 30}},
            "the pool_slots_share values add up to 70",
        ),
        ({"alice": {"disk_bytes_share": 8, "disk_bytes_cap": 4}}, "tenants.alice.disk_bytes_cap"),
        ({"default": {"pool_slots_cap": 2}, "bob": {"pool_slots_share": 4}}, "tenants.bob"),
    ],
)
def test_shares_over_a_tier_or_a_cap_below_a_share_are_refused_at_start(
    tmp_path, capsys, tenants, named
):
    config = tmp_path / "kvoffload.toml"
    config.write_text(to_toml({"pool": {"num_slots": SLOTS}, "tenants": tenants}))
    with pytest.raises(SystemExit) as refused:
        main(["serve", "--config", str(config)])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvoffload: invalid configuration: ") and named in err, err


def test_a_tenants_blocks_come_back_from_the_bucket_to_that_tenant_only(start_service, s3_server):
    bucket = s3_server.create_bucket("tenants")
    prefix = f"promote-{time.time_ns()}"
    service = start_service(
        workers=("cpu", "object"),
        extra_config=to_toml({"object": object_section(s3_server, bucket, prefix)}),
    )
    bob = keys_for("bob", 8)
    with service.client("engine", timeout_s=20.0) as client:
        store(client, "bob", "bob", bob)
        wait_until(
            lambda: client.status().tiering.per_tier["object"].cascaded_keys_ok == 8,
            what="the cascade to the bucket",
        )
        client.reset_cache()
        assert hits(client, "alice", "alice", bob) == 0  # the same keys: another tenant's
        assert hits(client, "bob-again", "bob", bob) == 8
        promoted = client.status().tiering.per_tier["object"].promoted_keys_ok
    assert promoted == 8


def test_keyed_tenant_ids_and_a_node_with_another_key_refused_by_the_bucket(
    start_service, s3_server, tmp_path, monkeypatch
):
    bucket = s3_server.create_bucket("tenants")
    prefix = f"keyed-{time.time_ns()}"
    section = {"object": object_section(s3_server, bucket, prefix)}
    key_a, key_b = tmp_path / "a.key", tmp_path / "b.key"
    key_a.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    key_b.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    monkeypatch.setenv(TENANT_KEY_ENV, str(key_a))  # this process names tenants as node A does
    tenant_key.cache_clear()
    try:
        keyed = tenant_id("alice")
        assert keyed == tenant_id("alice", read_key(str(key_a)))
        assert keyed not in (tenant_id("alice", b""), tenant_id("alice", read_key(str(key_b))))
        node_a = start_service(
            workers=("cpu", "object"),
            extra_config=to_toml({**section, "tenants": {"alice": {"pool_slots_share": 4}}}),
            env=dict(os.environ),
        )
        with node_a.client("engine", timeout_s=20.0) as client:
            store(client, "alice", "alice", keys_for("alice", 4))
            wait_until(
                lambda: client.status().tiering.per_tier["object"].cascaded_keys_ok == 4,
                what="the cascade to the bucket",
            )
            assert keyed in client.status().tiering.tenants
        names = block_object_names(s3_server.client(), bucket, prefix)
        assert sum(f"/tenants/{keyed}/" in n for n in names) == 4
        assert not [e for e in node_a.log_events() if e.get("event") == "tenant_ids_unkeyed"]

        node_b = serve_harness(
            tmp_path / "node-b",
            workers=("cpu", "object"),
            extra_config=to_toml(section),
            env={**os.environ, TENANT_KEY_ENV: str(key_b)},
        )
        try:
            node_b.start(wait_for=("cpu",))
            refused = wait_until(
                lambda: [
                    e for e in node_b.log_events() if e.get("event") == "object_store_unusable"
                ],
                what="node B's object tier refused",
            )
            assert "another key than this node's" in refused[0]["error"]
            assert node_b.status().tiers_down == ["object"]
        finally:
            left = node_b.stop()
        assert left.clean, left
    finally:
        monkeypatch.undo()
        tenant_key.cache_clear()
