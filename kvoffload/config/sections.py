"""The configuration's sections: one frozen msgspec Struct per TOML table, with its defaults
and the constraints decoding checks (``loading`` reads and validates them)."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvoffload.config.tenants import TenantConfig
from kvoffload.memory.blockformat import MAX_KEY_BYTES
from kvoffload.memory.slotcopy import MAX_COPY_THREADS
from kvoffload.wire.events import KeyForm
from kvoffload.wire.protocol import FaultSpec

GiB = 1 << 30


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the config sections; each repeats ``frozen=True`` for type checkers."""


# Single-field constraints, checked when a config is decoded (the error names key and source).
Positive = Annotated[int, Meta(gt=0)]
PositiveSeconds = Annotated[float, Meta(gt=0)]
Fraction = Annotated[float, Meta(ge=0, le=1)]
Cores = tuple[Annotated[int, Meta(ge=0)], ...]


class ServiceConfig(_Section, frozen=True):
    """Manager and channels. Empty ``runtime_dir`` means ``$XDG_RUNTIME_DIR/kvoffload`` when set,
    else ``/tmp/kvoffload-<uid>``; empty ``client_endpoint`` means an ipc socket in the runtime
    dir; a ``tcp://`` endpoint needs both CURVE settings. ``metrics_port`` 0 turns metrics off
    (and the health endpoints served with them); ``metrics_host`` is the address they listen on
    (``0.0.0.0``: every interface)."""

    runtime_dir: str = ""
    client_endpoint: str = ""
    curve_server_secret_file: str = ""
    curve_authorized_dir: str = ""
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    metrics_host: Annotated[str, Meta(min_length=1)] = "127.0.0.1"
    log_level: str = "info"
    heartbeat_interval_s: PositiveSeconds = 0.5
    heartbeat_timeout_s: PositiveSeconds = 5.0
    request_lease_s: PositiveSeconds = 300.0
    hit_pending_deadline_s: PositiveSeconds = 30.0
    max_message_bytes: Positive = 16 * 1024 * 1024


class PoolConfig(_Section, frozen=True):
    """Host pool geometry and primary-tier policy. ``unread_promotion_cap`` is a fraction of
    the slots. ``slot_headers``: workers stamp a checksummed header per ready slot, so a
    restarted manager rebuilds its primary index instead of starting cold."""

    num_slots: Positive = 1024
    block_bytes: Annotated[int, Meta(gt=0, multiple_of=4096)] = 256 * 1024
    eviction_policy: Literal["lru", "arc"] = "lru"
    unread_promotion_cap: Fraction = 0.25
    layout_id: Annotated[str, Meta(min_length=1)] = "default"
    key_bytes_min: Positive = 16
    key_bytes_max: Annotated[int, Meta(le=MAX_KEY_BYTES)] = 64
    slot_headers: bool = True


class CpuConfig(_Section, frozen=True):
    """The cpu worker (device <-> pool copies). Empty ``cpu_affinity`` means no pinning.
    ``threads``: copies in flight at once (0: one per core the worker may run on, at most
    ``MAX_COPY_THREADS``; more threads than cores only take turns)."""

    threads: Annotated[int, Meta(ge=0)] = 0
    cpu_affinity: Cores = ()

    def copy_threads(self) -> int:
        """``threads``, with 0 resolved for the cores of ``cpu_affinity`` (else this process's)."""
        if self.threads:
            return self.threads
        cores = len(self.cpu_affinity) or len(os.sched_getaffinity(0))
        return max(1, min(MAX_COPY_THREADS, cores))


class DiskConfig(_Section, frozen=True):
    """The disk tier. A relative ``root`` is relative to the working directory. ``io``:
    ``direct`` requires O_DIRECT, ``buffered`` never uses it, ``auto`` uses it when a probe at
    start-up succeeds."""

    enabled: bool = True
    root: str = "kvoffload-data/disk"
    capacity_bytes: int = 8 * GiB
    durability: Literal["none", "fsync"] = "none"
    io: Literal["auto", "direct", "buffered"] = "auto"
    read_threads: Positive = 4
    write_threads: Positive = 2
    cpu_affinity: Cores = ()


class ObjectConfig(_Section, frozen=True):
    """The S3-compatible object tier; off until ``enabled`` and an ``endpoint`` are set.
    ``writeback``: ``best_effort`` evicts blocks whose PUT has not landed when the pool needs
    room (given up, counted); ``hold`` keeps them, refusing stores instead (as the disk tier)."""

    enabled: bool = False
    endpoint: str = ""
    bucket: str = "kvoffload"
    prefix: str = "kv"
    region: str = "us-east-1"
    access_key_id: str = ""
    secret_access_key: str = ""
    io_threads: Positive = 8
    request_timeout_s: PositiveSeconds = 10.0
    max_retries: Annotated[int, Meta(ge=0)] = 3
    verdict_timeout_s: PositiveSeconds = 5.0
    breaker_failure_threshold: Positive = 5
    breaker_cooldown_s: PositiveSeconds = 1.0
    breaker_max_cooldown_s: float = 30.0
    writeback: Literal["best_effort", "hold"] = "best_effort"
    cpu_affinity: Cores = ()


class PeerNodeConfig(_Section, frozen=True):
    """One node the peer tier follows: its node stream (``events_endpoint``, and its
    ``replay_endpoint``: catch-up and snapshots), its peer worker's ``fetch_endpoint`` and
    ``bulk_endpoint``, and the file of its service's CURVE public key (``server_key_file``,
    ZeroMQ's certificate format), with which every CURVE connection to it is made."""

    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
    events_endpoint: Annotated[str, Meta(min_length=1)]
    replay_endpoint: Annotated[str, Meta(min_length=1)]
    fetch_endpoint: Annotated[str, Meta(min_length=1)]
    bulk_endpoint: Annotated[str, Meta(min_length=1)]
    server_key_file: str = ""


