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
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import zmq

from kvoffload.client import KVOffloadClient
from kvoffload.config import load_config
from kvoffload.kvcache import SharedKVCache, unique_kv_name
from kvoffload.logs import configure_logging
from kvoffload.supervisor import Supervisor
from kvoffload.tiering import ReqContext, TieringManager


def percentiles(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "p50_us": statistics.median(ordered) * 1e6,
        "p99_us": ordered[int(len(ordered) * 0.99) - 1] * 1e6,
    }


def keys_for(n: int, salt: str) -> list[bytes]:
    return [f"{salt}-{i}".encode().ljust(32, b".") for i in range(n)]


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


def bare_zmq_rtt(frame: bytes, rounds: int) -> dict:
    """DEALER -> ROUTER echo in another process over ipc: the transport floor."""
    endpoint = f"ipc://{tempfile.mkdtemp()}/echo.sock"
    server = subprocess.Popen(
        [sys.executable, "-c", ECHO_SERVER, endpoint], stdout=subprocess.PIPE, text=True
    )
    server.stdout.readline()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dealer.send(frame)
        dealer.recv()
        samples.append(time.perf_counter() - t0)
    dealer.send(b"stop")
    server.wait(10)
    dealer.close(0)
    return percentiles(samples[10:])


def library_lookup(keys: list[bytes], rounds: int) -> dict:
    m = TieringManager(len(keys) + 16)
    m.on_new_request(ReqContext("r"))
    out = m.prepare_store("r", keys)
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


def control_plane(client, kv, rounds: int) -> dict:
    result = {}
    for n in (1, 1000):
        keys = keys_for(n, f"cp{n}")
        req = f"cp-{n}"
        client.new_request(req)
        for i in range(0, n, 64):
            chunk = keys[i : i + 64]
            job = client.store(req, chunk, list(range(len(chunk))), "bench")
            if job.job_id is not None:
                client.wait([job.job_id])
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
    results = {}
    for block in block_sizes:
        n = max(4, min(2048, total_bytes // block))
        cfg_note = {"block_bytes": block, "blocks": n}
        with Service(block, n * 2 + 16) as service:
            client = service.client()
            kv = SharedKVCache.create(unique_kv_name(), n * 2, [block])
            rng = np.random.default_rng(1)
            kv.tensors[0][:] = rng.integers(0, 256, size=(2 * n, block), dtype=np.uint8)
            client.register_kv(kv.handle("bench"))
            client.new_request("dp")
            store_s, load_s = [], []
            for round_no in range(4):
                keys = keys_for(n, f"dp{block}-{round_no}")
                t0 = time.perf_counter()
                job = client.store("dp", keys, list(range(n)), "bench")
                client.wait([job.job_id], timeout_s=120)
                store_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                job = client.load("dp", keys, list(range(n, 2 * n)), "bench")
                done = client.wait([job.job_id], timeout_s=120)[job.job_id]
                load_s.append(time.perf_counter() - t0)
                assert done.success and np.array_equal(kv.tensors[0][:n], kv.tensors[0][n : 2 * n])
            cfg_note["first_round_store_s"], cfg_note["first_round_load_s"] = store_s[0], load_s[0]
            store_s, load_s = min(store_s[1:]), min(load_s[1:])
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


class Service:
    """A service with only the host pool and the cpu worker, in a temp runtime dir."""

    slot_headers = True

    def __init__(self, block_bytes: int, num_slots: int) -> None:
        self.tmp = tempfile.mkdtemp(prefix="kvb-")
        env = {
            "KVOFFLOAD_SERVICE__RUNTIME_DIR": self.tmp,
            "KVOFFLOAD_POOL__BLOCK_BYTES": str(block_bytes),
            "KVOFFLOAD_POOL__NUM_SLOTS": str(num_slots),
            "KVOFFLOAD_DISK__ENABLED": "false",
            "KVOFFLOAD_SERVICE__LOG_LEVEL": "warning",
            "KVOFFLOAD_POOL__SLOT_HEADERS": str(self.slot_headers).lower(),
        }
        self.supervisor = Supervisor(
            load_config(None, env), log_path=Path(self.tmp) / "service.log"
        )

    def __enter__(self) -> Service:
        self.spec = self.supervisor.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with KVOffloadClient(self.spec.client_endpoint, timeout_s=2.0) as c:
                    if "cpu" in c.status().workers:
                        return self
            except TimeoutError:
                pass
            time.sleep(0.1)
        raise TimeoutError("service did not start")

    def client(self) -> KVOffloadClient:
        return KVOffloadClient(self.spec.client_endpoint, timeout_s=60.0, name="bench")

    def __exit__(self, *exc) -> None:
        self.supervisor.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--out", default="results/bench_service.json")
    parser.add_argument(
        "--no-slot-headers", action="store_true", help="measure with pool.slot_headers = false"
    )
    args = parser.parse_args()
    Service.slot_headers = not args.no_slot_headers
    configure_logging("bench", "warning")
    with Service(65536, 2048) as service:
        client = service.client()
        kv = SharedKVCache.create(unique_kv_name(), 64, [65536])
        client.register_kv(kv.handle("bench"))
        control = control_plane(client, kv, args.rounds)
        client.close()
        kv.close()
        kv.unlink()
    data = data_plane([65536, 262144, 1 << 20, 4 << 20], args.total_mib << 20)
    result = {"slot_headers": Service.slot_headers, "control_plane": control, "data_plane": data}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
