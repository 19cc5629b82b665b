"""vLLM's ``OffloadingWorker`` for kvoffload (runs in each model-worker process).

The worker maps kvoffload's host pool itself and copies between vLLM's KV tensors and pool
slots: for CPU tensors memcpy (one copy per tensor for each run of keys whose slots and blocks
are consecutive, in parts of ``PART_BYTES`` spread over a ``SlotCopier``'s threads, each part's
slots hashed right after its copies while they are in cache; the copy threads may use every
CPU of the process, ``worker_copier``), and for GPU tensors batched asynchronous copies (``kvoffload.memory.cudacopy``: per
tensor one gather or scatter through a staging buffer on the GPU, per run of slots one DMA)
from the CUDA-registered pool, on a stream of the worker's (expedited loads, which vLLM 0.33
waits for within the step, on a second one, so they do not queue behind stores). The checksums
of stored slots and the checks of loaded ones run on the ``SlotCopier``'s threads: on CPU
inside the submission, with the copy, on CUDA in the ``get_finished`` that finds the copy's
event completed, so neither a submission nor ``wait`` blocks on them. A synchronous CPU load
may instead be copied layer by layer beside the forward (``layered``: the connector names the
jobs, ``wait_for_layer`` holds each layer until its tensor is copied, ``get_finished`` checks
the digests). It never talks to the manager: slot numbers arrive in the ``PoolBlocks`` the
scheduler side built, and completions leave through ``get_finished``.

Every KV cache group of the model is served: a key's slot holds that group's blocks (see
``layout``), and a transfer's blocks are paired with its keys group by group.

A transfer that cannot be done in full never fails the job as seen by vLLM (whose offloading
connector does not support failed jobs). Instead:
- a failed load's keys are kept for the scheduler side, which answers MISS for them to that
  request; vLLM recomputes what they held. With one KV cache group the destination blocks go
  to ``get_block_ids_with_load_errors`` (vLLM recomputes from the first bad block); with
  several, vLLM takes failures only per request, so the request goes to
  ``take_failed_requests`` and is recomputed from its first token;
- a failed store's keys are kept for the scheduler side, which completes the store as failed.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvoffload.integrations.vllm import integration_logger
from kvoffload.integrations.vllm.blocks import NO_SLOT, PoolBlocks
from kvoffload.integrations.vllm.layered import (
    LayeredLoad,
    LayerOrder,
    layer_tensors,
    layered_load,
)
from kvoffload.integrations.vllm.layout import BlockLayout, CopyRow, transfer_rows
from kvoffload.integrations.vllm.segments import PageViews, tensor_segments
from kvoffload.memory.cudacopy import Part, SlotRegion, StageBuffer, copy_slots
from kvoffload.memory.pool import HostPool
from kvoffload.memory.prefault import Prefaulter
from kvoffload.memory.slotcopy import (
    MAX_COPY_THREADS,
    HashedPart,
    Segment,
    SlotCopier,
    process_cpus,
)
from kvoffload.memory.stagedcopy import StagedCopier, StagedCopy
from kvoffload.wire.protocol import FaultSpec

log = integration_logger(__name__)

PART_BYTES = 2 << 20
"""Slot bytes of one part of a CPU copy: copied, then hashed by one thread while they are in
its cache."""


@dataclass
class TransferReport:
    """For the scheduler side, since the last ``take_report``: keys whose loads failed (per
    vLLM request id), keys whose stores failed, and for each stored key this rank's digest of
    what it wrote, by slice index (``BlockLayout.slice_index``: the rank, or 0 for the whole
    slot when one rank writes all of it)."""

    failed_loads: dict[str, list[bytes]] = field(default_factory=dict)
    failed_stores: list[bytes] = field(default_factory=list)
    store_checksums: dict[bytes, dict[int, int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.failed_loads or self.failed_stores or self.store_checksums)


@dataclass
class _LoadCheck:
    """What a load checks once its copy completed: the loaded key indexes of ``spec``, the
    destination blocks of each key, and (CPU) each key's digest taken by the copy itself."""

    spec: PoolBlocks
    loaded: set[int]
    blocks: dict[int, list[int]]
    digests: dict[int, int] | None = None


