"""``kvoffload bench gpu``: kvoffload's CUDA paths checked and measured on a machine with an
NVIDIA GPU, in one command that needs no network and no vLLM (JSON out, table printed).

Checks (``checks`` in the JSON; the command exits 1 when one fails):
- ``register``: a host pool of ``--register-gib`` GiB is page-locked with ``cudaHostRegister``
  (``HostPool.register_cuda``; torch sees it as pinned); the time to create and to register it;
- ``vllm_worker``: the vLLM worker's copy routines (``KVOffloadWorker``, batched through
  ``kvoffload.memory.cudacopy``) on CUDA tensors, both ways, bit-exact, with the checksums of
  the stored slots; a load's verification runs when its copy completed (a corrupted slot fails
  its key then, not at submission); an expedited load; a layout of two groups, two blocks per
  chunk and rank 1 of 2 (a region of the slot, not all of it);
- ``cpu_worker``: the cpu worker's CUDA-IPC copies (a real service; this process shares its
  CUDA tensors with the worker process), both ways, bit-exact.

Measured at ``--sizes`` (pool block bytes; default 256 KiB, 2 MiB and 8 MiB, ``--mib`` MiB per
transfer): GB/s host->GPU (load) and GPU->host (store) through the vLLM worker (submit + wait,
without the checksums) and through the cpu worker (service jobs), against a plain pinned-memory
``torch`` copy of the same bytes in the same run (one ``copy_`` of one contiguous span).

Without CUDA it prints why it skipped, writes ``{"skipped": reason}`` and exits 0. Without vLLM
(a bare CUDA image) the vLLM worker runs on stand-ins of the five vLLM classes it imports
(``vllm_stand_ins``); where vLLM is installed its own classes are used.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import mmap
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIZES = (256 << 10, 2 << 20, 8 << 20)
TENSORS = 32  # KV tensors of the vLLM worker's model: one page of each per block


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def cuda_missing() -> str | None:
    """Why the GPU checks cannot run here (None: they can). Cheap: asks libcuda first."""
    from kvoffload.memory.cuda_host import cuda_device_count

    if cuda_device_count() == 0:
        return "no CUDA device visible to this process (libcuda finds none)"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (a CPU build?)"
    return None


# ---- vLLM stand-ins ---------------------------------------------------------------------------


def vllm_stand_ins() -> dict[str, types.ModuleType]:
    """Modules ``vllm``, ``vllm.v1``, ``vllm.v1.kv_offload`` and ``vllm.v1.kv_offload.base``
    with the five classes the vLLM worker imports (fields and constructors as vLLM's), for a
    machine without vLLM. Only ``install_vllm_stand_ins`` puts them in ``sys.modules``."""
    from abc import ABC, abstractmethod
    from collections.abc import Sequence

    import numpy as np

    base = types.ModuleType("vllm.v1.kv_offload.base")

    class LoadStoreSpec:
        pass

    class GPULoadStoreSpec(LoadStoreSpec):
        def __init__(
            self, block_ids: list[int], group_sizes: Sequence[int], block_indices: Sequence[int]
        ) -> None:
            self.block_ids = np.array(block_ids, dtype=np.int32)
            assert sum(group_sizes) == len(block_ids)
            assert len(block_indices) == len(group_sizes)
            self.group_sizes = group_sizes
            self.block_indices = block_indices

    @dataclass
    class CanonicalKVCacheTensor:
        tensor: Any
        page_size_bytes: int

    @dataclass
    class CanonicalKVCacheRef:
        tensor_idx: int
        page_size_bytes: int
        mapping: Any = None

    @dataclass
    class CanonicalKVCaches:
        tensors: list[CanonicalKVCacheTensor]
        group_data_refs: list[list[CanonicalKVCacheRef]]

    @dataclass
    class TransferResult:
        job_id: int
        success: bool
        transfer_size: int | None = None
        transfer_time: float | None = None

    class OffloadingWorker(ABC):
        @abstractmethod
        def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool: ...

        @abstractmethod
        def submit_load(
            self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
        ) -> bool: ...

        @abstractmethod
        def get_finished(self) -> list[Any]: ...

        @abstractmethod
        def wait(self, job_ids: set[int]) -> None: ...

        def shutdown(self) -> None:
            return

    for cls in (
        LoadStoreSpec,
        GPULoadStoreSpec,
        CanonicalKVCacheTensor,
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        TransferResult,
        OffloadingWorker,
    ):
        cls.__module__ = base.__name__
        setattr(base, cls.__name__, cls)
    modules = {name: types.ModuleType(name) for name in ("vllm", "vllm.v1", "vllm.v1.kv_offload")}
    modules["vllm.v1.kv_offload.base"] = base
    modules["vllm"].__path__ = []  # a package, for its submodules
    return modules


def install_vllm_stand_ins() -> bool:
    """Install the stand-ins when vLLM is not installed; True when it did."""
    if importlib.util.find_spec("vllm") is not None:
        return False
    sys.modules.update(vllm_stand_ins())
    return True


# ---- measurements ---------------------------------------------------------------------------


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up run."""
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def torch_pinned_copy(nbytes: int, reps: int, device: Any) -> dict[str, float]:
    """The reference: one ``copy_`` of ``nbytes`` between pinned host memory and the GPU."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def h2d() -> None:
        gpu.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)

    def d2h() -> None:
        host.copy_(gpu, non_blocking=True)
        torch.cuda.synchronize(device)

    return {"h2d_gbps": gbps(nbytes, timed(h2d, reps)), "d2h_gbps": gbps(nbytes, timed(d2h, reps))}


@contextlib.contextmanager
def host_pool(num_slots: int, block_bytes: int) -> Iterator[Any]:
    from kvoffload.memory.pool import HostPool

    pool = HostPool.create(f"/kvoffload-bench-gpu-{os.getpid()}", num_slots, block_bytes)
    try:
        yield pool
    finally:
        pool.close()
        pool.unlink()


def register_check(gib: float) -> dict[str, Any]:
    """Create a pool of ``gib`` GiB in shared memory and register it with CUDA; without room
    for it in /dev/shm, an anonymous mapping of that size instead (what cudaHostRegister
    costs does not depend on the kind of mapping)."""
    import torch

    from kvoffload.memory.cuda_host import register_host_memory, unregister_host_memory

    block = 2 << 20
    slots = int(gib * (1 << 30)) // block
    out: dict[str, Any] = {"bytes": slots * block}
    start = time.perf_counter()
    try:
        with host_pool(slots, block) as pool:
            out["create_s"] = time.perf_counter() - start
            out["memory"] = "posix shared memory (HostPool)"
            start = time.perf_counter()
            registered = pool.register_cuda()
            out["register_s"] = time.perf_counter() - start
            view = torch.from_numpy(pool.as_numpy())
            out["pinned"] = bool(view.is_pinned())
            out["ok"] = registered and out["pinned"]
            return out
    except OSError as exc:
        out["shm_error"] = repr(exc)
    mapping = mmap.mmap(-1, slots * block)
    try:
        view = torch.frombuffer(mapping, dtype=torch.uint8)
        address = view.data_ptr()
        out["create_s"] = time.perf_counter() - start
        out["memory"] = "anonymous mapping (/dev/shm too small for the pool)"
        start = time.perf_counter()
        registered = register_host_memory(address, slots * block)
        out["register_s"] = time.perf_counter() - start
        out["pinned"] = bool(view.is_pinned())
        out["ok"] = registered and out["pinned"]
        if registered:
            unregister_host_memory(address)
        del view
    finally:
        with contextlib.suppress(BufferError):
            mapping.close()
    return out


def random_tensors(count: int, blocks: int, page: int, device: Any, seed: int) -> list[Any]:
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.randint(-128, 128, (blocks, page), dtype=torch.int8, device=device, generator=gen)
        for _ in range(count)
    ]


def vllm_worker_run(
    block_bytes: int, mib: int, reps: int, device: Any, tensors: int = TENSORS
) -> dict[str, Any]:
    """The vLLM worker at one block size: bit-exact store and load of every block with the
    checksums, a corrupted slot failing its key when the load's copy completed, an expedited
    load, and store/load GB/s (without checksums)."""
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )

    from kvoffload.integrations.vllm.blocks import PoolBlocks
    from kvoffload.integrations.vllm.layout import BlockLayout
    from kvoffload.integrations.vllm.worker import KVOffloadWorker
    from kvoffload.memory.blockformat import payload_checksum

    page = block_bytes // tensors
    count = max(2, (mib << 20) // block_bytes)
    src = random_tensors(tensors, 2 * count, page, device, seed=block_bytes)
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, page) for t in src],
        [[CanonicalKVCacheRef(i, page) for i in range(tensors)]],
    )
    layout = BlockLayout(((page,) * tensors,), 1, 0, 1)
    out: dict[str, Any] = {"block_bytes": block_bytes, "blocks": count, "tensors": tensors}
    problems: list[str] = []
    checked = KVOffloadWorker(caches, layout, verify_loads=True)
    fast = KVOffloadWorker(caches, layout, verify_loads=False)
    job = iter(range(1, 1 << 30))

    def spec(pool: Any, keys: list[bytes], slots: list[int]) -> PoolBlocks:
        return PoolBlocks(
            "bench", pool.name, pool.num_slots, pool.block_bytes, keys, slots, os.getpid()
        )

    def gpu(blocks: list[int]) -> GPULoadStoreSpec:
        return GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])

    def expect(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    with host_pool(count, block_bytes) as pool:
        host = torch.from_numpy(pool.as_numpy()).view(torch.int8)
        keys = [b"key%08d" % i + b"." * 8 for i in range(count)]
        # Scattered slots (every run of consecutive slots one long) and blocks.
        slots = [(i * 7919) % count for i in range(count)] if count % 7919 else list(range(count))
        blocks = list(range(count))
        j = next(job)
        checked.submit_store(j, gpu(blocks), spec(pool, keys, slots))
        checked.wait({j})
        finished = checked.get_finished()
        sums = checked.take_report().store_checksums
        expect([r.job_id for r in finished] == [j] and finished[0].success, "store not reported")
        want = torch.cat([t[:count] for t in src], dim=1).cpu()
        got = host[slots]
        expect(torch.equal(got, want), "store: the pool slots differ from the KV blocks")
        expect(
            sums
            == {
                k: {0: payload_checksum(pool.slot_array(s))}
                for k, s in zip(keys, slots, strict=True)
            },
            "store: the reported checksums differ from the slots'",
        )
        load_spec = spec(pool, keys, slots)
        load_spec.checksums = [[sums[k][0]] if k in sums else [] for k in keys]
        bad = count // 2
        pool.slot_array(slots[bad])[3] ^= 0x5A  # one slot changes after it was written
        j = next(job)
        start = time.perf_counter()
        checked.submit_load(j, load_spec, gpu(list(range(count, 2 * count))))
        out["load_submit_ms"] = (time.perf_counter() - start) * 1e3
        early = checked.take_error_blocks()
        checked.wait({j})
        out["load_complete_ms"] = (time.perf_counter() - start) * 1e3
        checked.get_finished()  # runs the load's checks
        late = checked.take_error_blocks()
        if device.type == "cuda":  # on CPU the copy, and so its check, is done at submission
            expect(not early, "load: a failure was known before the copy completed (blocking)")
            late = early | late
        else:
            late = early | late
        expect(late == {count + bad}, f"load: failed blocks {sorted(late)}, want [{count + bad}]")
        expect(
            checked.take_report().failed_loads == {"bench": [keys[bad]]},
            "load: the corrupted key was not reported",
        )
        good = [i for i in range(count) if i != bad]
        expect(
            all(torch.equal(t[count:][good], t[:count][good]) for t in src),
            "load: the KV blocks differ from the stored ones",
        )
        pool.slot_array(slots[bad])[3] ^= 0x5A
        for t in src:
            t[count:].zero_()
        j = next(job)
        fast.submit_load(
            j, spec(pool, keys, slots), gpu(list(range(count, 2 * count))), expedited=True
        )
        fast.wait({j})
        fast.get_finished()
        expect(all(torch.equal(t[count:], t[:count]) for t in src), "expedited load: blocks differ")

        store_spec, load_gpu = spec(pool, keys, slots), gpu(list(range(count, 2 * count)))

        def store() -> None:
            j = next(job)
            fast.submit_store(j, gpu(blocks), store_spec)
            fast.wait({j})

        def load() -> None:
            j = next(job)
            fast.submit_load(j, store_spec, load_gpu)
            fast.wait({j})

        nbytes = count * block_bytes
        out["d2h_gbps"] = gbps(nbytes, timed(store, reps))
        out["h2d_gbps"] = gbps(nbytes, timed(load, reps))
        fast.get_finished()
        sequential = spec(pool, keys, list(range(count)))

        def store_sequential() -> None:
            j = next(job)
            fast.submit_store(j, gpu(blocks), sequential)
            fast.wait({j})

        out["d2h_sequential_slots_gbps"] = gbps(nbytes, timed(store_sequential, reps))
        fast.get_finished()
        checked.shutdown()
        fast.shutdown()
    out["problems"] = problems
    out["ok"] = not problems
    return out


def vllm_layout_check(device: Any) -> dict[str, Any]:
    """Two groups (a sliding window over two tensors, full attention over one), two blocks per
    chunk, rank 1 of 2: each rank's region of a slot, a load from the middle of a chunk."""
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )

    from kvoffload.integrations.vllm.blocks import PoolBlocks
    from kvoffload.integrations.vllm.layout import BlockLayout
    from kvoffload.integrations.vllm.worker import KVOffloadWorker

    page = 16 << 10

    def caches(seed: int) -> Any:
        tensors = random_tensors(2, 16, page, device, seed)
        return CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, page) for t in tensors],
            [
                [CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)],
                [CanonicalKVCacheRef(0, page)],
            ],
        )

    problems = []
    with host_pool(8, 2 * 2 * 2 * page) as pool:
        layouts = [BlockLayout(((page, page), (page,)), 2, r, 2) for r in range(2)]
        src = [caches(seed=r) for r in range(2)]
        keys = [b"s%d" % i * 8 for i in range(2)] + [b"f%d" % i * 8 for i in range(2)]
        store = GPULoadStoreSpec([3, 4, 5, 6, 1, 2, 8, 9], group_sizes=[4, 4], block_indices=[4, 0])
        for rank in range(2):
            w = KVOffloadWorker(src[rank], layouts[rank])
            w.submit_store(
                1,
                store,
                PoolBlocks("r", pool.name, 8, pool.block_bytes, keys, [0, 1, 2, 3], os.getpid()),
            )
            w.wait({1})
            w.get_finished()
            w.shutdown()
        load = GPULoadStoreSpec([10, 7, 8, 9], group_sizes=[1, 3], block_indices=[5, 1])
        for rank in range(2):
            dst = caches(seed=10 + rank)
            w = KVOffloadWorker(dst, layouts[rank])
            w.submit_load(
                2,
                PoolBlocks(
                    "r",
                    pool.name,
                    8,
                    pool.block_bytes,
                    [keys[1], keys[2], keys[3]],
                    [1, 2, 3],
                    os.getpid(),
                ),
                load,
            )
            w.wait({2})
            w.get_finished()
            w.shutdown()
            s = [t.tensor for t in src[rank].tensors]
            d = [t.tensor for t in dst.tensors]
            if not all(torch.equal(d[i][10], s[i][6]) for i in range(2)):
                problems.append(f"rank {rank}: the sliding group's block differs")
            if not all(torch.equal(d[0][a], s[0][b]) for a, b in ((7, 2), (8, 8), (9, 9))):
                problems.append(f"rank {rank}: the full group's blocks differ")
    return {"ok": not problems, "problems": problems}


