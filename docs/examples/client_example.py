"""An engine's use of a running kvoffload service, step by step (see docs/client.md).

    kvoffload serve &
    python docs/examples/client_example.py            # finds the local service
    python docs/examples/client_example.py --empty-pool

With ``--empty-pool`` the example also empties the host pool (``reset_cache``) to show a lookup
that waits for a promotion from the disk tier: run it only against a service of your own.
Exits non-zero if any block read back differs from the block written.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import numpy as np

from kvoffload import (
    HostPool,
    KVOffloadClient,
    KVOffloadError,
    LookupOutcome,
    SharedKVCache,
    find_endpoint,
    payload_checksum,
)

TOKENS_PER_BLOCK = 16
HANDLE = "example-kv"


def block_keys(tokens: list[int]) -> list[bytes]:
    """One 16-byte key per full block of tokens, chained: a key names its whole prefix."""
    keys, parent = [], b""
    for start in range(0, len(tokens) - TOKENS_PER_BLOCK + 1, TOKENS_PER_BLOCK):
        block = np.asarray(tokens[start : start + TOKENS_PER_BLOCK], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(parent)
    return keys


def store_blocks(client: KVOffloadClient, req: str, keys: list[bytes], blocks: list[int]) -> int:
    """Offload device blocks; ``no_space`` (every pool slot pinned or being written) means retry
    later, so try a few times and otherwise skip this offload. Returns the keys stored."""
    for _ in range(5):
        try:
            accepted = client.store(req, keys, blocks, HANDLE)
        except KVOffloadError as err:
            if err.code != "no_space":
                raise
            time.sleep(0.05)
            continue
        if accepted.job_id is None:
            return 0  # every key was stored already
        done = client.wait([accepted.job_id])[accepted.job_id]
        return len(accepted.keys) if done.success else len(done.successful_keys or [])
    return 0


def lookup_ready_prefix(
    client: KVOffloadClient, req: str, keys: list[bytes], budget_s: float = 5.0
) -> LookupOutcome:
    """Look up a prefix and wait while it says so (HIT_PENDING: a promotion is landing; RETRY:
    a tier has not answered yet), for at most ``budget_s``."""
    outcome = client.lookup(req, keys)
    deadline = time.monotonic() + budget_s
    while outcome.must_wait and time.monotonic() < deadline:
        client.end_step()
        time.sleep(0.005)
        outcome = client.lookup(req, keys)
    return outcome


def load_blocks(client: KVOffloadClient, req: str, keys: list[bytes], blocks: list[int]) -> int:
    """Copy ready keys into device blocks. Returns how many leading blocks were loaded."""
    if not keys:
        return 0
    accepted = client.load(req, keys, blocks, HANDLE)
    done = client.wait([accepted.job_id])[accepted.job_id]
    if done.success:
        return len(keys)
    ok = set(done.successful_keys or [])
    return next(i for i, key in enumerate(keys) if key not in ok)


def check(condition: bool, what: str) -> None:
    if not condition:
        raise SystemExit(f"FAILED: {what}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--endpoint", help="client endpoint (default: $KVOFFLOAD_ENDPOINT, then the local run)"
    )
    parser.add_argument(
        "--empty-pool",
        action="store_true",
        help="also show a promotion from disk (calls reset_cache)",
    )
    args = parser.parse_args()

    # 1. Connect. auto_reconnect: a call answered not_connected (the manager restarted) starts
    #    a new session, registers the KV cache and reopens the requests, and is sent again.
    endpoint = find_endpoint(args.endpoint)
    client = KVOffloadClient(endpoint, name="client-example", timeout_s=10.0, auto_reconnect=True)
    info = client.info
    print(
        f"connected to {endpoint}: {info.num_slots} slots of {info.block_bytes} bytes, tiers {info.tiers}"
    )

    # 2. Register the KV cache: block-major tensors whose rows add up to one pool block (here
    #    K and V halves in one shared-memory segment the service's cpu worker maps).
    cache = SharedKVCache.create(None, 16, [info.block_bytes // 2, info.block_bytes // 2])
    try:
        rng = np.random.default_rng(0)
        for tensor in cache.tensors:
            tensor[:8] = rng.integers(0, 256, size=(8, tensor.shape[1]), dtype=np.uint8)
        client.register_kv(cache.handle(HANDLE))
        run(client, cache, info, args.empty_pool)
    finally:
        client.close()
        cache.close()
        cache.unlink()
    print("ok")


def run(client: KVOffloadClient, cache: SharedKVCache, info, empty_pool: bool) -> None:
    tag = os.getpid()
    prompt = [tag] + list(range(4 * TOKENS_PER_BLOCK))
    keys = block_keys(prompt)  # 4 keys for device blocks 0..3

    # 3. A first request computes its prompt and offloads the blocks.
    client.new_request("first")
    check(client.lookup("first", keys).hit_prefix == 0, "a new prompt is not in the service")
    stored = store_blocks(client, "first", keys, [0, 1, 2, 3])
    client.finish_request("first")
    print(f"first request: stored {stored} blocks")

    # 4. A second request shares the prefix and goes on: lookup -> wait -> load the ready
    #    prefix, compute the rest. The lookup stops at the first miss.
    longer = block_keys(prompt + list(range(1000, 1000 + 2 * TOKENS_PER_BLOCK)))
    client.new_request("second")
    outcome = lookup_ready_prefix(client, "second", longer)
    print(f"second request: {[r.name for r in outcome.results]} -> {outcome.ready_prefix} ready")
    ready = min(outcome.ready_prefix, len(keys))
    loaded = load_blocks(client, "second", longer[:ready], list(range(8, 8 + ready)))
    for i in range(loaded):
        check(cache.block(8 + i) == cache.block(i), f"loaded block {i} differs")
    client.finish_request("second")
    print(f"second request: loaded {loaded} blocks from the host pool")

    if empty_pool:
        # 5. With the host pool empty, the blocks come back from the disk tier: the lookup
        #    starts promotions (HIT_PENDING) and the request waits for them. A request with
        #    kv_load_tiers = [] reads the host pool only, so the same lookup is a miss for it.
        client.reset_cache()
        client.new_request("pool-only", {"kv_load_tiers": []})
        check(
            client.lookup("pool-only", keys).hit_prefix == 0,
            "a pool-only request saw the disk tier",
        )
        client.finish_request("pool-only")
        client.new_request("third")
        first = client.lookup("third", keys)
        print(f"third request: {[r.name for r in first.results]} (promotions started)")
        check(first.must_wait, "the first lookup after the pool was emptied waits for promotions")
        outcome = lookup_ready_prefix(client, "third", keys)
        ready = outcome.ready_prefix
        loaded = load_blocks(client, "third", keys[:ready], list(range(12, 12 + ready)))
        for i in range(loaded):
            check(cache.block(12 + i) == cache.block(i), f"promoted block {i} differs")
        client.finish_request("third")
        print(f"third request: loaded {loaded} blocks promoted from disk")
        check(loaded == len(keys), "the disk tier served the prefix")

    direct_path(client, info, block_keys([tag, -1] + list(range(2 * TOKENS_PER_BLOCK))))


def direct_path(client: KVOffloadClient, info, keys: list[bytes]) -> None:
    """An engine that copies blocks itself maps the host pool and moves bytes into and out of
    the slots the manager hands out (same host and user as the service)."""
    pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
    try:
        payloads = [bytes([i + 1]) * info.block_bytes for i in range(len(keys))]
        client.new_request("direct")
        prepared = client.prepare_store("direct", keys)  # only the keys not stored yet
        for key, slot in zip(prepared.keys, prepared.slots, strict=True):
            pool.slot(slot)[:] = payloads[keys.index(key)]
        checksums = [[payload_checksum(pool.slot(slot))] for slot in prepared.slots]
        client.complete_store("direct", prepared.keys, checksums=checksums)

        # The vLLM integration's read: a pinned lookup returns each HIT's slot and checksum.
        outcome = client.lookup("direct", keys, pin=True)
        # slots and checksums stop after the first MISS: keys may be longer
        pinned = [key for key, slot in zip(keys, outcome.slots, strict=False) if slot >= 0]
        for key, slot, digests in zip(keys, outcome.slots, outcome.checksums, strict=False):
            if slot >= 0:
                data = bytes(pool.slot(slot))
                check([payload_checksum(data)] == digests, "pinned slot matches its checksum")
                check(data == payloads[keys.index(key)], "pinned slot holds the stored block")
        client.complete_load("direct", pinned)  # release the pins

        # Or pin ready keys explicitly, read, release.
        slots = client.prepare_load("direct", keys)
        for key, slot in zip(slots.keys, slots.slots, strict=True):
            check(
                bytes(pool.slot(slot)) == payloads[keys.index(key)], "prepared slot holds the block"
            )
        client.complete_load("direct", slots.keys)
        client.finish_request("direct")
        print(f"direct path: stored and read back {len(pinned)} blocks through pool slots")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
