"""What the manager's parts share: configuration, the tiering library, the two sockets, what is
known of clients, workers and device jobs, and the sends every part uses.

Single-threaded: only the manager's poll loop touches it.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass

import msgspec
import structlog
import zmq

from kvoffload.config import Config
from kvoffload.runtime.runspec import RunSpec
from kvoffload.server.events import EventFeed
from kvoffload.server.eventstream import NodeStream
from kvoffload.server.landings import Landings, LandingWait
from kvoffload.server.metrics import MetricsEndpoint
from kvoffload.server.sessions import ClientSession
from kvoffload.server.sockets import bind_client_socket, bind_job_socket
from kvoffload.server.tenants import DropReplies, disk_capacity_keys, tenant_policy, with_bytes
from kvoffload.server.warmstart import WarmRestart
from kvoffload.server.workers import WorkerRegistry
from kvoffload.tiering import (
    Locality,
    LookupResult,
    Medium,
    TieringLedger,
    TierSpec,
    TransferResult,
    WriteBack,
)
from kvoffload.tiering.types import TieringError, TransferJob
from kvoffload.wire import protocol as p
from kvoffload.wire.status import ManagerStatus, PoolStatus

log = structlog.get_logger()

CPU_WORKER = "cpu"
CASCADE_JOB_BYTES = 4 << 20
"""Bytes of blocks in one cascade job (at least one block): jobs small enough that a tier's
results, and the slots they let go, come back while the rest is written."""
CASCADE_JOBS_PER_THREAD = 2
"""Cascade jobs in flight per writer thread of a tier's worker: one being written, one queued
behind it, so the medium never waits for the manager."""
OBJECT_PIN_SHARE = 0.25
"""Share of the pool's slots that the object tier's cascades in flight may pin: its blocks are
not held (``WriteBack.BEST_EFFORT``), so a slow or hung store never fills the pool."""


class RequestError(Exception):
    """A client call that cannot be served; becomes a typed Error reply."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class DeviceJob:
    """A store or load between a client's KV cache and the pool, run by the cpu worker."""

    identity: bytes
    scoped_req: str
    req_id: str
    kind: p.JobKind
    keys: list[bytes]


@dataclass(slots=True)
class WaitingLookup:
    """A ``Lookup`` with ``wait_ms`` whose reply is held until ``deadline`` (monotonic)."""

    msg: p.Lookup
    deadline: float


