"""Prometheus metrics of the manager (``prometheus_client``), served over HTTP from a background
thread on ``service.metrics_port``.

Two sources feed them:

- the manager's status snapshot, which the loop publishes at every housekeeping turn: tiering
  counters per tier, pool and tier gauges, worker health, and the workers' own counters as
  their heartbeats carry them. A collector renders the last snapshot at scrape time, so the HTTP
  thread never touches the manager's state;
- observations from the manager's channels: the time spent on each client call, and each
  worker job from its dispatch to its result, with the bytes it moved (``job_sent`` /
  ``worker_message`` / ``client_call``, called on the manager's thread).

Counters are cumulative since the manager started; a worker's heartbeat counters are summed over
its incarnations (a restarted worker starts its own from zero), so they never go back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvoffload.runtime.runspec import FatalStartError
from kvoffload.server.health import Health, serve_http
from kvoffload.tiering.types import CascadeDrop
from kvoffload.wire import protocol as p
from kvoffload.wire.status import (
    EventsStatus,
    ManagerStatus,
    TenantStatus,
    TierCounters,
    TieringStatus,
    TierState,
    WarmRestartStatus,
    WorkerStats,
    WorkerStatus,
)
from kvoffload.wire.vocab import JobKind

PREFIX = "kvoffload_"

CALL_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1, 0.5)
JOB_BUCKETS_S = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 30)

MAX_TRACKED_JOBS = 16384
"""Dispatched jobs whose result is awaited; past it the oldest are forgotten (their worker died
and the manager failed them)."""

POOL_GAUGES = {
    "slots": "Slots of the host pool.",
    "used_slots": "Host pool slots holding a block or being written.",
    "pinned_slots": "Host pool slots pinned by readers (loads, promotions not yet read, cascades).",
    "writing_slots": "Host pool slots being written.",
    "unverified_slots": "Host pool slots adopted by a warm restart and not verified yet.",
    "unread_promotion_pins": "Slots pinned by promotions that landed and were not read yet.",
    "held_slots": "Host pool slots held until a tier that must get their block has it.",
}
GLOBAL_COUNTERS = {
    "hit_pending_expired": "(request, key) pairs that stayed HIT_PENDING past the deadline.",
    "promotion_allocation_failures": "Promotions that found no free pool slot.",
    "store_allocation_failures": "Stores that found no free pool slot (no_space).",
    "stores_refused_dirty": "Stores refused (no_space) while held blocks took the room.",
    "promoted_keys": "Keys promoted into the host pool.",
    "promoted_keys_consumed": "Promoted keys that an engine then loaded.",
}


def _pool_levels(t: TieringStatus) -> dict[str, int]:
    return {
        "slots": t.slots,
        "used_slots": t.used_slots,
        "pinned_slots": t.pinned_slots,
        "writing_slots": t.writing_slots,
        "unverified_slots": t.unverified_slots,
        "unread_promotion_pins": t.unread_promotion_pins,
        "held_slots": t.held_slots,
    }


def _global_counts(t: TieringStatus) -> dict[str, int]:
    return {
        "hit_pending_expired": t.hit_pending_expired,
        "promotion_allocation_failures": t.promotion_allocation_failures,
        "store_allocation_failures": t.store_allocation_failures,
        "stores_refused_dirty": t.stores_refused_dirty,
        "promoted_keys": t.promoted_keys,
        "promoted_keys_consumed": t.promoted_keys_consumed,
    }


def _lookups(c: TierCounters) -> dict[str, int]:
    return {
        "hit": c.lookups_hit,
        "hit_pending": c.lookups_hit_pending,
        "retry": c.lookups_retry,
        "miss": c.lookups_miss,
    }


def _jobs(c: TierCounters) -> dict[JobKind, tuple[int, int]]:
    """Submitted and failed, by tier job kind."""
    return {
        JobKind.PROMOTION: (c.promotion_jobs, c.promotion_jobs_failed),
        JobKind.CASCADE: (c.cascade_jobs, c.cascade_jobs_failed),
        JobKind.PROBE: (c.probe_jobs, c.probe_jobs_failed),
        JobKind.DELETE: (c.delete_jobs, c.delete_jobs_failed),
    }


def _cascade_drops(c: TierCounters) -> dict[CascadeDrop, int]:
    return {
        CascadeDrop.EVICTED: c.cascade_dropped_evicted,
        CascadeDrop.TIER_FULL: c.cascade_dropped_tier_full,
        CascadeDrop.RETRY_BOUND: c.cascade_dropped_retry_bound,
        CascadeDrop.TENANT_CAP: c.cascade_dropped_tenant_cap,
    }


WORKER_GAUGE_STATS = frozenset(
    {
        "used_bytes",
        "capacity_bytes",
        "direct_io",
        "kv_handles",
        "queued",
        "releasing",
        "pending_releases",
        "breaker_consecutive_failures",
        "breaker_cooldown_s",
        "breaker_retry_in_s",
        "nodes_followed",
        "nodes_silent",
        "keys_indexed",
        "breakers_open",
    }
)
"""Heartbeat stats that are levels; every other numeric stat is a counter."""
SKIPPED_WORKER_STATS = frozenset({"degraded"})
"""Exported otherwise (``kvoffload_worker_degraded``, from the heartbeat's own flag)."""


class ManagerCollector(Collector):
    """Renders the last published status snapshot as metric families."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: ManagerStatus | None = None
        self._workers: dict[str, _WorkerCounters] = {}

    def publish(self, status: ManagerStatus) -> None:
        with self._lock:
            self._status = status
            for name, info in status.workers.items():
                counters = self._workers.setdefault(name, _WorkerCounters())
                counters.update(info.pid, _worker_counter_stats(info.stats))

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            status = self._status
            worker_totals = {name: c.totals() for name, c in self._workers.items()}
        if status is None:
            return
        yield from _manager_families(status)
        yield from _tier_families(status.tiering)
        yield from _tenant_families(status.tiering.tenants)
        yield from _worker_families(status.workers, worker_totals)
        yield from _warm_restart_families(status.warm_restart)
        yield from _handshake_families(status.client_handshakes_refused)


class _WorkerCounters:
    """A worker's heartbeat counters summed over its incarnations (told apart by pid)."""

    def __init__(self) -> None:
        self._pid: int | None = None
        self._base: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def update(self, pid: int, counters: dict[str, float]) -> None:
        if pid != self._pid:
            for name, value in self._last.items():
                self._base[name] = self._base.get(name, 0) + value
            self._pid = pid
        self._last = counters

    def totals(self) -> dict[str, float]:
        names = sorted(self._base.keys() | self._last.keys())
        return {name: self._base.get(name, 0) + self._last.get(name, 0) for name in names}


def _flat_stats(stats: WorkerStats) -> Iterator[tuple[str, Any]]:
    """A heartbeat's ``WorkerStats`` as one flat list of its fields: the framework's and the
    backend's counters side by side, nested structs flattened (``breaker.state`` ->
    ``breaker_state``). The stats of each medium are its own struct's fields, so this walks
    them by name."""
    parts: list[msgspec.Struct] = [stats.loop]
    if stats.medium is not None:
        parts.append(stats.medium)
    for part in parts:
        for name, value in msgspec.structs.asdict(part).items():
            if isinstance(value, msgspec.Struct):
                for inner, inner_value in msgspec.structs.asdict(value).items():
                    yield f"{name}_{inner}", inner_value
            else:
                yield name, value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _worker_counter_stats(stats: WorkerStats) -> dict[str, float]:
    return {
        name: value
        for name, value in _flat_stats(stats)
        if _is_number(value) and name not in WORKER_GAUGE_STATS and name not in SKIPPED_WORKER_STATS
    }


def _metric_name(stat: str) -> str:
    """Prometheus unit naming: ``_s`` becomes ``_seconds``; counters get ``_total`` once."""
    stat = stat.removesuffix("_total")
    return stat[:-2] + "_seconds" if stat.endswith("_s") else stat


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _alive() -> bool:
    return True


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


def _manager_families(status: ManagerStatus) -> Iterator[Metric]:
    tiering = status.tiering
    yield _gauge("uptime_seconds", "Seconds since the manager started.", status.uptime_s)
    yield _gauge("draining", "1 while the manager drains for shutdown.", int(status.draining))
    yield _gauge(
        "degraded",
        "1 while a configured tier is not serving (its worker down or its index incomplete).",
        int(bool(status.tiers_down)),
    )
    yield _gauge("pool_block_bytes", "Bytes of one host pool slot.", status.pool.block_bytes)
    levels = _pool_levels(tiering)
    for name, doc in POOL_GAUGES.items():
        yield _gauge(f"pool_{name}", doc, levels[name])
    yield _gauge("requests", "Open requests of all clients.", tiering.requests)
    yield _gauge("clients", "Connected client sessions.", status.clients)
    yield _gauge(
        "device_jobs_in_flight", "Device stores and loads in flight.", status.device_jobs_in_flight
    )
    yield _gauge(
        "tier_jobs_in_flight", "Promotions, cascades and probes in flight.", tiering.jobs_in_flight
    )
    yield _gauge(
        "cascade_backlog", "Keys waiting for a cascade, all tiers.", tiering.cascade_backlog
    )
    counts = _global_counts(tiering)
    for name, doc in GLOBAL_COUNTERS.items():
        yield _counter(name, doc, counts[name])
    yield _counter(
        "store_backpressure_seconds",
        "Seconds from a refused store to the next store that got slots.",
        tiering.store_backpressure_s,
    )
    if tiering.promotion_amplification is not None:
        yield _gauge(
            "promotion_amplification",
            "Keys promoted per promoted key loaded.",
            tiering.promotion_amplification,
        )
    yield _counter(
        "worker_restarts", "Worker restarts the manager has seen.", status.worker_restarts_seen
    )
    if status.events is not None:
        yield from _events_families(status.events)


def _events_families(events: EventsStatus) -> Iterator[Metric]:
    yield _gauge("events_active", "1 once the tiers' events are recorded.", int(events.active))
    yield _gauge("events_feed_keys", "Keys of events the feed keeps for clients.", events.feed_keys)
    yield _counter(
        "events_client_resyncs", "Snapshots sent to clients taking events.", events.client_resyncs
    )
    yield _counter("events_stream_batches", "Batches the node stream sent.", events.stream_batches)
    yield _counter(
        "events_stream_dropped_batches",
        "Batches the node stream dropped (its queue full).",
        events.stream_dropped_batches,
    )
    yield _counter(
        "events_stream_resends",
        "Clears and full resends of the node stream after a loss.",
        events.stream_resends,
    )


def _tier_families(tiering: TieringStatus) -> Iterator[Metric]:
    def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
        return CounterMetricFamily(PREFIX + name, doc, labels=["tier", *labels])

    lookups = counter("tier_lookups", "Keys looked up, by tier and result.", ("result",))
    jobs = counter("tier_jobs", "Tier jobs submitted, by kind.", ("kind",))
    jobs_failed = counter("tier_jobs_failed", "Tier jobs that failed, by kind.", ("kind",))
    promoted = counter("tier_promoted_keys", "Keys promoted from the tier into the host pool.")
    cascaded = counter("tier_cascaded_keys", "Keys cascaded from the host pool to the tier.")
    deferred = counter("tier_cascade_keys_deferred", "Cascade keys that waited in the backlog.")
    resubmitted = counter(
        "tier_cascade_keys_resubmitted", "Cascade keys sent again after a failure."
    )
    dropped = counter(
        "tier_cascade_dropped_keys", "Keys given up for the tier, by reason.", ("reason",)
    )
    evictions = counter("tier_evictions", "Blocks evicted from the tier.")
    transfer = counter("tier_transfer_seconds", "Worker time spent on the tier's jobs.")
    active = GaugeMetricFamily(PREFIX + "tier_active_jobs", "Tier jobs in flight.", labels=["tier"])
    for tier, c in tiering.per_tier.items():
        for result, count in _lookups(c).items():
            lookups.add_metric([tier, result], count)
        for kind, (submitted, failed) in _jobs(c).items():
            jobs.add_metric([tier, kind.value], submitted)
            jobs_failed.add_metric([tier, kind.value], failed)
        for reason, count in _cascade_drops(c).items():
            dropped.add_metric([tier, reason.value], count)
        promoted.add_metric([tier], c.promoted_keys_ok)
        cascaded.add_metric([tier], c.cascaded_keys_ok)
        deferred.add_metric([tier], c.cascade_keys_deferred)
        resubmitted.add_metric([tier], c.cascade_keys_resubmitted)
        evictions.add_metric([tier], c.evictions)
        transfer.add_metric([tier], c.transfer_time_s)
        active.add_metric([tier], c.active_jobs)
    yield from (lookups, jobs, jobs_failed, promoted, cascaded, deferred, resubmitted, dropped)
    yield from (evictions, transfer, active)

    def gauge(name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(PREFIX + name, doc, labels=["tier"])

    online = gauge("tier_online", "1 while the tier's worker is connected and its index announced.")
    backlog = gauge("tier_cascade_backlog", "Keys waiting for a cascade to the tier.")
    indexed = gauge("tier_indexed_keys", "Keys the manager knows the tier holds (indexed tiers).")
    verdicts = gauge("tier_verdicts", "Cached probe verdicts (probed tiers).")
    dirty = gauge("tier_dirty_keys", "Blocks in the host pool not yet on the tier.")
    inflight = gauge("tier_cascade_inflight_keys", "Keys of the tier's cascades in flight.")
    state: TierState
    for tier, state in tiering.tiers.items():
        online.add_metric([tier], int(state.online))
        backlog.add_metric([tier], state.cascade_backlog)
        indexed.add_metric([tier], state.indexed_keys)
        verdicts.add_metric([tier], state.verdicts)
        dirty.add_metric([tier], state.dirty_keys)
        inflight.add_metric([tier], state.cascade_inflight_keys)
    yield from (online, backlog, indexed, verdicts, dirty, inflight)


def _worker_families(
    workers: Mapping[str, WorkerStatus], totals: Mapping[str, Mapping[str, float]]
) -> Iterator[Metric]:
    def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(PREFIX + name, doc, labels=["worker", *labels])

    up = gauge("worker_up", "1 for each connected worker.")
    degraded = gauge("worker_degraded", "1 while the worker reports its medium degraded.")
    inflight = gauge("worker_inflight", "Jobs the worker reports in flight.")
    heartbeat = gauge("worker_last_heartbeat_seconds", "Seconds since the worker was last heard.")
    breaker = gauge(
        "worker_breaker_state", "Circuit breaker state of the worker's store (1).", ("state",)
    )
    stat_gauges: dict[str, GaugeMetricFamily] = {}
    for name, info in workers.items():
        up.add_metric([name], 1)
        degraded.add_metric([name], int(info.degraded))
        inflight.add_metric([name], info.inflight)
        heartbeat.add_metric([name], info.last_heartbeat_s)
        for stat, value in _flat_stats(info.stats):
            if stat == "breaker_state":
                breaker.add_metric([name, str(value)], 1)
            elif stat in WORKER_GAUGE_STATS and (_is_number(value) or isinstance(value, bool)):
                family = stat_gauges.setdefault(
                    stat,
                    gauge(f"worker_{_metric_name(stat)}", f"Worker heartbeat stat {stat}."),
                )
                family.add_metric([name], float(value))
    yield from (up, degraded, inflight, heartbeat, breaker, *stat_gauges.values())
    stat_counters: dict[str, CounterMetricFamily] = {}
    for name, counters in totals.items():
        for stat, value in counters.items():
            counter = stat_counters.setdefault(
                stat,
                CounterMetricFamily(
                    f"{PREFIX}worker_{_metric_name(stat)}",
                    f"Worker heartbeat counter {stat}, summed over the worker's restarts.",
                    labels=["worker"],
                ),
            )
            counter.add_metric([name], value)
    yield from stat_counters.values()


def _warm_restart_families(warm: WarmRestartStatus | None) -> Iterator[Metric]:
    if warm is None:
        return
    family = GaugeMetricFamily(
        PREFIX + "warm_restart_slots",
        "Slot headers the manager found at start and what became of them.",
        labels=["outcome"],
    )
    for outcome, value in msgspec.structs.asdict(warm).items():
        family.add_metric([outcome], value)
    yield family


def _tenant_families(tenants: Mapping[str, TenantStatus]) -> Iterator[Metric]:
    """Per tenant, labelled by its id (a digest of its name, never the name; ``none`` for
    requests without a tenant): lookups by result; blocks, bytes, share, evictions and
    refusals per tier."""
    lookups = CounterMetricFamily(
        PREFIX + "tenant_lookup_keys",
        "Keys looked up by the tenant, by result.",
        labels=["tenant", "result"],
    )
    requests = GaugeMetricFamily(
        PREFIX + "tenant_requests", "Open requests of the tenant.", labels=["tenant"]
    )

    def gauge(name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(PREFIX + name, doc, labels=["tenant", "tier"])

    def counter(name: str, doc: str) -> CounterMetricFamily:
        return CounterMetricFamily(PREFIX + name, doc, labels=["tenant", "tier"])

    blocks = gauge("tenant_blocks", "Blocks the tenant holds on the tier.")
    held_bytes = gauge("tenant_bytes", "Bytes the tenant's blocks take on the tier.")
    share = gauge("tenant_share_blocks", "Blocks of the tier no other tenant's traffic takes.")
    evictions = counter("tenant_evictions", "The tenant's blocks evicted from the tier.")
    by_others = counter(
        "tenant_evicted_by_others", "The tenant's blocks evicted for another tenant's traffic."
    )
    refused = counter(
        "tenant_refused_blocks", "The tenant's blocks refused at its cap on the tier."
    )
    for tid, tenant in tenants.items():
        lookups.add_metric([tid, "hit"], tenant.lookups_hit)
        lookups.add_metric([tid, "hit_pending"], tenant.lookups_hit_pending)
        lookups.add_metric([tid, "miss"], tenant.lookups_miss)
        requests.add_metric([tid], tenant.requests)
        for tier, c in tenant.tiers.items():
            blocks.add_metric([tid, tier], c.blocks)
            held_bytes.add_metric([tid, tier], c.bytes)
            share.add_metric([tid, tier], c.share_blocks)
            evictions.add_metric([tid, tier], c.evictions)
            by_others.add_metric([tid, tier], c.evicted_by_others)
            refused.add_metric([tid, tier], c.refused)
    yield from (lookups, requests, blocks, held_bytes, share, evictions, by_others, refused)


def _handshake_families(refused: Mapping[str, int]) -> Iterator[Metric]:
    if not refused:
        return
    family = CounterMetricFamily(
        PREFIX + "client_handshakes_refused",
        "Client connections the CURVE gate of a tcp:// endpoint refused, by reason.",
        labels=["reason"],
    )
    for reason, count in refused.items():
        family.add_metric([reason], count)
    yield family


def _label(value: Any) -> str:
    return str(getattr(value, "value", value))


class MetricsEndpoint:
    """The manager's metrics and their HTTP endpoint (``/metrics`` on ``host``:``port``), with
    ``/healthz`` and ``/readyz`` beside them (``server.health``)."""

    def __init__(
        self, port: int, host: str = "127.0.0.1", supervisor_alive: Callable[[], bool] = _alive
    ) -> None:
        disable_created_metrics()  # no ``_created`` series: the manager's uptime says it
        self._registry = CollectorRegistry()
        self._collector = ManagerCollector()
        self._registry.register(self._collector)
        self.health = Health(supervisor_alive)
        ProcessCollector(registry=self._registry)
        self._calls = Histogram(
            PREFIX + "client_call_duration_seconds",
            "Time the manager spent on a client call, by call (lookup, store, ...); a long "
            "poll's wait is not included.",
            ["call"],
            buckets=CALL_BUCKETS_S,
            registry=self._registry,
        )
        self._jobs = Histogram(
            PREFIX + "job_duration_seconds",
            "Worker jobs from their dispatch to their result, by worker and kind.",
            ["worker", "kind"],
            buckets=JOB_BUCKETS_S,
            registry=self._registry,
        )
        self._job_results = Counter(
            PREFIX + "jobs",
            "Worker job results, by worker, kind and outcome (ok, failed).",
            ["worker", "kind", "outcome"],
            registry=self._registry,
        )
        self._job_bytes = Counter(
            PREFIX + "job_bytes",
            "Bytes moved by worker jobs, by worker and kind.",
            ["worker", "kind"],
            registry=self._registry,
        )
        self._dispatched: dict[int, tuple[str, str, float]] = {}
        self._worker_pids: dict[str, int] = {}
        try:
            self._server = serve_http(host, port, make_wsgi_app(self._registry), self.health)
        except OSError as exc:
            raise FatalStartError(
                f"service.metrics_port = {port}: cannot listen on {host}:{port}: "
                f"{exc.strerror}; stop the process using it or choose another port"
            ) from exc

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def publish(self, status: ManagerStatus) -> None:
        """The manager's current status (``ManagerState.status``)."""
        self._collector.publish(status)
        self.health.publish(status)

    def client_call(self, msg: Any, seconds: float) -> None:
        """One client request handled in ``seconds``."""
        self._calls.labels(type(msg).__struct_config__.tag).observe(seconds)

    def job_sent(self, worker: str, msg: Any) -> None:
        """A message handed to a worker; jobs are timed from here to their result."""
        if isinstance(msg, p.Job):
            self._dispatched[msg.job_id] = (worker, _label(msg.kind), time.monotonic())
            if len(self._dispatched) > MAX_TRACKED_JOBS:
                del self._dispatched[next(iter(self._dispatched))]

    def worker_message(self, worker: str, msg: Any) -> None:
        """A message from a worker: a job result is observed; a new incarnation's hello drops
        the previous one's jobs (the manager fails them)."""
        if isinstance(msg, p.JobDone):
            dispatched = self._dispatched.pop(msg.job_id, None)
            if dispatched is None or dispatched[0] != worker:
                return
            _, kind, sent_at = dispatched
            self._jobs.labels(worker, kind).observe(time.monotonic() - sent_at)
            self._job_results.labels(worker, kind, "ok" if msg.success else "failed").inc()
            self._job_bytes.labels(worker, kind).inc(msg.nbytes)
        elif isinstance(msg, p.WorkerHello) and self._worker_pids.get(worker) != msg.pid:
            self._worker_pids[worker] = msg.pid
            for job_id in [j for j, (w, _, _) in self._dispatched.items() if w == worker]:
                del self._dispatched[job_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
