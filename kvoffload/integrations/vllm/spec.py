"""``KVOffloadSpec``: vLLM's ``OffloadingSpec`` for a running kvoffload service.

vLLM builds one spec in the scheduler process (``get_manager``) and one in each model-worker
process (``get_worker``). The scheduler side connects to the service (``endpoint`` in
``kv_connector_extra_config``, else ``KVOFFLOAD_ENDPOINT``, else the newest local run) and
checks that a pool block holds one vLLM offload block of every rank; a mismatch is one error
that names both sizes and the settings to change. If the service is unreachable at start, vLLM
starts anyway and the integration connects when the service appears.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingMetricMetadata,
    OffloadingSpec,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import kvoffload
from kvoffload.integrations.vllm import integration_logger
from kvoffload.integrations.vllm.events import ServiceEvents
from kvoffload.integrations.vllm.keys import KVIdentity, model_digest
from kvoffload.integrations.vllm.layout import BlockLayout, GeometryError, check_fits
from kvoffload.integrations.vllm.link import ServiceLink
from kvoffload.integrations.vllm.manager import KVOffloadManager
from kvoffload.integrations.vllm.metrics import CONFIG_INFO_KEYS, metric_definitions
from kvoffload.integrations.vllm.settings import ConnectorSettings
from kvoffload.integrations.vllm.worker import KVOffloadWorker
from kvoffload.runtime.discovery import ENDPOINT_ENV, find_endpoint
from kvoffload.wire.events import FINGERPRINT_BYTES
from kvoffload.wire.protocol import Connected
from kvoffload.wire.tenant_ids import tenant_key

log = integration_logger(__name__)

LAYOUT_VERSION = "kvoffload-vllm-1"
OFFLOAD_KEY_BYTES = 36  # vLLM's block hash (32) + KV cache group index (4)


class KVOffloadSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels of ``vllm:kv_offload_config_info`` (vLLM 0.33), filled by
        ``KVOffloadManager.config_info``."""
        return CONFIG_INFO_KEYS

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.settings = ConnectorSettings.from_extra_config(self.extra_config)
        self.replicated_layout = config.replicated_layout
        parallel = config.parallel
        self.rank_block_bytes = config.worker_kv_bytes_per_block
        self.identity = KVIdentity(
            model=config.model.name,
            model_digest=model_digest(config.model.name),
            revision=self.settings.model_revision,
            kv_dtype=config.model.dtype,
            tokens_per_block=self.tokens_per_block,
            blocks_per_chunk=self.blocks_per_chunk,
            layout=f"{LAYOUT_VERSION}/{config.kv_cache_layout or ''}",
            tp_size=parallel.tp_size,
            pp_size=parallel.pp_size,
            pcp_size=parallel.pcp_size,
            dcp_size=parallel.dcp_size,
            per_rank_bytes=self.blocks_per_chunk * self.rank_block_bytes,
            groups=tuple((g.group_id, g.tokens_per_block, g.layer_names) for g in config.groups),
            namespace=self.settings.namespace,
        )
        self.fingerprint = self.identity.fingerprint()
        self._manager: KVOffloadManager | None = None

    def _check_service(self, info: Connected) -> None:
        """GeometryError if the service's pool or key limits cannot hold this engine's blocks."""
        check_fits(
            info.block_bytes,
            1 if self.replicated_layout else self.config.parallel.world_size,
            self.blocks_per_chunk,
            self.rank_block_bytes,
        )
        if info.key_bytes_max < FINGERPRINT_BYTES + OFFLOAD_KEY_BYTES:
            raise GeometryError(
                f"the kvoffload service accepts keys of at most {info.key_bytes_max} bytes; "
                f"vLLM keys need {FINGERPRINT_BYTES + OFFLOAD_KEY_BYTES}: set "
                f"pool.key_bytes_max to at least that"
            )

    def get_manager(self) -> KVOffloadManager:
        if self._manager is not None:
            return self._manager
        settings = self.settings
        tenant_key()  # an unusable KVOFFLOAD_TENANT_KEY_FILE stops the engine here, not later

        def on_connect(info: Connected) -> None:
            self._check_service(info)
            if self._manager is not None:
                self._manager.set_secondary_source(_secondary_source(info.tiers))

        link = ServiceLink(
            lambda: find_endpoint(settings.endpoint or None),
            name=f"vllm-{self.config.engine_id}",
            call_timeout_s=settings.call_timeout_s,
            connect_timeout_s=settings.connect_timeout_s,
            max_backoff_s=settings.max_backoff_s,
            on_connect=on_connect,
            landing=settings.verify_loads,  # copies told by a worker alone must be verified
        )
        self._manager = KVOffloadManager(
            link,
            self.fingerprint,
            engine_info=self._engine_info(),
            endpoint_setting=settings.endpoint or os.environ.get(ENDPOINT_ENV, ""),
            slices=1 if self.replicated_layout else self.config.parallel.world_size,
            slice_bytes=self.blocks_per_chunk * self.rank_block_bytes,
            namespace=settings.namespace,
            events=ServiceEvents(link, self.fingerprint)
            if self.config.enable_kv_cache_events
            else None,
            landing=settings.verify_loads,
            idle_wait_ms=settings.idle_landing_wait_ms,
        )
        if link.connect_now() and link.info is not None:
            self._manager.set_secondary_source(_secondary_source(link.info.tiers))
            log.info(
                "kvoffload_attached endpoint=%s pool=%s block_bytes=%d fingerprint=%s",
                link.endpoint,
                link.info.pool_name,
                link.info.block_bytes,
                self.fingerprint.hex(),
            )
        return self._manager

    def _engine_info(self) -> dict[str, str | int | float | bool]:
        """The engine's facts among ``CONFIG_INFO_KEYS`` (the manager adds the pool's)."""
        copies = 1 if self.replicated_layout else self.config.parallel.world_size
        return {
            "kvoffload_version": kvoffload.__version__,
            "offload_block_bytes": copies * self.blocks_per_chunk * self.rank_block_bytes,
            "blocks_per_chunk": self.blocks_per_chunk,
            "fingerprint": self.fingerprint.hex(),
            "namespace": self.settings.namespace,
            "verify_loads": self.settings.verify_loads,
            "sync_load_budget_bytes": int(self.extra_config.get("sync_load_budget_bytes") or 0),
        }

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KVOffloadWorker:
        layout = BlockLayout(
            group_pages=tuple(
                tuple(r.page_size_bytes for r in refs) for refs in kv_caches.group_data_refs
            ),
            blocks_per_chunk=self.blocks_per_chunk,
            rank=self.config.parallel.rank,
            world_size=self.config.parallel.world_size,
            replicated=self.replicated_layout,
            stride=self.rank_block_bytes,
        )
        if len(layout.group_pages) > 1:
            log.info(
                "kvoffload_kv_groups groups=%d bytes_per_block=%s unused_in_smallest=%.1f%%",
                len(layout.group_pages),
                [sum(pages) for pages in layout.group_pages],
                100 * layout.unused_fraction(),
            )
        faults = self.settings.faults_for(self.config.parallel.rank)
        cpus = self.settings.layered_load_cpus
        return KVOffloadWorker(
            kv_caches,
            layout,
            faults,
            self.settings.verify_loads,
            layered_load_cpus=None if cpus is None else set(cpus),
        )


def _secondary_source(tiers: list[str]) -> CacheHitSource:
    """How vLLM labels blocks promoted from kvoffload's first secondary tier."""
    return (
        CacheHitSource.DISK if tiers and tiers[0] == "disk" else CacheHitSource.EXTERNAL_UNSPECIFIED
    )


def spec_defaults(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """The entries that select this spec, for a ``kv_connector_extra_config`` lacking them."""
    return {
        key: value
        for key, value in (
            ("spec_name", KVOffloadSpec.__name__),
            ("spec_module_path", __name__),
        )
        if key not in extra_config
    }
