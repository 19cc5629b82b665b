"""``ProbeConnector``: ``KVOffloadConnector`` with timestamps, for ``bench_vllm.py --profile``.

Loaded by vLLM through ``kv_connector_module_path`` in its scheduler and model-worker
processes. Every connector call on the TTFT path is timed and written as one JSON line to
``$KVO_BENCH_PROBE_DIR/probe-<pid>.jsonl``: ``t`` (``time.monotonic()``, the same clock in
every process of the machine), ``d`` (seconds spent in the call), ``ev`` and the call's details.
Nothing else changes: the calls are passed through.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)

from kvoffload.integrations.vllm.connector import KVOffloadConnector
from kvoffload.integrations.vllm.manager import KVOffloadManager

_out = None


def _emit(ev: str, start: float, **fields: Any) -> None:
    global _out
    if _out is None:
        path = os.path.join(os.environ["KVO_BENCH_PROBE_DIR"], f"probe-{os.getpid()}.jsonl")
        _out = open(path, "a", buffering=1)  # noqa: SIM115 - one line-buffered file for the process's life
    _out.write(json.dumps({"ev": ev, "t": start, "d": time.monotonic() - start, **fields}) + "\n")


def _time_schedule_end(manager: KVOffloadManager) -> None:
    """Time the manager's step-end batch (its kvoffload lookups, one round trip per request)
    and its lookups of a request's whole prefix as it arrives (``ask_now``)."""
    inner = manager.on_schedule_end

    def on_schedule_end(context) -> None:
        start = time.monotonic()
        inner(context)
        _emit("schedule_end", start)

    manager.on_schedule_end = on_schedule_end  # type: ignore[method-assign]  # the probe wraps it
    inner_ask = manager.ask_now

    def ask_now(req_context, keys) -> None:
        start = time.monotonic()
        inner_ask(req_context, keys)
        _emit("ask_now", start)

    manager.ask_now = ask_now  # type: ignore[method-assign]  # the probe wraps it


class ProbeConnector(KVOffloadConnector):
    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_scheduler is not None and isinstance(
            self.scheduler.manager, KVOffloadManager
        ):
            _time_schedule_end(self.scheduler.manager)

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        start = time.monotonic()
        out = super().get_num_new_matched_tokens(request, num_computed_tokens)
        _emit("match", start, req=request.request_id, hit=out[0])
        return out

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        start = time.monotonic()
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        _emit("alloc", start, req=request.request_id, external=num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        start = time.monotonic()
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, OffloadingConnectorMetadata)
        _emit(
            "step",
            start,
            scheduled=scheduler_output.total_num_scheduled_tokens,
            loads=len(meta.load_jobs),
            stores=len(meta.store_jobs),
        )
        return meta

    def update_connector_output(self, connector_output):
        start = time.monotonic()
        super().update_connector_output(connector_output)
        _emit("output", start, recving=sorted(connector_output.finished_recving or ()))

    def request_finished(self, request, block_ids):
        start = time.monotonic()
        out = super().request_finished(request, block_ids)
        _emit("finished", start, req=request.request_id)
        return out

    # ---- worker side ----------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata) -> None:
        start = time.monotonic()
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None:
            _emit("bind", start)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        start = time.monotonic()
        super().start_load_kv(forward_context, **kwargs)
        meta = self._connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        _emit("transfers", start, loads=len(meta.load_jobs))

    def wait_for_layer_load(self, layer_name):
        start = time.monotonic()
        super().wait_for_layer_load(layer_name)
        _emit("layer_wait", start, layer=layer_name)

    def get_finished(self, finished_req_ids):
        start = time.monotonic()
        out = super().get_finished(finished_req_ids)
        _emit("worker_finished", start, recving=sorted(out[1] or ()))
        return out
