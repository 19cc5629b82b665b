"""The cpu worker: copies KV blocks between an engine's KV cache and host-pool slots.

Jobs: ``device_store`` (device block ``device_blocks[i]`` of KV cache ``handle_id`` -> pool slot
``slots[i]``) and ``device_load`` (slot -> device block). A block's bytes in a slot are the
concatenation, in tensor order, of each tensor's row for that block.

KV caches arrive with ``AttachKV``:
- ``shm``: the engine's ``SharedKVCache`` segment is mapped; rows are copied straight between
  the engine's row and the slot (no staging buffer) by the backend's ``SlotCopier``: a job's
  blocks are cut into parts that every copy thread takes from one queue, loads first, at most
  ``cpu.threads`` at once over all jobs. The worker's glibc streams large copies to memory
  (non-temporal stores, ``kvoffload.runtime.childenv``).
- ``cuda_ipc``: the CUDA tensors are opened through CUDA IPC and copied on a stream per job
  thread, batched (``kvoffload.memory.cudacopy``: per tensor one gather or scatter through a
  staging buffer on the GPU, one DMA per run of consecutive slots), a job's keys cut into
  parts run by the copier's threads, each synchronized before the job's outcome is returned.
  Only a worker
  that sees a CUDA device (asked through libcuda at start, without torch) advertises
  ``cuda_ipc`` in its hello; any other refuses such a handle at once. The opening (importing
  torch, opening the IPC memory, registering the pool with ``cudaHostRegister``) runs on a
  thread of its own, never on the main loop that heartbeats; jobs for the handle wait for it.

Each job holds a reference on its KV cache; the job's release drops it. ``DetachKV`` unmaps a
cache once no job holds it.

Slot headers (when on): a ``device_store`` stamps each slot it copied (xxh3 of the slot,
generation = job id) after the copies are complete and before the result. From a ``shm``
cache the xxh3 is taken during the copy, each chunk of the engine's row right after it was
copied, while it is in cache (``Hashed.SOURCE``: no second pass over the slot); from CUDA it
is computed from the slot once the part's stream is synchronized, by the same thread.
A ``verify`` job (keys + slots, from a restarted manager) recomputes each slot's xxh3 and
compares it with the slot's header; its ok keys are the slots that match.

Run: ``python -m workers.cpu --spec RUNSPEC_JSON``.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import msgspec
import numpy as np

from kvoffload.config import Config
from kvoffload.logs import get_logger
from kvoffload.memory.blockformat import BlockChecksum, payload_checksum
from kvoffload.memory.cuda_host import cuda_device_count
from kvoffload.memory.kvcache import SharedKVCache, rebuild_cuda_ipc_tensor
from kvoffload.memory.pool import HostPool
from kvoffload.memory.slotcopy import Hashed, SlotCopier
from kvoffload.wire.protocol import HandleKind, Job, JobKind, KVHandle
from kvoffload.wire.status import CpuWorkerStats
from workers.backend import AttachRefused, BackendOutcome, NoIndexBackend
from workers.faults import FaultInjector
from workers.framework import worker_main
from workers.slotheaders import SlotHeaders

log = get_logger()

UNKNOWN_HANDLE = "unknown_handle"
CUDA_OPEN_TIMEOUT_S = 120.0
"""How long a job waits for its cuda_ipc handle to be opened (the first one imports torch)."""


class _AttachedKV:
    """One attached KV cache: copies of a job's blocks to and from pool slots, plus the count
    of jobs holding it. Subclasses implement ``transfer``; ``close`` unmaps."""

    def __init__(self, handle: KVHandle) -> None:
        self.handle_id = handle.handle_id
        self.num_blocks = handle.num_blocks
        self.row_bytes = [t.row_bytes for t in handle.tensors]
        self.holders = 0
        self.detached = False

    def transfer(
        self, blocks: list[int], slots: list[int], store: bool, hashed: bool
    ) -> list[int] | None:
        """Copy device block ``blocks[i]`` to (``store``) or from pool slot ``slots[i]`` for
        every ``i``, complete when this returns; with ``hashed`` (stores only) return each
        slot's xxh3, else None. Raises when the copies could not all be done."""
        raise NotImplementedError

    def wait_ready(self) -> None:
        """Return once copies can start; raise AttachRefused when they never can."""

    def close(self) -> None:
        raise NotImplementedError