class PeerConfig(_Section, frozen=True):
    """The peer tier: blocks other nodes of the fleet hold, found through their node streams
    and fetched from their peer workers (docs/fleet.md, "Peers"). On when ``nodes`` names a
    node to follow or ``fetch_endpoint`` serves this node's blocks to others.

    ``fetch_endpoint``: where this node's peer worker takes fetches (tcp:// with the
    ``service.curve_*`` keys: the service's secret key, and the authorized keys of the nodes
    that follow it); ``bulk_endpoint``: where it sends their blocks (tcp://, every frame sealed
    with the fetch's AES-256-GCM key, which travels inside CURVE). ``curve_client_secret_file``: this node's key pair (ZeroMQ's certificate
    format) for the nodes it follows, whose ``authorized`` directories must hold its public
    key. ``fetch_deadline_s``: the most one fetch may take before its keys fall through to the
    next tier; ``holder_wait_s``: how long a holder may take to bring blocks from its disk
    into its pool for a fetch. ``max_fetch_keys``: the most keys one fetch asks for.
    ``max_served_fetches``: fetches this node serves at once (four times as many may wait,
    more are refused ``busy``), so the fleet never starves its own engines. ``max_indexed_keys``: the index's bound (keys
    beyond it are not indexed, counted). ``breaker_*``: a node whose fetches fail this many
    times in a row is not asked for ``breaker_cooldown_s`` (doubling, up to the max)."""

    nodes: tuple[PeerNodeConfig, ...] = ()
    fetch_endpoint: str = ""
    bulk_endpoint: str = ""
    curve_client_secret_file: str = ""
    fetch_deadline_s: PositiveSeconds = 2.0
    holder_wait_s: Annotated[float, Meta(ge=0)] = 1.0
    max_fetch_keys: Positive = 64
    max_served_fetches: Positive = 4
    max_indexed_keys: Positive = 1 << 20
    io_threads: Positive = 4
    breaker_failure_threshold: Positive = 3
    breaker_cooldown_s: PositiveSeconds = 1.0
    breaker_max_cooldown_s: PositiveSeconds = 30.0
    cpu_affinity: Cores = ()

    @property
    def enabled(self) -> bool:
        return bool(self.nodes or self.fetch_endpoint)


class SupervisorConfig(_Section, frozen=True):
    """Process supervision: restart backoff, drain and grace period on shutdown."""

    restart_backoff_initial_s: PositiveSeconds = 0.5
    restart_backoff_max_s: PositiveSeconds = 10.0
    drain_timeout_s: PositiveSeconds = 10.0
    stop_grace_s: PositiveSeconds = 5.0
    cpu_affinity: Cores = ()


class EventsConfig(_Section, frozen=True):
    """The node's event stream (off while ``endpoint`` is empty): every tier's stored and
    removed blocks as vLLM's ``KVEventBatch`` on a ZeroMQ PUB, with a replay ROUTER when
    ``replay_endpoint`` is set; a ``tcp://`` endpoint needs the ``service.curve_*`` keys.
    ``key_form``: how blocks are named (``kvoffload.wire.events.KeyForm``);
    ``tenant_blocks``: whether blocks of a tenant are published (off: only blocks of no
    tenant). ``feed_keys``: the keys the manager keeps for clients that take events."""

    endpoint: str = ""
    replay_endpoint: str = ""
    topic: str = "kvoffload"
    key_form: KeyForm = KeyForm.KEY
    tenant_blocks: bool = False
    buffer_batches: Positive = 10000
    queue_batches: Positive = 10000
    hwm: Positive = 100000
    feed_keys: Positive = 262144


class EngineConfig(_Section, frozen=True):
    """One inference worker the supervisor starts: argv and extra environment. ``restart``:
    started again, with the supervisor's backoff, after it exits with a non-zero status (off:
    an engine that exits stays down)."""

    command: tuple[str, ...]
    env: dict[str, str] = {}
    restart: bool = False


class Config(_Section, frozen=True):
    """The whole configuration. Build it with ``load_config``."""

    service: ServiceConfig = msgspec.field(default_factory=ServiceConfig)
    pool: PoolConfig = msgspec.field(default_factory=PoolConfig)
    cpu: CpuConfig = msgspec.field(default_factory=CpuConfig)
    disk: DiskConfig = msgspec.field(default_factory=DiskConfig)
    object: ObjectConfig = msgspec.field(default_factory=ObjectConfig)
    peer: PeerConfig = msgspec.field(default_factory=PeerConfig)
    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    events: EventsConfig = msgspec.field(default_factory=EventsConfig)
    engines: tuple[EngineConfig, ...] = ()
    tenants: dict[str, TenantConfig] = {}
    """Shares and caps per tenant (``kvoffload.config.tenants``): ``default`` and named entries."""
    faults: FaultSpec = msgspec.field(default_factory=FaultSpec)
    """Fault injection every tier worker starts with (all off); the wire's ``FaultSpec``."""

    def to_toml_dict(self, redact_secrets: bool = True) -> dict[str, Any]:
        """Plain nested dict (lists for arrays) in file layout, e.g. for ``status``. With
        ``redact_secrets`` a non-empty ``object.secret_access_key`` reads ``"***"``."""
        data: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(self))
        if redact_secrets and data["object"]["secret_access_key"]:
            data["object"]["secret_access_key"] = "***"
        return data


SECTIONS: dict[str, type[_Section]] = {
    f.name: f.type for f in msgspec.structs.fields(Config) if f.name not in ("engines", "tenants")
}