def tier_specs(cfg: Config) -> list[TierSpec]:
    """The secondary tiers and their write-back (docs/design/tiering.md, section 4): the disk
    tier holds every block until its cascade landed (``HOLD``); the object tier gets its blocks
    best effort unless ``object.writeback = "hold"``. Cascades in flight follow each worker's
    writer threads (``CASCADE_JOBS_PER_THREAD`` jobs of ``CASCADE_JOB_BYTES`` each); best
    effort, the object tier's stay within ``OBJECT_PIN_SHARE`` of the pool. With tenants
    configured the manager chooses what leaves the disk tier (``TierSpec.capacity_keys``)."""
    job_keys = max(1, CASCADE_JOB_BYTES // cfg.pool.block_bytes)
    specs = []
    if cfg.disk.enabled:
        inflight = job_keys * CASCADE_JOBS_PER_THREAD * cfg.disk.write_threads
        specs.append(
            TierSpec(
                "disk",
                Medium.STORAGE,
                Locality.LOCAL,
                indexed=True,
                max_inflight_cascade_keys=inflight,
                max_cascade_job_keys=job_keys,
                writeback=WriteBack.HOLD,
                capacity_keys=disk_capacity_keys(cfg) if cfg.tenants else 0,
            )
        )
    if cfg.peer.enabled:
        specs.append(TierSpec("peer", Medium.CPU, Locality.REMOTE, indexed=True, stores=False))
    if cfg.object.enabled:
        inflight = job_keys * CASCADE_JOBS_PER_THREAD * cfg.object.io_threads
        if cfg.object.writeback == "best_effort":
            inflight = min(inflight, max(1, int(cfg.pool.num_slots * OBJECT_PIN_SHARE)))
        specs.append(
            TierSpec(
                "object",
                Medium.STORAGE,
                Locality.REMOTE,
                indexed=False,
                max_inflight_cascade_keys=inflight,
                max_cascade_job_keys=job_keys,
                writeback=WriteBack(cfg.object.writeback),
            )
        )
    return specs


class ManagerState:
    def __init__(self, spec: RunSpec, cfg: Config) -> None:
        self.spec = spec
        self.cfg = cfg
        svc = cfg.service
        self.zctx = zmq.Context()
        self.client_sock, self.auth = bind_client_socket(self.zctx, spec.client_endpoint, svc)
        self.job_sock = bind_job_socket(self.zctx, spec.job_endpoint, svc.max_message_bytes)
        self.tiering = TieringLedger(
            cfg.pool.num_slots,
            tier_specs(cfg),
            policy=cfg.pool.eviction_policy,
            hit_pending_deadline_s=svc.hit_pending_deadline_s,
            unread_promotion_cap=int(cfg.pool.unread_promotion_cap * cfg.pool.num_slots),
            probe_timeout_s=cfg.object.verdict_timeout_s,
            track_slot_invalidations=bool(spec.slot_table_name),
            first_job_id=time.time_ns() // 1000,
            tenant_policy=tenant_policy(cfg),
        )
        for (
            tier
        ) in self.tiering.tiers:  # online once its worker has said hello and announced its index
            self.tiering.set_tier_online(tier.name, False)
        self.warm = WarmRestart.open(spec, cfg, self.tiering)
        self.worker_names = {CPU_WORKER, *(t.name for t in self.tiering.tiers)}
        self.registry = WorkerRegistry(svc.heartbeat_timeout_s)
        self.sessions: dict[bytes, ClientSession] = {}
        self.device_jobs: dict[int, DeviceJob] = {}
        self.pending_resets: list[tuple[bytes, int, float]] = []
        self.drop_replies = DropReplies()
        self.waiting_lookups: dict[bytes, WaitingLookup] = {}
        self.landings = Landings()
        self.draining = False
        self.started_at = time.monotonic()
        self.supervisor_pid = os.getppid()
        self.metrics = (
            MetricsEndpoint(svc.metrics_port, svc.metrics_host, self.supervisor_alive)
            if svc.metrics_port
            else None
        )
        # a restarted manager numbers its stream from 0 again: its followers tell by the run
        self.node_stream = (
            NodeStream(cfg.events, svc, f"{spec.run_id}.{secrets.token_hex(4)}")
            if cfg.events.endpoint
            else None
        )
        self.events = EventFeed(self.tiering, cfg.events.feed_keys, self.node_stream)

    def supervisor_alive(self) -> bool:
        """The supervisor that started this manager is still its parent."""
        return os.getppid() == self.supervisor_pid

    def idle(self) -> bool:
        """No device job and no tier job in flight."""
        return not self.device_jobs and self.tiering.jobs_in_flight() == 0

    def clear_invalidated_slots(self) -> None:
        """Clear the slot headers of slots freed or reassigned; runs before any slot number
        leaves the manager, so no header describes a slot that is being rewritten."""
        if self.warm is not None:
            self.warm.clear_invalidated()

    def send_worker(self, name: str, msg: p.ManagerMessage) -> bool:
        """False when the message could not be handed to the worker's connection (gone, or its
        queue full): the caller fails the job at once instead of waiting for a timeout."""
        self.clear_invalidated_slots()
        try:
            self.job_sock.send_multipart([name.encode(), p.encode(msg)], zmq.NOBLOCK)
            if self.metrics is not None:
                self.metrics.job_sent(name, msg)
            return True
        except zmq.ZMQError as exc:
            log.error("worker_send_failed", worker=name, kind=type(msg).__name__, error=str(exc))
            return False

    def reply(self, identity: bytes, msg: p.ClientReply) -> None:
        self.clear_invalidated_slots()
        try:
            self.client_sock.send_multipart([identity, p.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("client_send_failed", error=str(exc))

    def dispatch_tier_jobs(self) -> None:
        """Send the tiering library's new submissions and touched keys to the tier workers; a
        job whose worker is gone or unreachable fails at once."""
        for job in self.tiering.take_submissions():
            tier = self.tiering.tiers[job.tier].name
            worker = self.registry.live(tier)
            if worker is None:
                log.warning("tier_job_failed_no_worker", tier=tier, job_id=job.job_id)
                self.apply_tier_result(tier, TransferResult(job.job_id, False))
                continue
            msg = p.Job(
                job.job_id,
                job.kind,
                job.keys,
                job.slots,
                tenants=job.tenants,
                purge_tenant=job.purge_tenant,
                landing=p.LandingTarget(job.landing.endpoint, job.landing.ticket)
                if job.landing is not None
                else None,
            )
            if self.send_worker(tier, msg):
                worker.jobs.add(job.job_id)
            else:
                self.apply_tier_result(tier, TransferResult(job.job_id, False))
        for secondary in self.tiering.tiers:
            touched = self.tiering.take_touched(secondary.name)
            if touched and self.registry.live(secondary.name) is not None:
                self.send_worker(secondary.name, p.TouchKeys(touched))
        self.settle_drops()

    def apply_tier_result(self, tier: str, result: TransferResult) -> TransferJob:
        """Hand a tier job's result to the tiering library, then settle the landing waits of
        its keys (TieringError, changing nothing, for a result the library refuses)."""
        job = self.tiering.apply_result(tier, result)
        self.settle_landings(self.landings.over(job.job_id))
        return job

    def apply_tier_progress(self, tier: str, job_id: int, keys: list[bytes]) -> None:
        """Keys of a running promotion that landed: ready now, and pinned for the clients
        that wait for them."""
        landed = self.tiering.apply_progress(tier, job_id, keys)
        self.settle_landings(self.landings.landed(job_id, landed))

    def fail_tier_jobs(self, tier: str) -> list[int]:
        """Every job in flight on the tier's worker fails (it died); returns their ids."""
        failed = self.tiering.fail_worker_jobs(tier)
        for job_id in failed:
            self.settle_landings(self.landings.over(job_id))
        return failed

    def settle_landings(self, waits: list[LandingWait]) -> None:
        """Waits whose promotion reported their key: a key that landed in the awaited slot
        is pinned for the client (``landings``), or pinned and released at once when the
        client already released it; any other is lost, and the client's later release of it
        is accepted without effect."""
        primary = self.tiering.primary
        for wait in waits:
            session = self.sessions.get(wait.identity)
            if session is None:
                continue
            key = wait.key
            landed = primary.lookup(key) is LookupResult.HIT and primary.slot_of(key) == wait.slot
            if landed:
                try:
                    self.tiering.prepare_load(wait.scoped, [key])
                except TieringError:
                    landed = False  # its request finished meanwhile
            if not landed:
                if not wait.released:
                    session.landing_lost.setdefault(wait.scoped, set()).add(key)
            elif wait.released:
                self.tiering.complete_load([key])
            else:
                session.add_pins([key])

    def settle_drops(self) -> None:
        """Answer the ``TenantDrop`` calls whose drop has finished."""
        self.drop_replies.settle(self.tiering.take_finished_drops(), self.reply)

    def run_tier_step(self) -> None:
        """One step of the tiering library (promotions, cascade retries, probes) and the sends
        it produced; a no-op when nothing is pending."""
        if not self.tiering.has_pending_work():
            return
        self.tiering.end_step()
        self.dispatch_tier_jobs()

    def settle_resets(self, now: float) -> None:
        """Answer the pending ``ResetCache`` calls: once no job is in flight and no online tier
        has a waiting cascade the cache is reset and each gets ``Ok``; each one past its deadline
        gets ``reset_timeout``."""
        if not self.pending_resets:
            return
        if self.idle() and self.tiering.cascade_backlog(online_only=True) == 0:
            self.tiering.reset_cache()
            for session in self.sessions.values():
                session.pinned.clear()
                session.open_stores.clear()
            log.info("cache_reset", callers=len(self.pending_resets))
            for identity, rid, _ in self.pending_resets:
                self.reply(identity, p.Ok(rid))
            self.pending_resets.clear()
            return
        for entry in [e for e in self.pending_resets if now >= e[2]]:
            self.pending_resets.remove(entry)
            self.reply(
                entry[0],
                p.Error(entry[1], p.ErrorCode.RESET_TIMEOUT, "jobs or cascades still in flight"),
            )

    def answer_poll(self, session: ClientSession, force: bool = False) -> None:
        """Answer the session's waiting poll with its queued events (or none, when forced)."""
        poll = session.pending_poll
        if poll is None or not (session.events or force):
            return
        events = list(session.events)
        session.events.clear()
        session.pending_poll = None
        self.reply(session.identity, p.JobsFinished(poll.rid, events))

    def status(self, now: float) -> ManagerStatus:
        """The manager's status, built from the parts' typed snapshots."""
        tiering = self.tiering.snapshot()
        return ManagerStatus(
            pid=os.getpid(),
            uptime_s=round(now - self.started_at, 3),
            draining=self.draining,
            pool=PoolStatus(name=self.spec.pool_name, block_bytes=self.cfg.pool.block_bytes),
            tiering=msgspec.structs.replace(tiering, tenants=with_bytes(tiering.tenants, self.cfg)),
            device_jobs_in_flight=len(self.device_jobs),
            workers=self.registry.snapshot(now),
            worker_restarts_seen=self.registry.restarts_seen,
            clients=len(self.sessions),
            warm_restart=self.warm.snapshot() if self.warm is not None else None,
            tiers_down=[t.name for t in self.tiering.tiers if not t.online],
            events=self.events.status(),
            client_handshakes_refused=self.auth.counts() if self.auth is not None else {},
        )
