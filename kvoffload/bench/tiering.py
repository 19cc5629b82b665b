"""Benchmark of the pure tiering library: batched lookups and store bookkeeping.

Writes JSON (default results/bench_tiering.json) with, measured in the same run:
- the floor: a bare dict-membership loop over the same keys;
- all-HIT lookups of a 1,000-key prefix (keys/s and ratio to the floor);
- a 1,000-key prefix whose second half lives in a secondary tier (first lookup: promotions
  started; repeated lookups while they are pending);
- prepare_store + complete_store throughput (with cascades to one tier, results applied).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from kvoffload.tiering import Locality, Medium, ReqContext, TieringLedger, TierSpec, TransferResult


def seeded_keys(n: int, seed: int = 0) -> list[bytes]:
    """``n`` 32-byte keys numbered from ``seed`` (random ones when ``seed`` < 0)."""
    return (
        [os.urandom(32) for _ in range(n)]
        if seed < 0
        else [i.to_bytes(8, "big") * 4 for i in range(seed, seed + n)]
    )


def best_rate(fn, n_keys: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return n_keys / best


def bench_floor(keys: list[bytes], repeat: int) -> float:
    table = {k: (i, 0) for i, k in enumerate(keys)}

    def loop():
        out = []
        for k in keys:
            out.append(k in table)
        return out

    return best_rate(loop, len(keys), repeat)


def bench_all_hit(keys: list[bytes], repeat: int) -> float:
    m = TieringLedger(len(keys) * 2)
    m.on_new_request(ReqContext("r"))
    out = m.prepare_store("r", keys)
    assert out is not None, "the pool has room for every key"
    m.complete_store("r", out.keys_to_store)
    reply = m.lookup("r", keys)
    assert reply.hit_prefix == len(keys)
    return best_rate(lambda: m.lookup("r", keys), len(keys), repeat)


def bench_fresh_keys(keys: list[bytes], repeat: int) -> dict:
    """Keys decoded from msgpack on every call, as the manager receives them (hashes not cached)."""
    import msgspec

    wire = msgspec.msgpack.encode(keys)
    table = {k: (i, 0) for i, k in enumerate(keys)}
    m = TieringLedger(len(keys) * 2)
    m.on_new_request(ReqContext("r"))
    out = m.prepare_store("r", keys)
    assert out is not None, "the pool has room for every key"
    m.complete_store("r", out.keys_to_store)

    def floor():
        fresh = msgspec.msgpack.decode(wire)
        return [k in table for k in fresh]

    def lookup():
        return m.lookup("r", msgspec.msgpack.decode(wire))

    floor_rate = best_rate(floor, len(keys), repeat)
    lookup_rate = best_rate(lookup, len(keys), repeat)
    return {
        "floor_keys_per_s": floor_rate,
        "lookup_keys_per_s": lookup_rate,
        "ratio": lookup_rate / floor_rate,
    }


def bench_half_secondary(keys: list[bytes], repeat: int) -> dict:
    half = len(keys) // 2
    first_rates, pending_rates = [], []
    for _ in range(repeat):
        m = TieringLedger(len(keys) * 2, [TierSpec("disk", Medium.STORAGE, Locality.LOCAL)])
        m.on_new_request(ReqContext("w"))
        out = m.prepare_store("w", keys[:half])
        assert out is not None, "the pool has room for every key"
        m.complete_store("w", out.keys_to_store)
        for job in m.take_submissions():
            m.apply_result("disk", TransferResult(job.job_id, True))
        m.apply_index_update("disk", keys[half:], [])
        m.on_new_request(ReqContext("r"))
        t0 = time.perf_counter()
        reply = m.lookup("r", keys)
        first_rates.append(len(keys) / (time.perf_counter() - t0))
        assert reply.hit_prefix == len(keys)
        t0 = time.perf_counter()
        m.lookup("r", keys)
        pending_rates.append(len(keys) / (time.perf_counter() - t0))
    return {
        "first_lookup_keys_per_s": max(first_rates),
        "pending_lookup_keys_per_s": max(pending_rates),
    }


def bench_store(n_keys: int, batch: int) -> dict:
    m = TieringLedger(4096, [TierSpec("disk", Medium.STORAGE, Locality.LOCAL)])
    m.on_new_request(ReqContext("r"))
    stream = seeded_keys(n_keys, seed=10_000_000)
    t0 = time.perf_counter()
    for i in range(0, n_keys, batch):
        out = m.prepare_store("r", stream[i : i + batch])
        assert out is not None, "the pool has room for every key"
        m.complete_store("r", out.keys_to_store)
        for job in m.take_submissions():
            m.apply_result("disk", TransferResult(job.job_id, True))
    seconds = time.perf_counter() - t0
    return {
        "keys": n_keys,
        "batch": batch,
        "keys_per_s": n_keys / seconds,
        "evictions": m.primary.evictions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--out", default="results/bench_tiering.json")
    args = parser.parse_args(argv)
    keys = seeded_keys(args.keys)
    floor = bench_floor(keys, args.repeat)
    all_hit = bench_all_hit(keys, args.repeat)
    result = {
        "prefix_keys": args.keys,
        "floor_dict_membership_keys_per_s": floor,
        "all_hit_lookup_keys_per_s": all_hit,
        "all_hit_ratio_to_floor": all_hit / floor,
        "fresh_keys_decoded_per_call": bench_fresh_keys(keys, args.repeat),
        "half_in_secondary": bench_half_secondary(keys, min(args.repeat, 20)),
        "store": bench_store(50_000, 16),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