def cpu_worker_run(block_bytes: int, mib: int, reps: int, device: Any) -> dict[str, Any]:
    """The cpu worker's CUDA-IPC copies through a real service: store every block to the pool
    and load it into other blocks, bit-exact; store/load GB/s (jobs, waited for)."""
    import torch

    from kvoffload.memory.kvcache import cuda_kv_handle
    from kvoffload.memory.pool import HostPool
    from kvoffload.testing.service import ServiceHarness

    count = max(2, (mib << 20) // block_bytes)
    tensors = 4
    rows = random_tensors(tensors, 2 * count, block_bytes // tensors, device, seed=7)
    sections = {
        "service": {"log_level": "warning"},
        # without slot headers: a store is then the copy alone (with them the worker also
        # hashes every stored slot, the cost the cpu suite measures)
        "pool": {"block_bytes": block_bytes, "num_slots": count + 8, "slot_headers": False},
        "disk": {"enabled": False},
        "cpu": {"threads": 2},
    }
    out: dict[str, Any] = {"block_bytes": block_bytes, "blocks": count}
    problems: list[str] = []
    with ServiceHarness(None, sections, defaults={}, watch=False) as service:  # started
        client = service.client("bench-gpu", timeout_s=120.0)
        info = client.info
        pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
        try:
            client.register_kv(cuda_kv_handle("gpu", rows))
            client.new_request("g")
            keys = [b"gpu%08d" % i + b"." * 8 for i in range(count)]
            torch.cuda.synchronize(device)
            job = client.store("g", keys, list(range(count)), "gpu")
            assert job.job_id is not None
            done = client.wait([job.job_id], timeout_s=120)[job.job_id]
            if not done.success:
                problems.append(f"store failed: {done.error}")
            lookup = client.lookup("g", keys, pin=True)
            slots = lookup.slots
            want = torch.cat([t[:count] for t in rows], dim=1).cpu()
            got = torch.from_numpy(pool.as_numpy()).view(torch.int8)[slots]
            if not torch.equal(got, want):
                problems.append("store: the pool slots differ from the CUDA blocks")
            client.complete_load("g", keys)
            job = client.load("g", keys, list(range(count, 2 * count)), "gpu")
            assert job.job_id is not None
            done = client.wait([job.job_id], timeout_s=120)[job.job_id]
            torch.cuda.synchronize(device)
            if not done.success or not all(torch.equal(t[count:], t[:count]) for t in rows):
                problems.append(f"load: the CUDA blocks differ from the pool's ({done.error})")
            rounds = iter(range(1 << 30))

            def load() -> None:
                j = client.load("g", keys, list(range(count, 2 * count)), "gpu")
                assert j.job_id is not None
                client.wait([j.job_id], timeout_s=120)

            def store() -> None:  # new keys each time: the pool evicts the older ones
                fresh = [b"r%06d-%08d" % (next(rounds), i) for i in range(count)]
                j = client.store("g", fresh, list(range(count)), "gpu")
                assert j.job_id is not None
                client.wait([j.job_id], timeout_s=120)

            nbytes = count * block_bytes
            out["h2d_gbps"] = gbps(nbytes, timed(load, reps))
            out["d2h_gbps"] = gbps(nbytes, timed(store, reps))
            client.finish_request("g")
        finally:
            pool.close()
            client.close()
    out["problems"] = problems
    out["ok"] = not problems
    return out


# ---- the command ----------------------------------------------------------------------------


def guarded(run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``run(*args)``; an exception becomes a failed check (the other checks still run)."""
    try:
        return run(*args)
    except Exception as exc:  # noqa: BLE001 - a check that fails in any way is reported, the others still run
        import traceback

        return {
            "ok": False,
            "problems": [f"{run.__name__} raised {exc!r}"],
            "traceback": traceback.format_exc(),
            "h2d_gbps": 0.0,
            "d2h_gbps": 0.0,
        }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    started = time.monotonic()
    device = torch.device("cuda", 0)
    stand_ins = install_vllm_stand_ins()
    report: dict[str, Any] = {
        "machine": {
            "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "vllm_classes": "stand-ins (vLLM not installed)" if stand_ins else "vLLM's own",
        },
        "sizes": list(args.sizes),
        "mib": args.mib,
        "checks": {},
        "results": [],
    }

    def step(what: str) -> None:
        print(f"  {what} ({time.monotonic() - started:.0f} s)", flush=True)

    report["checks"]["register"] = guarded(register_check, args.register_gib)
    step(f"registered {args.register_gib} GiB")
    report["checks"]["vllm_layout"] = guarded(vllm_layout_check, device)
    for size in args.sizes:
        row: dict[str, Any] = {"block_bytes": size}
        nbytes = max(2, (args.mib << 20) // size) * size
        row["torch"] = torch_pinned_copy(nbytes, args.reps, device)
        row["vllm_worker"] = guarded(vllm_worker_run, size, args.mib, args.reps, device)
        step(f"vLLM worker at {size >> 10} KiB")
        if not args.no_service:
            row["cpu_worker"] = guarded(cpu_worker_run, size, args.mib, args.reps, device)
            step(f"cpu worker at {size >> 10} KiB")
        report["results"].append(row)
        torch.cuda.empty_cache()
    for path in ("vllm_worker", "cpu_worker"):
        runs = [row[path] for row in report["results"] if path in row]
        if runs:
            report["checks"][path] = {
                "ok": all(r["ok"] for r in runs),
                "problems": [p for r in runs for p in r["problems"]],
            }
    report["ok"] = all(check["ok"] for check in report["checks"].values())
    report["seconds"] = time.monotonic() - started
    return report


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{'block':>8} {'path':>12} {'host->GPU GB/s':>15} {'GPU->host GB/s':>15} {'x torch':>14}"
    )
    for row in report["results"]:
        ref = row["torch"]
        for path in ("torch", "vllm_worker", "cpu_worker"):
            if path not in row:
                continue
            r = row[path]
            ratio = (
                ""
                if path == "torch"
                else f"{r['h2d_gbps'] / ref['h2d_gbps']:.2f} / {r['d2h_gbps'] / ref['d2h_gbps']:.2f}"
            )
            print(
                f"{row['block_bytes'] >> 10:>6}Ki {path:>12} {r['h2d_gbps']:>15.1f} "
                f"{r['d2h_gbps']:>15.1f} {ratio:>14}"
            )
    reg = report["checks"]["register"]
    print(
        f"register {reg.get('bytes', 0) / 2**30:.0f} GiB ({reg.get('memory')}): create "
        f"{reg.get('create_s', 0):.2f} s, cudaHostRegister {reg.get('register_s', 0):.2f} s"
    )
    for name, check in report["checks"].items():
        print(f"check {name}: {'ok' if check['ok'] else 'FAILED'} {check.get('problems') or ''}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=lambda s: [parse_size(x) for x in s.split(",")],
        default=list(SIZES),
        help="pool block sizes, comma-separated (256K,2M,8M)",
    )
    parser.add_argument("--mib", type=int, default=512, help="MiB per transfer")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument("--register-gib", type=float, default=16.0)
    parser.add_argument("--no-service", action="store_true", help="skip the cpu worker runs")
    parser.add_argument("--out", default="results/bench_gpu.json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    reason = cuda_missing()
    if reason is not None:
        print(f"bench gpu: skipped: {reason}")
        out.write_text(json.dumps({"skipped": reason}, indent=2) + "\n")
        return 0
    from kvoffload.logs import configure_logging

    configure_logging("bench", "warning")
    with tempfile.TemporaryDirectory(prefix="kvo-bench-gpu-"):
        report = bench(args)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(
        f"JSON in {out} ({report['seconds']:.0f} s): {'all checks ok' if report['ok'] else 'CHECKS FAILED'}"
    )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