@dataclass
class _Pending:
    """A submitted job; ``stored`` is a store whose slots get checksummed once it is done
    (``digests``: the digests its CPU copy took on the way, by key index), ``check`` a CUDA
    load verified then."""

    result: TransferResult
    event: torch.cuda.Event | None = None
    stored: PoolBlocks | None = None
    check: _LoadCheck | None = None
    digests: dict[int, int] | None = None
    layered: _Layered | None = None


@dataclass
class _Layered:
    """A CPU load copied layer by layer in the background (``layered``): its plan, its copy
    in flight, and what its check needs once the copy finished (``_LoadCheck`` without the
    digests, which the copy takes)."""

    load: LayeredLoad
    copy: StagedCopy
    check: _LoadCheck
    start: float


class KVOffloadWorker(OffloadingWorker):
    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        layout: BlockLayout,
        faults: FaultSpec | None = None,
        verify_loads: bool = True,
        layered_load_cpus: set[int] | None = None,
    ) -> None:
        """``faults.fail_fraction``: fraction of loaded keys to fail on purpose (tests and
        soaks of the recompute path). ``verify_loads``: check each loaded slot against the
        checksum recorded when it was written; a mismatch fails that key's load.
        ``layered_load_cpus``: where layered loads copy (``layered``); None: the CPUs of the
        process that the calling thread is not bound to (vLLM's reserved cores). None of them:
        no layered loads."""
        groups = kv_caches.group_data_refs
        pages = tuple(tuple(r.page_size_bytes for r in refs) for refs in groups)
        if pages != layout.group_pages:
            raise ValueError(f"KV pages {pages} differ from the layout {layout.group_pages}")
        self._tensors = [t.tensor.view(t.tensor.shape[0], -1) for t in kv_caches.tensors]
        self._group_refs = [
            [
                (r.tensor_idx, r.page_size_bytes, offset)
                for r, offset in zip(refs, layout.tensor_offsets(g), strict=True)
            ]
            for g, refs in enumerate(groups)
        ]
        self._layout = layout
        self._device = self._tensors[0].device
        self._arrays = [t.numpy() for t in self._tensors] if self._device.type == "cpu" else []
        cuda = self._device.type == "cuda"
        self._stream = torch.cuda.Stream(self._device) if cuda else None
        self._expedited = torch.cuda.Stream(self._device) if cuda else None
        self._stages = {
            False: StageBuffer(self._device),
            True: StageBuffer(self._device),
        }
        self._registered = True
        self._pools: dict[str, HostPool] = {}
        self._fenced = True
        self._pool_views: dict[str, torch.Tensor] = {}
        self._pending: list[_Pending] = []
        self._error_blocks: set[int] = set()
        self._failed_requests: set[str] = set()
        self._request_level_failures = len(groups) > 1
        self._report = TransferReport()
        faults = faults or FaultSpec()
        self._fail_fraction = faults.fail_fraction
        self._verify_loads = verify_loads
        self._rng = random.Random(faults.seed)
        self._copier = worker_copier()
        self._prefault = self._start_prefault()
        if layered_load_cpus is None:
            layered_load_cpus = process_cpus() - os.sched_getaffinity(0)
        self._layered_load_cpus = layered_load_cpus
        self._layers: LayerOrder | None = None
        self._staged: StagedCopier | None = None
        self._stage_next: set[int] = set()

    def _start_prefault(self) -> Prefaulter | None:
        """CPU KV tensors are backed with pages in the background (``kvoffload.memory.
        prefault``): vLLM does not touch them before use, and a first copy into a page pays
        its fault. The engine starts serving meanwhile; the log says when it is done."""
        if self._device.type != "cpu":
            return None
        ranges = [(t.data_ptr(), t.numel() * t.element_size()) for t in self._tensors]
        return Prefaulter(ranges, _log_prefault).start()

    # ---- pool -----------------------------------------------------------------------------

    def _pool_view(self, spec: PoolBlocks) -> torch.Tensor:
        """The pool of ``spec`` as an int8 tensor ``(num_slots, block_bytes)`` (mapped once;
        a pool of a previous service run is unmapped when a new one appears)."""
        view = self._pool_views.get(spec.pool_name)
        if view is not None:
            return view
        for name in list(self._pools):
            self._pool_views.pop(name, None)
            self._pools.pop(name).close()
        self._layout.check_fits(spec.block_bytes)
        pool = HostPool.attach(spec.pool_name, spec.num_slots, spec.block_bytes)
        if self._stream is not None and not pool.register_cuda():
            log.warning("kvoffload_pool_not_cuda_registered pool=%s", spec.pool_name)
        view = torch.from_numpy(pool.as_numpy()).view(torch.int8)
        if not _alive(spec.manager_pid):
            self._fenced = False
            log.warning(
                "kvoffload_copies_unfenced manager_pid=%d: the manager is not visible from this "
                "process (another PID namespace?); copies are not checked against a manager "
                "restart",
                spec.manager_pid,
            )
        self._pools[spec.pool_name] = pool
        self._pool_views[spec.pool_name] = view
        return view

    def _manager_alive(self, pid: int) -> bool:
        return not self._fenced or _alive(pid)

    # ---- sleep mode -----------------------------------------------------------------------

    def unregister(self) -> None:
        """Wait for every copy in flight, then refuse copies until ``restore`` (the KV
        tensors' memory is released while vLLM sleeps). Idempotent."""
        self._stop_prefault()
        self._sync_streams()
        self._registered = False

    def restore(self) -> None:
        """Take the KV tensors' memory again (vLLM maps it back at the same addresses; the
        CPU views are rebuilt all the same). Idempotent."""
        if self._device.type == "cpu":
            self._arrays = [t.numpy() for t in self._tensors]
            self._prefault = self._start_prefault()
        self._registered = True

    def _sync_streams(self) -> None:
        for stream in (self._stream, self._expedited):
            if stream is not None:
                stream.synchronize()
        for pending in self._pending:
            if pending.layered is not None:
                pending.layered.copy.wait()

    # ---- OffloadingWorker -----------------------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, PoolBlocks)
        start = time.perf_counter()
        moved = 0
        if not self._layout.writes:
            self._finish(job_id, 0, start)  # rank 0 writes the one copy every rank reads
            return True
        try:
            if not self._registered:
                raise ValueError("the KV caches are unregistered (vLLM sleeps)")
            rows = self._rows(len(dst_spec.keys), src_spec)
            pool = self._pool_view(dst_spec)
            if not self._manager_alive(dst_spec.manager_pid):
                raise ProcessLookupError(
                    f"manager {dst_spec.manager_pid} that reserved the slots is gone"
                )
            moved, digests = self._copy(pool, rows, dst_spec.slots, to_pool=True)
        except (OSError, ValueError) as exc:
            log.warning("kvoffload_store_copy_failed req_id=%s error=%s", dst_spec.req_id, exc)
            self._report.failed_stores.extend(dst_spec.keys)
            self._finish(job_id, 0, start)
            return True
        self._finish(job_id, moved, start, dst_spec, digests=digests)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        assert isinstance(src_spec, PoolBlocks)
        start = time.perf_counter()
        moved = 0
        keys = src_spec.keys
        try:
            rows = self._rows(len(keys), dst_spec)
        except ValueError as exc:
            log.error("kvoffload_load_spec_invalid req_id=%s error=%s", src_spec.req_id, exc)
            self._fail_load(src_spec.req_id, keys, dst_spec.block_ids.tolist())
            self._finish(job_id, 0, start)
            return True
        failed = {i for i, slot in enumerate(src_spec.slots) if slot == NO_SLOT}
        if self._fail_fraction:
            failed.update(i for i in range(len(keys)) if self._rng.random() < self._fail_fraction)
        if not self._registered:
            log.warning("kvoffload_load_refused req_id=%s: vLLM sleeps", src_spec.req_id)
            failed = set(range(len(keys)))
        try:
            pool = self._pool_view(src_spec) if len(failed) < len(keys) else None
        except (OSError, ValueError) as exc:
            log.warning("kvoffload_pool_unavailable pool=%s error=%s", src_spec.pool_name, exc)
            pool, failed = None, set(range(len(keys)))
        good = [r for r in rows if r.key_index not in failed]
        check = None
        layered = pool is not None and bool(good) and self._layered_ready(job_id)
        if layered:
            assert pool is not None
            self._submit_layered(job_id, src_spec, pool, good, start)
        elif pool is not None and good:
            moved, digests = self._copy(
                pool, good, src_spec.slots, to_pool=False, expedited=expedited
            )
            blocks: dict[int, list[int]] = {}
            for row in good:
                blocks.setdefault(row.key_index, []).append(row.block_id)
            check = _LoadCheck(src_spec, set(blocks), blocks, digests)
            if self._stream is None:  # CPU: the copy is done, check it now
                failed |= self._check_load(check)
                check = None
        if failed:
            self._fail_load(
                src_spec.req_id,
                [keys[i] for i in sorted(failed)],
                [r.block_id for r in rows if r.key_index in failed],
            )
        if not layered:
            self._finish(job_id, moved, start, check=check, expedited=expedited)
        return True

    # ---- layered loads --------------------------------------------------------------------

    def name_layers(self, layers: Mapping[str, torch.Tensor]) -> None:
        """vLLM's KV tensors by layer name (``register_kv_caches``): which of the offloaded
        tensors each layer reads, for layered loads (CPU tensors and background CPUs only).
        The copier of layered loads starts here, so the first load does not wait for its
        threads."""
        if self._device.type != "cpu" or not self._layered_load_cpus:
            return
        mapping = layer_tensors(
            {name: _span(tensor) for name, tensor in layers.items()},
            [_span(tensor) for tensor in self._tensors],
        )
        self._layers = LayerOrder(mapping) if mapping else None
        if self._layers is not None and self._staged is None:
            cpus = self._layered_load_cpus
            self._staged = StagedCopier(max(1, min(MAX_COPY_THREADS, len(cpus))), cpus)
        log.info(
            "kvoffload_layers_named layers=%d tensors=%d layered_load_cpus=%s",
            len(mapping),
            len(self._tensors),
            sorted(self._layered_load_cpus),
        )

    def stage_next_loads(self, job_ids: set[int]) -> None:
        """Load the jobs among ``job_ids`` layer by layer where the worker can
        (``layered_job_ids`` tells which it did): their forward waits for each layer's copy
        through ``wait_for_layer``, not for the whole copy. Replaces the previous set."""
        self._stage_next = set(job_ids)

    def layered_job_ids(self) -> set[int]:
        """The loads in flight that copy layer by layer."""
        return {p.result.job_id for p in self._pending if p.layered is not None}

    def wait_for_layer(self, layer: str) -> None:
        """Return once every layered load in flight copied the tensors ``layer`` reads (vLLM's
        ``wait_for_layer_load``, called before the layer's attention); also learns the
        forward's layer order."""
        if self._layers is None:
            return
        self._layers.saw(layer)
        tensors = self._layers.tensors_of(layer)
        for pending in self._pending:
            if pending.layered is not None:
                stage = pending.layered.load.last_stage(tensors)
                if stage >= 0:
                    pending.layered.copy.wait_stage(stage)

    def _layered_ready(self, job_id: int) -> bool:
        return (
            job_id in self._stage_next
            and self._stream is None
            and self._staged is not None
            and self._layers is not None
            and self._layers.order is not None
        )

    def _submit_layered(
        self, job_id: int, spec: PoolBlocks, pool: torch.Tensor, rows: list[CopyRow], start: float
    ) -> None:
        assert self._layers is not None and self._layers.order is not None
        assert self._staged is not None
        load = layered_load(
            self._layout,
            self._group_refs,
            self._arrays,
            pool.numpy(),
            rows,
            spec.slots,
            self._layers.order,
        )
        blocks: dict[int, list[int]] = {}
        for row in rows:
            blocks.setdefault(row.key_index, []).append(row.block_id)
        check = _LoadCheck(spec, set(blocks), blocks)
        copy = self._staged.submit(load.plan())
        log.debug(
            "kvoffload_layered_load req_id=%s keys=%d stages=%d",
            spec.req_id,
            len(load.keys),
            len(load.stages),
        )
        result = TransferResult(job_id, True, load.moved)
        self._pending.append(_Pending(result, layered=_Layered(load, copy, check, start)))

    def _finish_layered(self, pending: _Pending) -> None:
        """Wait for a layered load's copy (its forward already waited for every layer), then
        check it: every key fails when the copy raised."""
        layered = pending.layered
        assert layered is not None
        check = layered.check
        try:
            digests = layered.copy.result()
        except (OSError, ValueError, RuntimeError) as exc:
            log.error("kvoffload_layered_load_failed req_id=%s error=%s", check.spec.req_id, exc)
            bad = set(check.loaded)
        else:
            check.digests = dict(zip(layered.load.keys, digests, strict=True))
            bad = self._check_load(check)
        self._fail_checked(check, bad)
        pending.result.transfer_time = time.perf_counter() - layered.start
        pending.layered = None

    def _check_load(self, check: _LoadCheck) -> set[int]:
        """Indexes of the loaded keys to fail once their copy is complete: all when the
        manager that pinned their slots is gone, else those whose slot does not match its
        checksum (``verify_loads``)."""
        spec = check.spec
        if not self._manager_alive(spec.manager_pid):
            log.warning("kvoffload_manager_gone_during_load pid=%d", spec.manager_pid)
            return set(check.loaded)
        if self._verify_loads:
            return self._corrupt_slots(spec, check.loaded, check.digests)
        return set()

    def _finish_check(self, check: _LoadCheck) -> None:
        """Run a CUDA load's check (its copy is complete) and fail the keys it finds."""
        self._fail_checked(check, self._check_load(check))

    def _fail_checked(self, check: _LoadCheck, bad: set[int]) -> None:
        """Fail the keys ``bad`` (indexes) of a checked load, with their destination blocks."""
        if bad:
            self._fail_load(
                check.spec.req_id,
                [check.spec.keys[i] for i in sorted(bad)],
                [block for i in sorted(bad) for block in check.blocks[i]],
            )

    def _rows(self, num_keys: int, spec: GPULoadStoreSpec) -> list[CopyRow]:
        return transfer_rows(
            num_keys,
            spec.block_ids.tolist(),
            [int(n) for n in spec.group_sizes],
            [int(i) for i in spec.block_indices],
            self._layout.blocks_per_chunk,
        )

    def get_finished(self) -> list[TransferResult]:
        """The jobs whose copies completed since the last call (a layered load is waited for:
        its step's forward is over). Called once per step: it also ends the step for the
        learning of the layer order."""
        if self._layers is not None and self._layers.order is None:
            self._layers.step_ended()
            if self._layers.order is not None:
                log.info("kvoffload_layer_order_learned tensors=%s", list(self._layers.order))
        done: list[_Pending] = []
        waiting: list[_Pending] = []
        for pending in self._pending:
            (done if pending.event is None or pending.event.query() else waiting).append(pending)
        self._pending = waiting
        for pending in done:
            self._completed(pending)
        return [p.result for p in done]

    def _completed(self, pending: _Pending) -> None:
        """A job's copies are complete: checksum what it stored, check what it loaded."""
        if pending.layered is not None:
            self._finish_layered(pending)
        if pending.stored is not None:
            self._checksum(pending.stored, pending.digests)
            pending.stored = None
        if pending.check is not None:
            self._finish_check(pending.check)
            pending.check = None

    def wait(self, job_ids: set[int]) -> None:
        """Return once the jobs' copies are complete. A load's checks run at the next
        ``get_finished`` (vLLM reads the failed blocks after it, once the step's forward ran:
        the forward of a synchronous load does not wait for the checksums)."""
        for pending in self._pending:
            if pending.result.job_id not in job_ids:
                continue
            if pending.event is not None:
                pending.event.synchronize()
            if pending.layered is not None:
                pending.layered.copy.wait()

    def _stop_prefault(self) -> None:
        if self._prefault is not None:
            self._prefault.stop()

    def shutdown(self) -> None:
        self._stop_prefault()
        self._sync_streams()
        self._pool_views.clear()
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._copier.close()
        if self._staged is not None:
            self._staged.close()

    # ---- failures -------------------------------------------------------------------------

    def _fail_load(self, req_id: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        if self._request_level_failures:
            self._failed_requests.add(req_id)
        else:
            self._error_blocks.update(block_ids)
        self._report.failed_loads.setdefault(req_id, []).extend(keys)

    def take_error_blocks(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them). Always
        empty for a model with several KV cache groups: vLLM's block ids are unique only within
        a group, so its scheduler takes failures of such models per request
        (``take_failed_requests``)."""
        out, self._error_blocks = self._error_blocks, set()
        return out

    def take_failed_requests(self, finished: set[str]) -> set[str]:
        """The vLLM requests among ``finished`` (requests whose loads just finished) that had a
        load fail, for a model with several KV cache groups: vLLM recomputes each of them from
        its first token. Failed requests not yet finished are kept for a later call."""
        out = self._failed_requests & finished
        self._failed_requests -= out
        return out

    def take_report(self) -> TransferReport:
        out, self._report = self._report, TransferReport()
        return out

    def _corrupt_slots(
        self, spec: PoolBlocks, loaded: set[int], taken: dict[int, int] | None = None
    ) -> set[int]:
        """Indexes of the loaded keys whose bytes for this rank (its slice, or the whole slot)
        no longer have the digest recorded when they were written, or whose block was written
        in another layout (another number of slices). ``taken``: the digests the copy took of
        what it wrote, by key index (CPU); else the slots are hashed now. The slots stay pinned
        while this runs, so a match proves the copied bytes are the ones written."""
        pool = self._pools[spec.pool_name]
        layout = self._layout
        recorded = {i: spec.checksums[i] for i in loaded if i < len(spec.checksums)}
        checked = sorted(i for i, digests in recorded.items() if len(digests) == layout.copies)
        bad = {i for i, digests in recorded.items() if digests and len(digests) != layout.copies}
        if taken is not None:
            sums = [taken[i] for i in checked]
        else:
            sums = self._copier.checksums(
                [layout.checked_bytes(pool.slot_array(spec.slots[i])) for i in checked]
            )
        bad |= {
            i
            for i, got in zip(checked, sums, strict=True)
            if got != recorded[i][layout.slice_index]
        }
        if bad:
            log.error(
                "kvoffload_load_corrupt req_id=%s blocks=%d: the pool slots do not match their "
                "checksums; those blocks are recomputed",
                spec.req_id,
                len(bad),
            )
        return bad

    def _checksum(self, spec: PoolBlocks, taken: dict[int, int] | None = None) -> None:
        """Checksum what a finished store wrote of each slot (this rank's slice, or the whole
        slot), so the manager can stamp the slots once every rank's digest is in, and a
        restarted manager keeps them. ``taken``: the digests its copy took (CPU), by key
        index; else the slots are hashed now."""
        pool = self._pools.get(spec.pool_name)
        if pool is None:
            return
        layout = self._layout
        if taken is not None:
            sums = [taken[i] for i in range(len(spec.keys))]
        else:
            sums = self._copier.checksums(
                [layout.checked_bytes(pool.slot_array(slot)) for slot in spec.slots]
            )
        for key, digest in zip(spec.keys, sums, strict=True):
            self._report.store_checksums.setdefault(key, {})[layout.slice_index] = digest

    # ---- copies ---------------------------------------------------------------------------

    def _finish(
        self,
        job_id: int,
        moved: int,
        start: float,
        stored: PoolBlocks | None = None,
        check: _LoadCheck | None = None,
        expedited: bool = False,
        digests: dict[int, int] | None = None,
    ) -> None:
        result = TransferResult(job_id, True, moved, time.perf_counter() - start)
        event = None
        stream = self._expedited if expedited else self._stream
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        self._pending.append(_Pending(result, event, stored, check, digests))

    def _copy(
        self,
        pool: torch.Tensor,
        rows: list[CopyRow],
        slots: Sequence[int],
        to_pool: bool,
        expedited: bool = False,
    ) -> tuple[int, dict[int, int] | None]:
        """Copy ``rows`` between the KV tensors and their keys' slots; returns the bytes moved
        and, on CPU, each key's digest of this rank's part of its slot (``layout.
        checked_bytes``) taken right after the copies that wrote or read it, while it is in
        cache (``copy_plan_cpu``); None on CUDA, where the digests are taken once the copy
        completed."""
        if self._stream is not None:
            return self._copy_cuda(pool, rows, slots, to_pool, expedited), None
        # One memcpy per (block, tensor) through numpy views: torch's advanced indexing of
        # int8 rows measured 0.36 GB/s here, row slices 4.5 GB/s.
        keys, parts, moved = copy_plan_cpu(
            self._layout, self._group_refs, self._arrays, pool.numpy(), rows, slots, to_pool
        )
        sums = self._copier.copy_then_hash(parts, urgent=not to_pool)
        return moved, dict(zip(keys, sums, strict=True))

    def _copy_cuda(
        self,
        pool: torch.Tensor,
        rows: list[CopyRow],
        slots: Sequence[int],
        to_pool: bool,
        expedited: bool = False,
    ) -> int:
        """Queue the copy of ``rows`` on the worker's stream (its expedited one for an
        expedited load), after the work vLLM queued so far: batched (``copy_plan``)."""
        stream = self._expedited if expedited else self._stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self._device))
        region, used_slots, parts = copy_plan(
            self._layout, self._group_refs, self._tensors, rows, slots
        )
        with torch.cuda.stream(stream):
            return copy_slots(pool, used_slots, region, parts, to_pool, self._stages[expedited])


def _log_prefault(prefault: Prefaulter) -> None:
    if prefault.error:
        log.warning(
            "kvoffload_kv_prefault_incomplete bytes=%d of=%d error=%s",
            prefault.populated_bytes,
            prefault.total_bytes,
            prefault.error,
        )
    else:
        log.info(
            "kvoffload_kv_prefaulted bytes=%d seconds=%.3f",
            prefault.populated_bytes,
            prefault.seconds,
        )


def worker_copier() -> SlotCopier:
    """The copier of a model-worker process. vLLM's CPU workers bind each of their threads
    to the worker's OpenMP cores and reserve the machine's other cores for connectors
    (``VLLM_CPU_NUM_OF_RESERVED_CPU``; vLLM's own NIXL connector moves its transfer thread
    there): the copy threads may run on every CPU of the process's cpuset, the calling thread
    copying its part on its own core."""
    cpus = process_cpus()
    mine = os.sched_getaffinity(0)
    if cpus <= mine:
        return SlotCopier()
    return SlotCopier(max(1, min(MAX_COPY_THREADS, len(cpus))), helper_cpus=cpus)


def copy_plan_cpu(
    layout: BlockLayout,
    group_refs: Sequence[Sequence[tuple[int, int, int]]],
    arrays: Sequence[np.ndarray],
    host: np.ndarray,
    rows: Sequence[CopyRow],
    slots: Sequence[int],
    to_pool: bool,
) -> tuple[list[int], list[HashedPart], int]:
    """The CPU copy of ``rows`` as ``SlotCopier.copy_then_hash`` parts of about
    ``PART_BYTES`` of slots each: per tensor, one copy for every run of keys whose slots and
    blocks are both consecutive (a 2-D view of the pool against one of the tensor), or, when
    only the source side of a part's keys is consecutive (a load into scattered vLLM blocks),
    one ``IndexedCopy`` of their pages (a scatter: each page copied once, one numpy call for
    all of them); then the digest of each key's part of its slot (``layout.checked_bytes``:
    what this rank wrote or reads). Returns (key indexes in first-use order, the parts, bytes
    copied)."""
    per_key: dict[int, list[CopyRow]] = {}
    for row in rows:
        per_key.setdefault(row.key_index, []).append(row)
    keys = list(per_key)
    region_bytes = max(1, layout.checked_bytes(host[0]).size)
    keys_per_part = max(1, PART_BYTES // region_bytes)
    views = PageViews(arrays, host)
    parts: list[HashedPart] = []
    moved = 0
    for first in range(0, len(keys), keys_per_part):
        mine = keys[first : first + keys_per_part]
        # (group, chunk block) -> [(slot, block id)] in key order
        places: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for key in mine:
            for row in per_key[key]:
                places.setdefault((row.group, row.chunk_block), []).append(
                    (slots[key], row.block_id)
                )
        segments: list[Segment] = []
        for (group, chunk_block), placed in places.items():
            base = layout.offset(chunk_block)
            for tensor, page, offset in group_refs[group]:
                segments.extend(
                    tensor_segments(
                        placed, tensor, page, base + offset, arrays, host, to_pool, views
                    )
                )
                moved += page * len(placed)
        regions = [layout.checked_bytes(host[slots[key]]) for key in mine]
        parts.append((segments, regions))
    return keys, parts, moved


def copy_plan(
    layout: BlockLayout,
    group_refs: Sequence[Sequence[tuple[int, int, int]]],
    tensors: Sequence[torch.Tensor],
    rows: Sequence[CopyRow],
    slots: Sequence[int],
) -> tuple[SlotRegion, list[int], list[Part]]:
    """The batched copy of ``rows`` (``kvoffload.memory.cudacopy``): this rank's region of each
    slot cut into block strides, the slots of the keys the rows name (in first-use order), and
    per (group, tensor) the blocks with their stride in the staging buffer.
    ``group_refs[g]``: (tensor index, page bytes, offset in the stride) of each tensor of
    group ``g``."""
    region = SlotRegion(layout.offset(0), layout.per_rank_bytes, layout.block_stride)
    index: dict[int, int] = {}
    for row in rows:
        index.setdefault(row.key_index, len(index))
    used_slots = [slots[key] for key in index]
    per_slot = layout.blocks_per_chunk
    parts: list[Part] = []
    for group, refs in enumerate(group_refs):
        mine = [r for r in rows if r.group == group]
        if not mine:
            continue
        blocks = [r.block_id for r in mine]
        fine = [index[r.key_index] * per_slot + r.chunk_block for r in mine]
        for tensor, page, offset in refs:
            parts.append(Part(tensors[tensor], blocks, fine, offset, page))
    return region, used_slots, parts


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """[first, end) of the addresses a tensor's elements occupy."""
    start = tensor.data_ptr()
    if tensor.numel() == 0:
        return start, start
    last = sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return start, start + (last + 1) * tensor.element_size()


def _alive(pid: int) -> bool:
    """Whether the manager that handed out a transfer's slots still runs. Slots are only
    reassigned by a restarted manager, which starts after the old one died, so a copy into
    the pool checked before it starts, or a copy out of it checked after it ends, touched
    slots that still belonged to the transfer."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
