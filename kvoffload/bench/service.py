"""Benchmarks of the running service (control plane and data plane), JSON out.

Control plane: p50/p99 round trip of a batched lookup (1 and 1,000 keys) through the manager,
the same call on the in-process tiering library, and a bare ZeroMQ DEALER/ROUTER round trip
carrying a frame of the same size (the floor), all measured in one run.
Data plane: device-store and device-load GB/s through the cpu worker (client -> manager -> cpu
worker -> shared memory) for several block sizes, one job of ``total`` bytes, steady state (best of
three rounds after a first round that warms the mappings; the first round is reported too), next
to a single-thread np.copyto of the same bytes measured in the same run.

Starts its own service (host pool + cpu worker; disk and object tiers off) in a temp directory.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import zmq

from kvoffload.client import KVOffloadClient, KVOffloadError, LookupOutcome, PendingCall
from kvoffload.logs import configure_logging
from kvoffload.memory.kvcache import SharedKVCache, unique_kv_name
from kvoffload.memory.pool import HostPool
from kvoffload.memory.slotcopy import Hashed, shared_copier
from kvoffload.testing.helpers import keys_for
from kvoffload.testing.service import ServiceHarness
from kvoffload.tiering import ReqContext, TieringLedger
from kvoffload.wire import protocol as p
from kvoffload.wire.protocol import LookupResult

T = TypeVar("T")
"""The reply of a call sent one batch ahead (``one_call_ahead``)."""

SECTIONS = ("control", "latency", "data")


def percentiles(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "p50_us": statistics.median(ordered) * 1e6,
        "p99_us": ordered[int(len(ordered) * 0.99) - 1] * 1e6,
    }


ECHO_SERVER = """
import sys, zmq
router = zmq.Context.instance().socket(zmq.ROUTER)
router.bind(sys.argv[1])
print("ready", flush=True)
while True:
    frames = router.recv_multipart()
    if frames[1] == b"stop":
        break
    router.send_multipart(frames)
"""


class EchoServer:
    """A ZeroMQ ROUTER echo in another process over ipc, with a DEALER connected to it: the
    transport floor. ``round_trip`` times one send and its echo."""

    def __init__(self) -> None:
        self._directory = tempfile.mkdtemp(prefix="kvo-echo-")
        endpoint = f"ipc://{self._directory}/echo.sock"
        self._server = subprocess.Popen(
            [sys.executable, "-c", ECHO_SERVER, endpoint], stdout=subprocess.PIPE, text=True
        )
        assert self._server.stdout is not None
        self._server.stdout.readline()
        self._server.stdout.close()
        self._dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self._dealer.connect(endpoint)

    def round_trip(self, frame: bytes) -> float:
        t0 = time.perf_counter()
        self._dealer.send(frame)
        self._dealer.recv()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the echo process and remove its socket's directory."""
        self._dealer.send(b"stop")
        self._server.wait(10)
        self._dealer.close(0)
        shutil.rmtree(self._directory, ignore_errors=True)


def bare_zmq_rtt(frame: bytes, rounds: int) -> dict:
    """Back-to-back round trips through an ``EchoServer`` (all four threads stay hot)."""
    echo = EchoServer()
    samples = [echo.round_trip(frame) for _ in range(rounds)]
    echo.close()
    return percentiles(samples[10:])


def library_lookup(keys: list[bytes], rounds: int) -> dict:
    m = TieringLedger(len(keys) + 16)
    m.on_new_request(ReqContext("r"))
    out = m.prepare_store("r", keys)
    assert out is not None
    m.complete_store("r", out.keys_to_store)
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        m.lookup("r", keys)
        samples.append(time.perf_counter() - t0)
    return percentiles(samples)


def service_lookup(client: KVOffloadClient, req: str, keys: list[bytes], rounds: int) -> dict:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        reply = client.lookup(req, keys)
        samples.append(time.perf_counter() - t0)
    assert reply.hit_prefix == len(keys)
    return percentiles(samples[10:])


