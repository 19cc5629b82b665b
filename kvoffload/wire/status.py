"""The status schemas: what the manager reports of itself, and what workers report of theirs.

``ManagerStatus`` is the body of the client channel's ``StatusReply`` (and what the metrics
endpoint publishes); ``WorkerStats`` rides on each worker's ``Heartbeat``. Typed msgspec
Structs, decoded as strictly as every message (unknown fields are refused). A leaf like
``protocol``: it imports only msgspec and ``vocab``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

# re-exported: the tiering library counts them, the status reports them


class TierCounters(msgspec.Struct, forbid_unknown_fields=True):
    """Counters of one tier since the manager started (the primary tier included): counted by
    the tiering library, reported in the manager's status."""

    lookups_hit: int = 0
    lookups_hit_pending: int = 0
    lookups_retry: int = 0
    lookups_miss: int = 0
    promotion_jobs: int = 0
    promotion_jobs_failed: int = 0
    promoted_keys_ok: int = 0
    cascade_jobs: int = 0
    cascade_jobs_failed: int = 0
    cascaded_keys_ok: int = 0
    cascade_keys_deferred: int = 0
    cascade_keys_resubmitted: int = 0
    cascade_dropped_evicted: int = 0
    cascade_dropped_tier_full: int = 0
    cascade_dropped_retry_bound: int = 0
    cascade_dropped_tenant_cap: int = 0
    probe_jobs: int = 0
    probe_jobs_failed: int = 0
    delete_jobs: int = 0
    delete_jobs_failed: int = 0
    deleted_keys: int = 0
    active_jobs: int = 0
    evictions: int = 0
    transfer_time_s: float = 0.0


class _Status(msgspec.Struct, forbid_unknown_fields=True):
    pass


class TierState(_Status):
    """What the manager knows of one secondary tier now."""

    indexed_keys: int
    verdicts: int
    tracked_requests: int
    online: bool
    cascade_backlog: int
    dirty_keys: int = 0
    """Keys in the host pool whose cascade to this tier has not landed (waiting or in flight)."""
    cascade_inflight_keys: int = 0


class TieringStatus(_Status):
    slots: int
    used_slots: int
    pinned_slots: int
    writing_slots: int
    unverified_slots: int
    unread_promotion_pins: int
    jobs_in_flight: int
    cascade_backlog: int
    requests: int
    tiers: dict[str, TierState]
    hit_pending_expired: int
    promotion_allocation_failures: int
    store_allocation_failures: int
    promoted_keys: int
    promoted_keys_consumed: int
    promotion_amplification: float | None
    per_tier: dict[str, TierCounters]
    held_slots: int = 0
    """Slots held for a tier that must get their block first (write-back: never evicted)."""
    stores_refused_dirty: int = 0
    """Stores refused (``no_space``) while held blocks took the room they needed."""
    store_backpressure_s: float = 0.0
    """Seconds from a refused store to the next store that got slots, summed."""
    tenants: dict[str, TenantStatus] = {}
    """Per tenant id ("none": requests without a tenant), once tenants are in use."""


class TenantTierStatus(_Status):
    """One tenant on one tier: the blocks it holds there (``bytes``: as the tier stores them)
    and its share and cap (None: no cap), the blocks evicted (``evicted_by_others``: for
    another tenant's traffic; never one inside its share) and refused at its cap."""

    blocks: int
    bytes: int = 0
    share_blocks: int = 0
    cap_blocks: int | None = None
    evictions: int = 0
    evicted_by_others: int = 0
    refused: int = 0


class TenantStatus(_Status):
    """One tenant, by id: whether the configuration names it, its open requests, its lookups
    (keys by result) and its tiers."""

    named: bool
    requests: int
    lookups_hit: int
    lookups_hit_pending: int
    lookups_miss: int
    tiers: dict[str, TenantTierStatus]


class PoolStatus(_Status):
    name: str
    block_bytes: int


class WorkerLoopStats(_Status):
    """The worker framework's own counters and levels, the same for every worker kind."""

    jobs_done: int = 0
    jobs_failed: int = 0
    jobs_refused: int = 0
    release_failures: int = 0
    cleanup_failures: int = 0
    bad_messages: int = 0
    queued: int = 0
    releasing: int = 0
    landing_notices: int = 0
    """``Landed`` notices sent to waiting clients."""
    landing_notices_dropped: int = 0
    """Notices a client's socket could not take (gone, or far behind)."""


class _MediumStats(_Status, tag_field="backend"):
    pass


class CpuWorkerStats(_MediumStats, tag="cpu"):
    """The cpu worker's copy counters; ``kv_handles`` is the number of engine caches attached."""

    bytes_stored: int = 0
    bytes_loaded: int = 0
    keys_failed: int = 0
    slots_verified: int = 0
    slots_verify_failed: int = 0
    kv_handles: int = 0