class _ShmKV(_AttachedKV):
    def __init__(self, handle: KVHandle, pool: HostPool, copier: SlotCopier) -> None:
        super().__init__(handle)
        self._cache = SharedKVCache.attach(handle)
        self._copier = copier
        # (device rows, the same tensor's column range in every pool slot), per tensor
        slots = pool.as_numpy()
        self._pairs: list[tuple[np.ndarray, np.ndarray]] = []
        offset = 0
        for rows, size in zip(self._cache.tensors, self.row_bytes, strict=True):
            self._pairs.append((rows, slots[:, offset : offset + size]))
            offset += size

    def transfer(
        self, blocks: list[int], slots: list[int], store: bool, hashed: bool
    ) -> list[int] | None:
        pairs = self._pairs
        if hashed:
            segments = [
                [(parts[slot], rows[block]) for rows, parts in pairs]
                for block, slot in zip(blocks, slots, strict=True)
            ]
            return self._copier.copy_blocks(segments, Hashed.SOURCE)
        if store:
            flat = [
                (parts[slot], rows[block])
                for block, slot in zip(blocks, slots, strict=True)
                for rows, parts in pairs
            ]
        else:
            flat = [
                (rows[block], parts[slot])
                for block, slot in zip(blocks, slots, strict=True)
                for rows, parts in pairs
            ]
        self._copier.copy(flat, urgent=not store)
        return None

    def close(self) -> None:
        self._pairs = []
        self._cache.close()