def control_plane(client: KVOffloadClient, rounds: int) -> dict:
    result: dict[str, dict[str, Any]] = {}
    for n in (1, 1000):
        keys = keys_for(f"cp{n}", n)
        req = f"cp-{n}"
        client.new_request(req)
        for i in range(0, n, 64):
            chunk = keys[i : i + 64]
            job = client.store(req, chunk, list(range(len(chunk))), "bench")
            if job.job_id is not None:
                wait_job(client, job)
        frame = msgspec.msgpack.encode({"t": "lookup", "rid": 1, "req_id": req, "keys": keys})
        result[f"{n}_keys"] = {
            "manager": service_lookup(client, req, keys, rounds),
            "library_in_process": library_lookup(keys, rounds),
            "bare_zmq_same_frame": bare_zmq_rtt(frame, rounds),
        }
        entry = result[f"{n}_keys"]
        entry["manager_over_bare_zmq_p50"] = (
            entry["manager"]["p50_us"] / entry["bare_zmq_same_frame"]["p50_us"]
        )
        client.finish_request(req)
    return result


def data_plane(block_sizes: list[int], total_bytes: int) -> dict:
    results: dict[str, dict[str, Any]] = {}
    for block in block_sizes:
        n = max(4, min(2048, total_bytes // block))
        cfg_note: dict[str, Any] = {"block_bytes": block, "blocks": n}
        with bench_service(block, n * 2 + 16) as service:
            client = service.client("bench", timeout_s=60.0)
            kv = SharedKVCache.create(unique_kv_name(), n * 2, [block])
            rng = np.random.default_rng(1)
            kv.tensors[0][:] = rng.integers(0, 256, size=(2 * n, block), dtype=np.uint8)
            client.register_kv(kv.handle("bench"))
            client.new_request("dp")
            stores: list[float] = []
            loads: list[float] = []
            for round_no in range(4):
                keys = keys_for(f"dp{block}-{round_no}", n)
                t0 = time.perf_counter()
                wait_job(client, client.store("dp", keys, list(range(n)), "bench"))
                stores.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                done = wait_job(client, client.load("dp", keys, list(range(n, 2 * n)), "bench"))
                loads.append(time.perf_counter() - t0)
                assert done.success and np.array_equal(kv.tensors[0][:n], kv.tensors[0][n : 2 * n])
            cfg_note["first_round_store_s"], cfg_note["first_round_load_s"] = stores[0], loads[0]
            store_s, load_s = min(stores[1:]), min(loads[1:])
            src = kv.tensors[0][:n]
            dst = np.empty_like(src)
            np.copyto(dst, src)
            t0 = time.perf_counter()
            np.copyto(dst, src)
            memcpy_s = time.perf_counter() - t0
            nbytes = n * block
            cfg_note.update(
                store_gb_s=nbytes / store_s / 1e9,
                load_gb_s=nbytes / load_s / 1e9,
                memcpy_gb_s=nbytes / memcpy_s / 1e9,
            )
            cfg_note["store_over_memcpy"] = cfg_note["store_gb_s"] / cfg_note["memcpy_gb_s"]
            cfg_note["load_over_memcpy"] = cfg_note["load_gb_s"] / cfg_note["memcpy_gb_s"]
            client.finish_request("dp")
            client.close()
            kv.close()
            kv.unlink()
        results[str(block)] = cfg_note
    return results


def wait_job(client: KVOffloadClient, job: p.JobAccepted) -> p.DeviceJobFinished:
    """Wait for a device job the call created."""
    assert job.job_id is not None
    return client.wait([job.job_id], timeout_s=120)[job.job_id]


def device_job(
    client: KVOffloadClient, call: Callable[..., p.JobAccepted], keys: list[bytes], block: int
) -> None:
    """A one-block device store or load (``call``) through the cpu worker, waited for."""
    assert wait_job(client, call("lat", keys, [block], "bench")).success


def engine_store(
    client: KVOffloadClient,
    req: str,
    keys: list[bytes],
    pool: HostPool,
    rows: np.ndarray,
    wait: bool = False,
    prepared: p.Slots | None = None,
) -> None:
    """The engine-side store path: prepare_store, copy each row into its slot while taking its
    xxh3 (``SlotCopier.copy_with_checksums``, over the process's shared copier threads),
    complete_store with the checksums (without waiting for its reply unless ``wait``).
    ``prepared``: the reply of the prepare_store of ``keys`` when it was already sent. A copy
    that raises ends the prepared slots failed (``complete_store(success=False)``) and is
    raised."""
    slots = prepared or client.prepare_store(req, keys)
    try:
        row_of = dict(zip(keys, rows, strict=True))
        sums = shared_copier().copy_with_checksums(
            [
                (pool.slot_array(slot), row_of[key])
                for key, slot in zip(slots.keys, slots.slots, strict=True)
            ]
        )
    except BaseException:
        client.complete_store(req, list(slots.keys), success=False, wait=False)
        raise
    client.complete_store(req, list(slots.keys), checksums=[[s] for s in sums], wait=wait)


def engine_load(
    client: KVOffloadClient,
    req: str,
    keys: list[bytes],
    pool: HostPool,
    out: np.ndarray,
    wait_ms: int = 0,
    wait: bool = False,
    looked_up: LookupOutcome | None = None,
    inbox: dict[int, list[p.Landed]] | None = None,
) -> int:
    """The engine-side load path, as the vLLM integration loads: a pinned lookup, a copy of
    every HIT slot verified against the checksum recorded when it was written (each block's
    xxh3 taken of the bytes just copied, ``Hashed.DESTINATION``, over the process's shared
    copier threads), one complete_load of every key copied once the load is over, as vLLM
    releases a request's load (without waiting for its reply unless ``wait``); keys not
    ready yet are looked up again (held by the manager up to ``wait_ms`` until some of them
    land, when ``wait_ms`` > 0). With ``wait_ms`` > 0 and a client with a landing endpoint,
    the lookup asks for ``landing``: the keys it promotes are copied as the tier's worker
    tells of them (``take_landed``), without another lookup. ``looked_up``: the outcome of the
    first pinned lookup of ``keys`` when it was already sent; ``inbox``: notices read for other
    lookups' tickets, kept (see ``take_landings``). Returns the number of lookups it took;
    RuntimeError if a key missed or a copy did not match its checksum."""
    position = {key: i for i, key in enumerate(keys)}
    remaining = list(keys)
    lookups = 0
    pinned: list[bytes] = []

    def copy(hits: list[tuple[bytes, int, list[int]]]) -> set[bytes]:
        copied = [key for key, _, _ in hits]
        pinned.extend(copied)
        sums = shared_copier().copy_blocks(
            [[(out[position[key]], pool.slot_array(slot))] for key, slot, _ in hits],
            Hashed.DESTINATION,
        )
        bad = [key for (key, _, digests), got in zip(hits, sums, strict=True) if digests != [got]]
        if bad:
            raise RuntimeError(f"{len(bad)} loaded blocks do not match their checksums")
        return set(copied)

    try:
        while remaining:
            if looked_up is not None and not lookups:
                outcome = looked_up
            else:
                outcome = client.lookup(
                    req, remaining, pin=True, wait_ms=wait_ms, landing=wait_ms > 0
                )
            lookups += 1
            if LookupResult.MISS in outcome.results:
                raise RuntimeError(f"cold load missed: {outcome}")
            done = copy(
                [
                    (key, slot, digests)
                    for key, slot, digests in zip(
                        remaining, outcome.slots, outcome.checksums, strict=False
                    )
                    if slot >= 0
                ]
            )
            if outcome.ticket:
                expected = {
                    key
                    for key, slot in zip(remaining, outcome.landing_slots, strict=False)
                    if slot >= 0
                }
                done |= take_landings(client, req, outcome.ticket, expected, copy, wait_ms, inbox)
            remaining = [key for key in remaining if key not in done]
    finally:
        if pinned:
            client.complete_load(req, pinned, wait=wait)
    return lookups


def one_call_ahead(
    batches: list[list[bytes]],
    begin: Callable[[list[bytes]], PendingCall[T]],
    use: Callable[[int, list[bytes], T], None],
    drop: Callable[[list[bytes], T], None],
) -> None:
    """For each batch in order, ``use(index, batch, reply)`` with the reply of ``begin(batch)``,
    the next batch's call sent before ``use`` of this one runs, so the manager answers it
    while the caller works. When ``use`` raises, the reply of the call sent ahead goes to
    ``drop`` (to release what it holds), unless that call failed too."""
    ahead = (batches[0], begin(batches[0])) if batches else None
    try:
        for index, batch in enumerate(batches):
            assert ahead is not None
            call, ahead = ahead[1], None
            reply = call.result()
            if index + 1 < len(batches):
                ahead = (batches[index + 1], begin(batches[index + 1]))
            use(index, batch, reply)
    finally:
        if ahead is not None:
            keys, call = ahead
            with contextlib.suppress(KVOffloadError):
                drop(keys, call.result())


def engine_store_prefixes(
    client: KVOffloadClient, req: str, batches: list[list[bytes]], pool: HostPool, rows: np.ndarray
) -> None:
    """``engine_store`` of each batch of keys (their rows one after another in ``rows``), each
    batch's prepare_store sent before the batch ahead of it is copied (``one_call_ahead``), as
    an engine's worker prepares its next store while it copies; the last complete_store is
    awaited, so every block is acknowledged when this returns. Slots prepared for a batch
    that was not copied are ended failed."""
    starts = list(itertools.accumulate((len(b) for b in batches), initial=0))

    def store(index: int, batch: list[bytes], prepared: p.Slots) -> None:
        part = rows[starts[index] : starts[index + 1]]
        engine_store(client, req, batch, pool, part, index + 1 == len(batches), prepared)

    def drop(_: list[bytes], prepared: p.Slots) -> None:
        client.complete_store(req, list(prepared.keys), success=False, wait=False)

    one_call_ahead(batches, lambda batch: client.begin_prepare_store(req, batch), store, drop)


def engine_load_prefixes(
    client: KVOffloadClient,
    req: str,
    batches: list[list[bytes]],
    pool: HostPool,
    out: np.ndarray,
    wait_ms: int = 0,
) -> int:
    """``engine_load`` of each batch of keys (into rows one after another in ``out``), each
    batch's pinned lookup sent before the batch ahead of it is copied (``one_call_ahead``), as
    an engine's scheduler looks the next request up while its worker copies; the last
    complete_load is awaited. With ``wait_ms`` > 0 the lookups ask for ``landing`` (a client
    with a landing endpoint): a batch's promotions start while the batch ahead of it still
    lands, so the tier reads ahead. What a lookup whose batch was not copied pinned, or is
    landing for this client, is released. Returns the number of lookups it took (one per
    batch when each batch's blocks came in answer to its own)."""
    starts = list(itertools.accumulate((len(b) for b in batches), initial=0))
    inbox: dict[int, list[p.Landed]] = {}
    lookups = 0

    def load(index: int, batch: list[bytes], looked_up: LookupOutcome) -> None:
        nonlocal lookups
        part = out[starts[index] : starts[index + 1]]
        last = index + 1 == len(batches)
        lookups += engine_load(client, req, batch, pool, part, wait_ms, last, looked_up, inbox)

    def drop(keys: list[bytes], outcome: LookupOutcome) -> None:
        held = [
            key
            for i, key in enumerate(keys)
            if any(
                i < len(slots) and slots[i] >= 0 for slots in (outcome.slots, outcome.landing_slots)
            )
        ]
        if held:
            client.complete_load(req, held, wait=False)

    def begin(batch: list[bytes]) -> PendingCall[LookupOutcome]:
        return client.begin_lookup(req, batch, pin=True, landing=wait_ms > 0)

    one_call_ahead(batches, begin, load, drop)
    return lookups


def take_landings(
    client: KVOffloadClient,
    req: str,
    ticket: int,
    expected: set[bytes],
    copy: Callable[[list[tuple[bytes, int, list[int]]]], set[bytes]],
    wait_ms: int,
    inbox: dict[int, list[p.Landed]] | None = None,
) -> set[bytes]:
    """Copy (``copy``) each of ``expected`` as its ``Landed`` notice of ``ticket`` arrives,
    until every one was told, the job is over, or ``wait_ms`` passed; returns the keys copied.
    The keys given up on are released (their landing wait cancelled) and left to the next
    lookup; a key told failed raises RuntimeError (a miss). With an ``inbox``, notices of
    other tickets (lookups sent ahead) are kept there by ticket, and this ticket's are taken
    from it first; without one they are dropped."""
    done: set[bytes] = set()
    waiting = set(expected)
    deadline = time.monotonic() + wait_ms / 1000
    over = False
    while waiting and not over:
        notices = inbox.pop(ticket, []) if inbox is not None else []
        if not notices:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            notices = client.take_landed(left_ms)
        hits: list[tuple[bytes, int, list[int]]] = []
        for notice in notices:
            if notice.ticket != ticket:
                if inbox is not None:
                    inbox.setdefault(notice.ticket, []).append(notice)
                continue
            failed = waiting.intersection(notice.failed)
            if failed:
                raise RuntimeError(f"cold load missed: {len(failed)} keys failed to land")
            for key, slot, digests in zip(notice.keys, notice.slots, notice.checksums, strict=True):
                if key in waiting:
                    waiting.discard(key)
                    hits.append((key, slot, digests))
            over = over or notice.final
        done |= copy(hits)
    if waiting:
        client.complete_load(req, sorted(waiting), wait=False)
    return done


def latency(
    block_bytes: int, rounds: int, prefix_blocks: int, wait_ms: int, disk: bool = True
) -> dict:
    """One-block store and load through the engine-side copy path (completion sent without
    waiting for its reply, and awaited) and through device jobs, and, with ``disk``, cold loads
    from the disk tier (one block, and a ``prefix_blocks``-block prefix) with lookups held by
    the manager (``wait_ms``) and polled, next to a bare ZeroMQ round trip over the same
    transport (back to back, every thread hot, and one per round interleaved with the other
    variants, so its threads wake from idle as a service call's do) and a copy of one block.
    Every variant runs in each round, interleaved. p50/p99 in microseconds. Without ``disk`` the service has the host pool only, so no cascade to disk
    follows a store."""
    modes = {"held": wait_ms, "polled": 0}
    cold_keys = {
        mode: [keys_for(f"cold-{mode}-{r}", 1 + prefix_blocks) for r in range(rounds)]
        for mode in modes
    }
    num_slots = 2 * rounds * (1 + prefix_blocks) + 4 * rounds + 64
    result: dict[str, Any] = {"block_bytes": block_bytes, "rounds": rounds, "disk_tier": disk}
    if disk:
        result["wait_ms"] = wait_ms
    with bench_service(block_bytes, num_slots, disk=disk) as service:
        client = service.client("bench", timeout_s=60.0)
        info = client.info
        pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
        rng = np.random.default_rng(2)
        rows = rng.integers(0, 256, size=(1 + prefix_blocks, block_bytes), dtype=np.uint8)
        out = np.zeros_like(rows)
        kv = SharedKVCache.create(unique_kv_name(), 2, [block_bytes])
        kv.tensors[0][0] = rows[0]
        client.register_kv(kv.handle("bench"))
        client.new_request("lat")
        frame = p.encode(p.Lookup(rid=1, req_id="lat", keys=keys_for("rtt", 1), pin=True))
        result["bare_zmq_rtt"] = bare_zmq_rtt(frame, max(rounds, 200))
        echo = EchoServer()
        samples: dict[str, list[float]] = {}

        def timed(name: str, action: Callable[..., object], *args: Any) -> None:
            t0 = time.perf_counter()
            action(*args)
            samples.setdefault(name, []).append(time.perf_counter() - t0)

        for r in range(rounds):
            for wait, suffix in ((False, ""), (True, "_awaited")):
                key = keys_for(f"warm{suffix}{r}", 1)
                timed(
                    f"engine_store{suffix}", engine_store, client, "lat", key, pool, rows[:1], wait
                )
                timed(
                    f"engine_load{suffix}", engine_load, client, "lat", key, pool, out[:1], 0, wait
                )
                assert np.array_equal(out[0], rows[0])
            timed("copy", np.copyto, out[0], rows[0])
            samples.setdefault("bare_zmq_rtt_interleaved", []).append(echo.round_trip(frame))
            key = keys_for(f"dev{r}", 1)
            timed("device_store", device_job, client, client.store, key, 0)
            timed("device_load", device_job, client, client.load, key, 1)
        lookups: dict[str, list[int]] = {}
        if disk:
            for mode in modes:
                for keys in cold_keys[mode]:
                    engine_store(client, "lat", keys, pool, rows)
            client.reset_cache()  # every cascade lands on disk first; the host pool is emptied
        for r in range(rounds if disk else 0):
            for mode, mode_wait_ms in modes.items():
                keys = cold_keys[mode][r]
                for name, part, dst in (
                    (f"cold_1_{mode}", keys[:1], out[:1]),
                    (f"cold_{prefix_blocks}_{mode}", keys[1:], out[1:]),
                ):
                    dst[:] = 0
                    t0 = time.perf_counter()
                    count = engine_load(client, "lat", part, pool, dst, mode_wait_ms)
                    samples.setdefault(name, []).append(time.perf_counter() - t0)
                    lookups.setdefault(name, []).append(count)
                assert np.array_equal(out, rows), "a cold load returned wrong bytes"
        echo.close()
        rtt = result["bare_zmq_rtt"]["p50_us"]
        interleaved_rtt = percentiles(samples["bare_zmq_rtt_interleaved"])["p50_us"]
        for name, values in samples.items():
            entry = percentiles(values)
            entry["over_bare_zmq_rtt"] = entry["p50_us"] / rtt
            entry["over_interleaved_zmq_rtt"] = entry["p50_us"] / interleaved_rtt
            if name in lookups:
                entry["lookups_p50"] = statistics.median(lookups[name])
            result[name] = entry
        copy_us = result["copy"]["p50_us"]
        for name in samples:
            if name.startswith(("engine_", "device_")):
                result[name]["rtts_beyond_copy"] = (result[name]["p50_us"] - copy_us) / rtt
        for size in (1, prefix_blocks) if disk else ():
            held, polled = result[f"cold_{size}_held"], result[f"cold_{size}_polled"]
            held["polled_over_held_p50"] = polled["p50_us"] / held["p50_us"]
        client.finish_request("lat")
        client.close()
        pool.close()
        kv.close()
        kv.unlink()
    return result


_slot_headers = True
"""``pool.slot_headers`` of every service this benchmark starts (``--no-slot-headers``)."""


def bench_service(block_bytes: int, num_slots: int, disk: bool = False) -> ServiceHarness:
    """A (not yet started) service with the host pool and the cpu worker (and the disk tier
    when ``disk``; the object tier is off) in a temp directory, on the config's defaults."""
    sections = {
        "service": {"log_level": "warning"},
        "pool": {"block_bytes": block_bytes, "num_slots": num_slots, "slot_headers": _slot_headers},
        "disk": {"enabled": disk},
    }
    return ServiceHarness(None, sections, defaults={}, watch=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--out", default="results/bench_service.json")
    parser.add_argument(
        "--no-slot-headers", action="store_true", help="measure with pool.slot_headers = false"
    )
    parser.add_argument(
        "--only", choices=SECTIONS, action="append", help="run only these sections (repeatable)"
    )
    parser.add_argument("--latency-rounds", type=int, default=40)
    parser.add_argument("--latency-block-kib", type=int, default=256)
    parser.add_argument("--prefix-blocks", type=int, default=16)
    parser.add_argument(
        "--wait-ms",
        type=int,
        default=1000,
        help="how long a cold load's lookup may be held by the manager (0: poll without waiting)",
    )
    args = parser.parse_args()
    global _slot_headers
    _slot_headers = not args.no_slot_headers
    configure_logging("bench", "warning")
    sections = args.only or list(SECTIONS)
    result: dict[str, Any] = {"slot_headers": _slot_headers}
    if "control" in sections:
        with bench_service(65536, 2048) as service:
            client = service.client("bench", timeout_s=60.0)
            kv = SharedKVCache.create(unique_kv_name(), 64, [65536])
            client.register_kv(kv.handle("bench"))
            result["control_plane"] = control_plane(client, args.rounds)
            client.close()
            kv.close()
            kv.unlink()
    if "latency" in sections:
        for disk, name in ((True, "latency"), (False, "latency_host_only")):
            result[name] = latency(
                args.latency_block_kib << 10,
                args.latency_rounds,
                args.prefix_blocks,
                args.wait_ms,
                disk,
            )
    if "data" in sections:
        result["data_plane"] = data_plane([65536, 262144, 1 << 20, 4 << 20], args.total_mib << 20)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