class DiskWorkerStats(_MediumStats, tag="disk"):
    """The disk worker's counters, with its store's fill level and I/O mode."""

    used_bytes: int = 0
    capacity_bytes: int = 0
    direct_io: bool = False
    degraded: bool = False
    bytes_read: int = 0
    bytes_written: int = 0
    keys_promoted: int = 0
    keys_cascaded: int = 0
    corrupt_blocks: int = 0
    absent_keys: int = 0
    transient_errors: int = 0
    enospc_errors: int = 0
    store_full: int = 0
    write_errors: int = 0
    injected_corruptions: int = 0
    keys_evicted: int = 0
    keys_deleted: int = 0


BreakerState = Literal["closed", "open", "half_open"]


class BreakerStats(_Status):
    """A circuit breaker's state; ``retry_in_s`` is 0 unless the breaker is open."""

    state: BreakerState = "closed"
    consecutive_failures: int = 0
    failures_total: int = 0
    rejected_total: int = 0
    opened_total: int = 0
    cooldown_s: float = 0.0
    retry_in_s: float = 0.0


class ObjectWorkerStats(_MediumStats, tag="object"):
    """The object worker's request counters and its store's circuit breaker."""

    probes: int = 0
    probe_failures: int = 0
    keys_probed: int = 0
    keys_found: int = 0
    gets: int = 0
    get_failures: int = 0
    puts: int = 0
    put_failures: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    slot_release_failures: int = 0
    injected_corruptions: int = 0
    deletes: int = 0
    delete_failures: int = 0
    objects_deleted: int = 0
    pending_releases: int = 0
    breaker: BreakerStats = msgspec.field(default_factory=BreakerStats)


class PeerWorkerStats(_MediumStats, tag="peer"):
    """The peer worker's counters: the nodes it follows and the keys they announce, the
    fetches it made (``fetch_*``: keys landed, absent at the holder, failed, bytes, blocks
    dropped for a bad checksum, falls to the next tier) and those it served to other nodes
    (``served_*``: ``absent`` the keys asked for that this node did not hold, ``answers_lost``
    the answers whose requester was gone; ``refused``: by code)."""

    nodes_followed: int = 0
    nodes_silent: int = 0
    keys_indexed: int = 0
    keys_not_indexed: int = 0
    stream_snapshots: int = 0
    stream_catch_ups: int = 0
    fetches: int = 0
    fetch_failures: int = 0
    fetch_keys: int = 0
    fetch_bytes: int = 0
    fetch_absent: int = 0
    fetch_bad_blocks: int = 0
    fallbacks: int = 0
    breakers_open: int = 0
    served_fetches: int = 0
    served_keys: int = 0
    served_bytes: int = 0
    served_absent: int = 0
    served_answers_lost: int = 0
    refused: dict[str, int] = {}
    handshakes_refused: dict[str, int] = {}


MediumStats = CpuWorkerStats | DiskWorkerStats | ObjectWorkerStats | PeerWorkerStats


class WorkerStats(_Status):
    """What a heartbeat reports: the framework's counters and the backend's own.
    ``medium`` is None when the backend could not report this time (logged by the worker)."""

    loop: WorkerLoopStats = msgspec.field(default_factory=WorkerLoopStats)
    medium: MediumStats | None = None


class WorkerStatus(_Status):
    """A connected worker; ``stats`` are its own counters, as its last heartbeat said."""

    pid: int
    medium: str
    alive: bool
    last_heartbeat_s: float
    degraded: bool
    index_complete: bool
    inflight: int
    incarnation: int
    stats: WorkerStats


class WarmRestartStatus(_Status):
    """Blocks adopted from the slot headers after a manager restart, and their verification."""

    headers_found: int
    adopted: int
    duplicates: int
    verified: int
    dropped: int
    unverified: int


class EventsStatus(_Status):
    """The tiers' events (``server.events``): whether they are recorded, the feed clients take
    them from, and the node stream's batches (zero without one)."""

    active: bool
    feed_events: int
    feed_keys: int
    client_resyncs: int
    stream_batches: int = 0
    stream_dropped_batches: int = 0
    stream_resends: int = 0


class ManagerStatus(_Status):
    pid: int
    uptime_s: float
    draining: bool
    pool: PoolStatus
    tiering: TieringStatus
    device_jobs_in_flight: int
    workers: dict[str, WorkerStatus]
    worker_restarts_seen: int
    clients: int
    warm_restart: WarmRestartStatus | None
    events: EventsStatus | None = None
    tiers_down: list[str] = []
    """Configured tiers not serving now (worker down, or its index not yet complete): the
    service is degraded while any is."""
    client_handshakes_refused: dict[str, int] = {}
    """Client connections the CURVE gate of a tcp:// endpoint refused, by reason (empty on
    an ipc:// endpoint; ``kvoffload.runtime.handshakes``)."""