class _CudaKV(_AttachedKV):
    """CUDA tensors opened from IPC handles on a daemon thread of their own (``wait_ready``
    joins it); a job's keys are cut into parts, each copied through the stream of the thread
    that runs it (``streams``: one per thread) and synchronized there."""

    def __init__(
        self, handle: KVHandle, pool: HostPool, streams: threading.local, copier: SlotCopier
    ) -> None:
        super().__init__(handle)
        self._streams = streams
        self._copier = copier
        self._lock = threading.Lock()
        self._closed = False
        self._torch: Any = None
        self._device: Any = None
        self._pool: Any = None
        self._host: np.ndarray = pool.as_numpy()
        self._rows: list[Any] = []
        self._opened: Future = Future()
        self._opened.set_running_or_notify_cancel()
        threading.Thread(
            target=self._open, args=(handle, pool), name=f"kv-open-{handle.handle_id}", daemon=True
        ).start()

    def _open(self, handle: KVHandle, pool: HostPool) -> None:
        try:
            torch, rows = self._open_tensors(handle, pool)
        except Exception as exc:  # noqa: BLE001 - a handle that cannot open is refused, typed
            if not isinstance(exc, AttachRefused):
                exc = AttachRefused(f"handle {handle.handle_id}: {exc!r}")
            log.error(
                "kv_attach_refused", handle_id=handle.handle_id, kind=handle.kind, error=str(exc)
            )
            self._opened.set_exception(exc)
            return
        with self._lock:
            if not self._closed:  # a cache detached while opening keeps nothing open
                self._torch, self._device, self._rows = torch, rows[0].device, rows
                self._pool = torch.from_numpy(pool.as_numpy())
        log.info("kv_cuda_opened", handle_id=handle.handle_id, device=str(rows[0].device))
        self._opened.set_result(None)

    def _open_tensors(self, handle: KVHandle, pool: HostPool) -> tuple[Any, list[Any]]:
        """(torch, each tensor's rows as a uint8 CUDA tensor of shape (num_blocks, row_bytes))."""
        import torch

        if not torch.cuda.is_available():
            raise AttachRefused("a cuda_ipc handle needs a CUDA device in the cpu worker")
        rows = []
        for j, spec in enumerate(handle.tensors):
            if spec.ipc is None:
                raise AttachRefused(f"tensor {j} has no ipc fields")
            tensor = rebuild_cuda_ipc_tensor(spec.ipc)
            if not tensor.is_contiguous() or int(tensor.shape[0]) != self.num_blocks:
                raise AttachRefused(
                    f"tensor {j} is not contiguous with {self.num_blocks} blocks first"
                )
            row = tensor.reshape(self.num_blocks, -1).view(torch.uint8)
            if row.shape[1] != spec.row_bytes:
                raise AttachRefused(
                    f"tensor {j} rows are {row.shape[1]} bytes, handle says {spec.row_bytes}"
                )
            rows.append(row)
        if not pool.register_cuda():
            log.warning("pool_not_cuda_registered", pool=pool.name)
        return torch, rows

    def wait_ready(self) -> None:
        try:
            self._opened.result(timeout=CUDA_OPEN_TIMEOUT_S)
        except TimeoutError:
            raise AttachRefused(
                f"handle {self.handle_id} was not opened within {CUDA_OPEN_TIMEOUT_S} s"
            ) from None

    def _stream(self) -> Any:
        streams = getattr(self._streams, "by_device", None)
        if streams is None:
            streams = self._streams.by_device = {}
        stream = streams.get(self._device)
        if stream is None:
            stream = streams[self._device] = self._torch.cuda.Stream(device=self._device)
        return stream

    def transfer(
        self, blocks: list[int], slots: list[int], store: bool, hashed: bool
    ) -> list[int] | None:
        count = len(blocks)
        shares = [range(count)]
        if count >= 2 and self._copier.threads > 1:
            parts = min(self._copier.threads, count)
            shares = [range(count * i // parts, count * (i + 1) // parts) for i in range(parts)]
        work = [
            functools.partial(self._copy_share, blocks, slots, s, store, hashed) for s in shares
        ]
        sums = self._copier.run(work, urgent=not store)
        return sums if hashed else None

    def _copy_share(
        self, blocks: list[int], slots: list[int], share: range, store: bool, hashed: bool
    ) -> list[int]:
        """Copy keys ``share`` on this thread's stream, synchronize it, and return the xxh3 of
        each copied slot when ``hashed``."""
        from kvoffload.memory.cudacopy import Part, SlotRegion, copy_slots  # imports torch

        mine_blocks = [blocks[i] for i in share]
        mine_slots = [slots[i] for i in share]
        parts, offset = [], 0
        for rows, size in zip(self._rows, self.row_bytes, strict=True):
            parts.append(Part(rows, mine_blocks, range(len(mine_blocks)), offset, size))
            offset += size
        region = SlotRegion(0, offset, offset)
        stream = self._stream()
        with self._torch.cuda.stream(stream):
            copy_slots(self._pool, mine_slots, region, parts, store, self._stage())
        stream.synchronize()
        return [payload_checksum(self._host[slot]) for slot in mine_slots] if hashed else []

    def _stage(self) -> Any:
        """This thread's staging buffer on the tensors' device (``cudacopy.StageBuffer``)."""
        from kvoffload.memory.cudacopy import StageBuffer

        stages = getattr(self._streams, "stages", None)
        if stages is None:
            stages = self._streams.stages = {}
        stage = stages.get(self._device)
        if stage is None:
            stage = stages[self._device] = StageBuffer(self._device)
        return stage

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._rows = []
            self._pool = None


class CpuBackend(NoIndexBackend):
    """The cpu worker's backend (see the module docstring). No index, no eviction."""

    name = "cpu"
    medium = "device"

    def __init__(self, cfg: Config | None = None) -> None:
        self.capabilities = [
            JobKind.DEVICE_STORE,
            JobKind.DEVICE_LOAD,
            JobKind.VERIFY,
            HandleKind.SHM,
        ]
        if importlib.util.find_spec("torch") is not None and cuda_device_count() > 0:
            self.capabilities.append(HandleKind.CUDA_IPC)
        self.degraded = False
        self._pool: HostPool | None = None
        self._headers: SlotHeaders | None = None
        self._faults = FaultInjector()
        self._lock = threading.Lock()
        self._handles: dict[str, _AttachedKV] = {}
        self._streams = threading.local()
        self._stats = CpuWorkerStats()
        self._copier = SlotCopier(cfg.cpu.copy_threads() if cfg is not None else 1)

    def job_threads(self, cfg: Config) -> int:
        return cfg.cpu.copy_threads()

    def cpu_affinity(self, cfg: Config) -> tuple[int, ...]:
        return cfg.cpu.cpu_affinity

    def use_slot_headers(self, headers: SlotHeaders) -> None:
        """Stamp the slots of device stores and answer verify jobs with ``headers``."""
        self._headers = headers

    def start(self, pool: HostPool, faults: FaultInjector) -> None:
        self._pool = pool
        self._faults = faults

    def _require_pool(self) -> HostPool:
        if self._pool is None:
            raise RuntimeError("CpuBackend.start was not called")
        return self._pool

    def attach_kv(self, handle: KVHandle) -> None:
        """Map ``handle`` (replacing a cache of the same id). AttachRefused when its block
        bytes differ from the pool's, its memory cannot be reached, or it is ``cuda_ipc`` and
        this worker has no CUDA device. A ``cuda_ipc`` handle is opened in the background: a
        failure there is logged (``kv_attach_refused``) and fails the jobs that use it."""
        pool = self._require_pool()
        block_bytes = sum(t.row_bytes for t in handle.tensors)
        if block_bytes != pool.block_bytes or handle.num_blocks < 1:
            raise AttachRefused(
                f"handle {handle.handle_id}: rows sum to {block_bytes} bytes over "
                f"{handle.num_blocks} blocks; the pool's blocks are {pool.block_bytes} bytes"
            )
        if handle.kind == HandleKind.CUDA_IPC and HandleKind.CUDA_IPC not in self.capabilities:
            raise AttachRefused(f"handle {handle.handle_id}: this cpu worker has no CUDA device")
        try:
            if handle.kind == HandleKind.SHM:
                kv: _AttachedKV = _ShmKV(handle, pool, self._copier)
            elif handle.kind == HandleKind.CUDA_IPC:
                kv = _CudaKV(handle, pool, self._streams, self._copier)
            else:
                raise AttachRefused(f"unknown handle kind {handle.kind!r}")
        except AttachRefused:
            raise
        except (OSError, ValueError, RuntimeError) as exc:
            raise AttachRefused(f"handle {handle.handle_id}: {exc}") from exc
        with self._lock:
            old = self._handles.get(handle.handle_id)
            self._handles[handle.handle_id] = kv
        if old is not None:
            self._retire(old)

    def detach_kv(self, handle_id: str) -> None:
        with self._lock:
            kv = self._handles.pop(handle_id, None)
        if kv is not None:
            self._retire(kv)

    def _retire(self, kv: _AttachedKV) -> None:
        with self._lock:
            kv.detached = True
            idle = kv.holders == 0
        if idle:
            kv.close()

    def _hold(self, handle_id: str) -> _AttachedKV | None:
        with self._lock:
            kv = self._handles.get(handle_id)
            if kv is not None:
                kv.holders += 1
            return kv

    def _unhold(self, kv: _AttachedKV) -> None:
        with self._lock:
            kv.holders -= 1
            idle = kv.detached and kv.holders == 0
        if idle:
            kv.close()

    def run_job(self, job: Job) -> BackendOutcome:
        if job.kind == JobKind.VERIFY:
            return self._verify(job)
        if job.kind not in (JobKind.DEVICE_STORE, JobKind.DEVICE_LOAD):
            return BackendOutcome(ok_keys=[], error=f"unsupported_kind: {job.kind!r}")
        kv = self._hold(job.handle_id)
        if kv is None:
            log.warning("job_unknown_handle", job_id=job.job_id, handle_id=job.handle_id)
            return BackendOutcome(ok_keys=[], error=UNKNOWN_HANDLE)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._unhold(kv)

        try:
            kv.wait_ready()
        except AttachRefused as exc:
            release()
            return BackendOutcome(ok_keys=[], error=f"{UNKNOWN_HANDLE}: {exc}")
        try:
            ok, nbytes, error = self._copy(job, kv)
        except BaseException:
            release()
            raise
        return BackendOutcome(ok_keys=ok, nbytes=nbytes, error=error, release=release)

    def _verify(self, job: Job) -> BackendOutcome:
        """Ok keys: the slots whose header names the key and matches the slot's bytes."""
        headers = self._headers
        if headers is None:
            return BackendOutcome(ok_keys=[], error="slot headers are off")
        ok: list[bytes] = []
        for key, slot in zip(job.keys, job.slots, strict=True):
            reason = headers.check(slot, key)
            if reason:
                log.warning(
                    "slot_verify_failed", job_id=job.job_id, key=key.hex(), slot=slot, reason=reason
                )
            else:
                ok.append(key)
        failed = len(job.keys) - len(ok)
        with self._lock:
            self._stats.slots_verified += len(ok)
            self._stats.slots_verify_failed += failed
        error = f"{failed} of {len(job.keys)} slots failed verification" if failed else ""
        return BackendOutcome(ok_keys=ok, error=error)

    def _stamp(
        self, job: Job, keys: list[bytes], slots: list[int], checksums: list[int] | None
    ) -> None:
        """Stamp the slots a device store completely wrote, with the checksums its copy took
        (None: read from the slots now); a failed stamp only costs the block its warm restart
        (logged)."""
        headers = self._headers
        if headers is None:
            return
        sums: list[int | None] = [None] * len(keys) if checksums is None else list(checksums)
        for key, slot, checksum in zip(keys, slots, sums, strict=True):
            try:
                headers.stamp(
                    slot, key, job.job_id, None if checksum is None else BlockChecksum(checksum)
                )
            except Exception as exc:  # noqa: BLE001 - a stamp failure costs only the warm restart
                log.error(
                    "slot_header_write_failed",
                    job_id=job.job_id,
                    key=key.hex(),
                    slot=slot,
                    error=repr(exc),
                )

    def _copy(self, job: Job, kv: _AttachedKV) -> tuple[list[bytes], int, str]:
        """Copy every key of the job whose device block and slot are in range (and that no
        injected fault fails), in one transfer over the copier's threads; stamp what a store
        wrote. A transfer that raises fails every key of the job (logged)."""
        pool = self._require_pool()
        store = job.kind == JobKind.DEVICE_STORE
        num_slots = pool.num_slots
        faults = self._faults
        ok: list[bytes] = []
        blocks: list[int] = []
        slots: list[int] = []
        failures: list[str] = []
        for key, slot, block in zip(job.keys, job.slots, job.device_blocks, strict=True):
            try:
                if not 0 <= block < kv.num_blocks:
                    raise IndexError(f"device block {block} not in [0, {kv.num_blocks})")
                if not 0 <= slot < num_slots:
                    raise IndexError(f"slot {slot} not in [0, {num_slots})")
                if faults.active:
                    faults.on_op(job.kind, key)
            except Exception as exc:  # noqa: BLE001 - one block's failure fails its key only
                failures.append(repr(exc))
                log.warning(
                    "device_copy_failed",
                    job_id=job.job_id,
                    kind=job.kind,
                    key=key.hex(),
                    slot=slot,
                    block=block,
                    error=repr(exc),
                )
                continue
            ok.append(key)
            blocks.append(block)
            slots.append(slot)
        checksums: list[int] | None = None
        if ok:
            try:
                checksums = kv.transfer(blocks, slots, store, store and self._headers is not None)
            except Exception as exc:  # noqa: BLE001 - the job's keys fail, the worker goes on
                log.error(
                    "device_copy_sync_failed", job_id=job.job_id, kind=job.kind, error=repr(exc)
                )
                failures.extend([f"copy_failed: {exc!r}"] * len(ok))
                ok = []
        if store and ok:
            self._stamp(job, ok, slots, checksums)
        count = len(job.keys)
        nbytes = len(ok) * pool.block_bytes
        with self._lock:
            if store:
                self._stats.bytes_stored += nbytes
            else:
                self._stats.bytes_loaded += nbytes
            self._stats.keys_failed += len(failures)
        error = f"{len(failures)} of {count} keys failed, first: {failures[0]}" if failures else ""
        return ok, nbytes, error

    def stats(self) -> CpuWorkerStats:
        with self._lock:
            return msgspec.structs.replace(self._stats, kv_handles=len(self._handles))

    def close(self) -> None:
        with self._lock:
            handles = list(self._handles)
        for handle_id in handles:
            self.detach_kv(handle_id)
        self._copier.close()


def main(argv: Sequence[str] | None = None) -> int:
    return worker_main(lambda cfg, _spec: CpuBackend(cfg), argv)


if __name__ == "__main__":
    sys.exit(main())
