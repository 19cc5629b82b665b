"""``KVOffloadConnector``: vLLM's ``OffloadingConnector`` with kvoffload as the offload store.

Use it with::

    kv_transfer_config = {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }

It selects ``KVOffloadSpec`` by itself, refuses at start a model with a KV cache group kvoffload
cannot serve (``groups``), and adds what vLLM's own connector lacks: failed loads. A worker
whose load fails reports the job done to vLLM and hands the failure to vLLM in the form it takes
for the model: the destination blocks through ``get_block_ids_with_load_errors`` for a model
with one KV cache group, the request through ``get_transfer_results``' ``failed_recving`` for a
model with several (recomputed under the ``recompute`` policy). The failed keys go, through the
worker metadata, to the scheduler side, whose manager then answers MISS for them to that
request: one recompute, never a load -> fail -> load loop.

What differs between vLLM versions is decided in ``compat``. On every version the connector
keeps a reset fence (``KVOffloadManager.reset_cache``: the service's pool is emptied once the
workers reported the jobs the reset flushed), holds the manager lock for the calls it makes
outside vLLM's hooks, and follows sleep mode (``unregister_kv_caches`` / ``restore_kv_caches``).
Loads in the step that schedules them: ``sync_loads``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvoffload.integrations.vllm import compat, integration_logger
from kvoffload.integrations.vllm.groups import check_supported_layout, sliding_windows
from kvoffload.integrations.vllm.keys import hashing_is_seed_dependent
from kvoffload.integrations.vllm.manager import KVOffloadManager
from kvoffload.integrations.vllm.spec import spec_defaults
from kvoffload.integrations.vllm.sync_loads import SyncLoadMetadata, SyncLoads
from kvoffload.integrations.vllm.worker import KVOffloadWorker, TransferReport

log = integration_logger(__name__)


@dataclass
class KVOffloadWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker metadata plus the keys whose transfers failed (namespaced keys; loads per
    vLLM request id). Summed over the workers of a step like the base class."""

    failed_loads: dict[str, list[bytes]] = field(default_factory=dict)
    failed_stores: list[bytes] = field(default_factory=list)
    store_checksums: dict[bytes, dict[int, int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        base = super().aggregate(other)
        assert isinstance(base, OffloadingWorkerMetadata)
        loads = {req: list(keys) for req, keys in self.failed_loads.items()}
        stores = list(self.failed_stores)
        checksums = {key: dict(digests) for key, digests in self.store_checksums.items()}
        if isinstance(other, KVOffloadWorkerMetadata):
            for req, keys in other.failed_loads.items():
                loads.setdefault(req, []).extend(keys)
            stores.extend(other.failed_stores)
            for key, digests in other.store_checksums.items():
                checksums.setdefault(key, {}).update(digests)
        return KVOffloadWorkerMetadata(
            completed_jobs=base.completed_jobs,
            transfer_stats=base.transfer_stats,
            failed_loads=loads,
            failed_stores=stores,
            store_checksums=checksums,
        )


DEFAULT_SYNC_LOAD_BUDGET_BYTES = 256 << 20
"""``sync_load_budget_bytes`` the connector sets when the user did not (vLLM 0.33, models with
one KV cache group): hits of up to this many KV bytes per worker and step are loaded before the
forward of the step that schedules them (one step sooner than an asynchronous load; the step's
batch waits for the copy: 256 MiB is about 5-10 ms at host-to-GPU DMA speed)."""


def configure_sync_loads(extra: dict[str, Any], kv_cache_config: KVCacheConfig) -> None:
    """Set the synchronous-load budget in ``kv_connector_extra_config`` (read by vLLM 0.33, by
    ``sync_loads`` on 0.32): the default when the user set none, and 0 for a model with several
    KV cache groups (vLLM cannot take a failed synchronous load of such a model: its scheduler
    raises)."""
    if len(kv_cache_config.kv_cache_groups) > 1:
        if extra.get("sync_load_budget_bytes"):
            log.warning(
                "kvoffload: sync_load_budget_bytes is ignored for a model with %d KV cache "
                "groups (vLLM fails the engine on a failed synchronous load of such a model); "
                "its hits load asynchronously",
                len(kv_cache_config.kv_cache_groups),
            )
        extra["sync_load_budget_bytes"] = 0
    elif "sync_load_budget_bytes" not in extra:
        extra["sync_load_budget_bytes"] = DEFAULT_SYNC_LOAD_BUDGET_BYTES


def _select_spec(vllm_config: VllmConfig) -> None:
    """Point vLLM's offloading factory at ``KVOffloadSpec`` unless the config already names a
    spec, and record the model revision for the key fingerprint."""
    transfer = vllm_config.kv_transfer_config
    assert transfer is not None
    extra = transfer.kv_connector_extra_config
    extra.update(spec_defaults(extra))
    revision = (
        getattr(vllm_config.model_config, "revision", None) if vllm_config.model_config else None
    )
    if revision and "model_revision" not in extra:
        extra["model_revision"] = revision


class KVOffloadConnector(OffloadingConnector):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        _select_spec(vllm_config)
        algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
        if role == KVConnectorRole.SCHEDULER and hashing_is_seed_dependent(algo):
            log.warning(
                "kvoffload: prefix_caching_hash_algo=%s with PYTHONHASHSEED unset gives block "
                "hashes that differ in every vLLM process, so no other instance (and no restart) "
                "will ever hit these blocks; use sha256 or set PYTHONHASHSEED to one shared value",
                algo,
            )
        check_supported_layout(kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        configure_sync_loads(transfer.kv_connector_extra_config, kv_cache_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self._reset_fence = compat.ResetFence()
        self._sync = SyncLoads(0, 0, lambda req_id, keys: False)
        self._block_size = 0
        self._allocated: set[str] = set()
        """Requests vLLM allocated blocks for and that have not finished: running, preempted,
        or loading asynchronously (``_wait_if_alone`` waits only while none but its request is)."""
        self._waited_in_step = False
        if role == KVConnectorRole.SCHEDULER:
            manager = self.scheduler.manager
            if isinstance(manager, KVOffloadManager):
                manager.set_sliding_windows(sliding_windows(self.scheduler.config.kv_group_configs))
                if not compat.VLLM_FENCES_RESETS:
                    manager.expect_reset_flushed()  # this connector calls it (reset_cache)
                if not compat.VLLM_SYNC_LOADS and len(kv_cache_config.kv_cache_groups) == 1:
                    (group,) = kv_cache_config.kv_cache_groups
                    spec = group.kv_cache_spec
                    self._sync = SyncLoads(
                        int(transfer.kv_connector_extra_config["sync_load_budget_bytes"]),
                        spec.page_size_bytes * len(group.layer_names) // spec.block_size,
                        manager.hits_in_pool,
                    )
                    self._block_size = spec.block_size

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        _select_spec(vllm_config)
        return super().build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: object) -> bool:
        """vLLM 0.33's sleep mode: kvoffload's workers drain and stop copying at
        ``unregister_kv_caches`` and take the KV tensors again at ``restore_kv_caches``; the
        reset a sleep makes is fenced like any other."""
        return True

    # ---- worker side ----------------------------------------------------------------------

    def unregister_kv_caches(self) -> None:
        """Before sleep (vLLM 0.33): wait for every copy in flight, then refuse copies until
        ``restore_kv_caches`` (a refused load fails its keys, a refused store is dropped)."""
        worker = self._offload_worker()
        if worker is not None:
            worker.unregister()

    def restore_kv_caches(self) -> None:
        """After wake-up (vLLM 0.33): take the KV tensors' memory again and copy."""
        worker = self._offload_worker()
        if worker is not None:
            worker.restore()

    def _offload_worker(self) -> KVOffloadWorker | None:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        return worker if isinstance(worker, KVOffloadWorker) else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._offload_worker()
        return worker.take_error_blocks() if worker is not None else set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's results, plus the requests of a model with several KV cache groups that had
        a load fail: vLLM recomputes each of them from its first token (its scheduler takes
        failures of such models only per request)."""
        results = super().get_transfer_results(finished_req_ids)
        worker = self._offload_worker()
        if worker is not None:
            results.failed_recving |= worker.take_failed_requests(results.finished_recving)
        return results

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's registration; then the worker learns which KV tensor each layer reads
        (``layered``)."""
        super().register_kv_caches(kv_caches)
        worker = self._offload_worker()
        if worker is not None:
            worker.name_layers(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """vLLM's submission; then the synchronous loads of vLLM versions without them
        (``sync_loads``): reported done without a finished request, and waited for before the
        forward this is called ahead of, except those the worker copies layer by layer
        (``layered``), whose layers the forward waits for one by one."""
        meta = self._connector_metadata
        sync_jobs = meta.sync_job_ids if isinstance(meta, SyncLoadMetadata) else set()
        worker = self._offload_worker()
        if worker is not None:
            worker.stage_next_loads(sync_jobs)
        super().start_load_kv(forward_context, **kwargs)
        if not sync_jobs:
            return
        assert self.connector_worker is not None and self.connector_worker.worker is not None
        for job in sync_jobs:
            # vLLM 0.33 marks its synchronous jobs so: done, but no request to resume
            self.connector_worker._load_jobs[job] = None  # type: ignore[assignment]
        layered = worker.layered_job_ids() if worker is not None else set()
        self.connector_worker.worker.wait(sync_jobs - layered)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention: wait for its share of the layered loads in
        flight."""
        worker = self._offload_worker()
        if worker is not None:
            worker.wait_for_layer(layer_name)

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        """vLLM's metadata as ``KVOffloadWorkerMetadata`` whenever there is any: vLLM sums the
        workers' metadata onto the first worker's, so a rank without failures of its own must
        not hand over the base class, whose sum drops another rank's failures."""
        meta = super().build_connector_worker_meta()
        worker = self._offload_worker()
        report = worker.take_report() if worker is not None else None
        if not report and meta is None:
            return None
        report = report or TransferReport()
        out = KVOffloadWorkerMetadata(
            failed_loads=report.failed_loads,
            failed_stores=report.failed_stores,
            store_checksums=report.store_checksums,
        )
        if meta is not None:
            out.completed_jobs = meta.completed_jobs
            out.transfer_stats = meta.transfer_stats
        return out

    # ---- scheduler side -------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """The request's ``cache_salt`` names its tenant (``requests.TenantNames``)."""
        manager = self.scheduler.manager
        if isinstance(manager, KVOffloadManager):
            manager.tenants.name(request.request_id, request.cache_salt)
        super().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Ask kvoffload for the request's whole remaining prefix in one round trip before
        vLLM looks its keys up one by one, so a hit is known in the step the request arrives
        instead of the next one."""
        manager = self.scheduler.manager
        if isinstance(manager, KVOffloadManager) and compat.can_call_in_step(self.scheduler):
            keys = self._keys_from(request, num_computed_tokens)
            if keys:
                status = self.scheduler._req_status[request.request_id]
                compat.step_region(self.scheduler)
                manager.ask_now(status.req_context, keys)
                self._wait_if_alone(request.request_id, manager)
        hits, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if self._sync.choose(self.scheduler, request, num_computed_tokens, hits, load_async):
            log.debug("kvoffload_sync_load req_id=%s tokens=%s", request.request_id, hits)
            return hits, False
        return hits, load_async

    def _wait_if_alone(self, req_id: str, manager: KVOffloadManager) -> None:
        """The request waits for blocks its lookups promoted while the engine has no other
        request to run: wait for their landings now (at most the manager's ``idle_wait_ms``),
        before vLLM looks the keys up, so a request whose blocks all land meanwhile is
        scheduled, and loads, in this step instead of after an idle one. Once a step."""
        if (
            not self._waited_in_step
            and self._allocated <= {req_id}
            and manager.awaits_landings(req_id)
        ):
            self._waited_in_step = True
            manager.wait_for_landings()
            log.debug(
                "kvoffload_landing_wait req_id=%s still_awaited=%s",
                req_id,
                manager.awaits_landings(req_id),
            )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._allocated.add(request.request_id)
        if not num_external_tokens or not self._sync.enabled:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            return
        before = set(self.scheduler._current_batch_load_jobs)
        super().update_state_after_alloc(
            request,
            self._sync.blocks_for_alloc(request, blocks, self._block_size, self.scheduler),
            num_external_tokens,
        )
        self._sync.note_load_jobs(request, set(self.scheduler._current_batch_load_jobs) - before)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if not self._sync.enabled:
            meta = super().build_connector_meta(scheduler_output)
        else:
            self._sync.hide(self.scheduler)
            try:
                meta = super().build_connector_meta(scheduler_output)
            finally:
                self._sync.restore(self.scheduler)
            assert isinstance(meta, OffloadingConnectorMetadata)
            meta = self._sync.end_step(meta)
        self._wait_if_idle(scheduler_output)
        self._waited_in_step = False
        return meta

    def _wait_if_idle(self, scheduler_output: SchedulerOutput) -> None:
        """A step that computes nothing while requests wait for promoted blocks, and that did
        not wait for them already (``_wait_if_alone``): wait until a request's last awaited
        block landed (at most the manager's ``idle_wait_ms``) rather than step again at once,
        so the idle engine leaves the cores to the reads it waits for."""
        manager = self.scheduler.manager
        if (
            scheduler_output.total_num_scheduled_tokens == 0
            and not self._waited_in_step
            and isinstance(manager, KVOffloadManager)
            and manager.awaiting_landings()
        ):
            with compat.short_region(self.scheduler):
                manager.wait_for_landings()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._allocated.discard(request.request_id)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._allocated.discard(request.request_id)
        return super().request_finished_all_groups(request, block_ids)

    def _keys_from(self, request: Request, num_computed_tokens: int) -> list[OffloadKey]:
        """The request's offload keys of every KV cache group from ``num_computed_tokens`` on,
        read from vLLM's per-request state (the keys vLLM is about to look up); empty when vLLM
        will not look up this step or its state is not shaped as in the vLLM versions this was
        built for."""
        try:
            status = self.scheduler._req_status[request.request_id]
            if status.transfer_jobs or request.skip_reading_prefix_cache:
                return []
            status.update_offload_keys()
            return [
                key
                for config, group in zip(
                    self.scheduler.config.kv_group_configs, status.group_states, strict=True
                )
                for key in group.offload_keys[num_computed_tokens // config.tokens_per_chunk :]
            ]
        except (AttributeError, KeyError, ValueError):
            return []

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        manager = self.scheduler.manager
        if isinstance(meta, KVOffloadWorkerMetadata) and isinstance(manager, KVOffloadManager):
            with compat.short_region(self.scheduler):
                for req_id, keys in meta.failed_loads.items():
                    manager.note_failed_loads(req_id, keys)
                manager.note_failed_stores(meta.failed_stores)
                manager.note_store_checksums(meta.store_checksums)
        super().update_connector_output(connector_output)
        if isinstance(meta, OffloadingWorkerMetadata) and self._reset_fence.report(
            meta.completed_jobs
        ):
            self._reset_flushed()

    # ---- cache reset (the fence, for vLLM versions without one) -----------------------------

    def reset_cache(self) -> bool | None:
        """vLLM's reset; where vLLM keeps no reset fence (0.32) the connector keeps it: the
        jobs in flight now are counted down as the workers report them (they are flushed, so
        vLLM no longer completes them), and ``on_reset_flushed`` follows the last report."""
        flushed = {} if compat.VLLM_FENCES_RESETS else compat.jobs_in_flight(self.scheduler)
        result = super().reset_cache()
        self._sync.reset()
        if not compat.VLLM_FENCES_RESETS and self._reset_fence.arm(flushed):
            self._reset_flushed()
        return result

    def _reset_flushed(self) -> None:
        manager = self.scheduler.manager
        if isinstance(manager, KVOffloadManager):
            with compat.short_region(self.scheduler):
                manager.on_reset_flushed()

    def has_pending_push_work(self) -> bool:
        """vLLM's answer, or True while the reset fence waits for workers' reports (the
        engine must keep stepping to receive them)."""
        return self._reset_fence.held or super().has_pending_push_work()
