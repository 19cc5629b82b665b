"""The manager process: one zmq.Poller loop that carries the tiering library over ZeroMQ.

It owns the client ROUTER and the job ROUTER, assigns job ids (the tiering library's counter),
sends device jobs to the cpu worker and tier jobs to the disk/object workers, applies their
results, watches worker heartbeats and client leases, and delivers each finished device job to
its client exactly once (long-poll). It never maps the pool's bytes.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, replace

import structlog
import zmq

from .. import protocol as p
from ..config import Config
from ..kvcache import CUDA_IPC_KIND, SHM_KIND, handle_problem, segment_problem
from ..rundir import is_run_segment
from ..runspec import RunSpec
from ..shmseg import stat_segment
from ..tiering import (
    JobKind,
    JobResult,
    Locality,
    LookupResult,
    Medium,
    ReqContext,
    TieringManager,
    TierSpec,
)
from ..tiering.types import TieringError
from .metrics import MetricsEndpoint
from .sessions import ClientSession, PendingPoll
from .sockets import bind_client_socket, bind_job_socket
from .warmstart import WarmRestart
from .workers import WorkerRegistry

log = structlog.get_logger()

CPU_WORKER = "cpu"
MAX_KEYS_PER_CALL = 65536
JOB_KIND_NAMES = {JobKind.PROMOTION: "promote", JobKind.CASCADE: "cascade", JobKind.PROBE: "probe"}


class RequestError(Exception):
    """A client call that cannot be served; becomes a typed Error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class DeviceJob:
    identity: bytes
    scoped_req: str
    req_id: str
    kind: str  # "store" | "load"
    keys: list[bytes]


CASCADE_PIN_SHARE = 0.25
"""Share of the pool's slots that cascades in flight may pin, all tiers together; the other
keys to cascade wait unpinned, so the pool never fills with them."""


def tier_specs(cfg: Config) -> list[TierSpec]:
    specs = []
    if cfg.disk.enabled:
        specs.append(TierSpec("disk", Medium.STORAGE, Locality.LOCAL, indexed=True))
    if cfg.object.enabled:
        specs.append(TierSpec("object", Medium.STORAGE, Locality.REMOTE, indexed=False))
    pins = max(1, int(cfg.pool.num_slots * CASCADE_PIN_SHARE) // max(1, len(specs)))
    return [replace(spec, max_inflight_cascade_keys=pins) for spec in specs]


class ManagerServer:
    def __init__(self, spec: RunSpec, cfg: Config) -> None:
        self.spec = spec
        self.cfg = cfg
        svc = cfg.service
        self.zctx = zmq.Context()
        self.client_sock, self._auth = bind_client_socket(self.zctx, spec.client_endpoint, svc)
        self.job_sock = bind_job_socket(self.zctx, spec.job_endpoint, svc.max_message_bytes)
        self.tiering = TieringManager(
            cfg.pool.num_slots,
            tier_specs(cfg),
            policy=cfg.pool.eviction_policy,
            hit_pending_deadline_s=svc.hit_pending_deadline_s,
            unread_promotion_cap=int(cfg.pool.unread_promotion_cap * cfg.pool.num_slots),
            probe_timeout_s=cfg.object.verdict_timeout_s,
            track_slot_invalidations=bool(spec.slot_table_name),
            first_job_id=time.time_ns() // 1000,
        )
        for tier in self.tiering.tiers:  # online once its worker has said hello and announced its index
            self.tiering.set_tier_online(tier.name, False)
        self.warm = WarmRestart.open(spec, cfg, self.tiering)
        self.service_segments = _segment_ids([spec.pool_name, spec.slot_table_name])
        self.worker_names = {CPU_WORKER, *(t.name for t in self.tiering.tiers)}
        self.registry = WorkerRegistry(svc.heartbeat_timeout_s)
        self.sessions: dict[bytes, ClientSession] = {}
        self.device_jobs: dict[int, DeviceJob] = {}
        self.kv_handles: dict[str, tuple[bytes, p.KVHandle]] = {}
        # what the last cpu worker said it can do; None before its first hello
        self.cpu_capabilities: frozenset[str] | None = None
        self.pending_resets: list[tuple[bytes, int, float]] = []
        self.draining = False
        self.stopping = False
        self._next_client = 1
        self._handlers = {
            p.Connect: self._on_connect,
            p.RegisterKV: self._on_register_kv,
            p.NewRequest: self._on_new_request,
            p.Lookup: self._on_lookup,
            p.Load: self._on_load,
            p.Store: self._on_store,
            p.PrepareStore: self._on_prepare_store,
            p.CompleteStore: self._on_complete_store,
            p.PrepareLoad: self._on_prepare_load,
            p.CompleteLoad: self._on_complete_load,
            p.Touch: self._on_touch,
            p.FinishRequest: self._on_finish_request,
            p.EndStep: self._on_end_step,
            p.ResetCache: self._on_reset_cache,
            p.Poll: self._on_poll,
            p.Status: self._on_status,
            p.Disconnect: self._on_disconnect,
        }
        self.metrics = MetricsEndpoint(svc.metrics_port) if svc.metrics_port else None
        self.started_at = time.monotonic()

    # ---- main loop ------------------------------------------------------------------------

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._request_drain)
        signal.signal(signal.SIGINT, self._request_drain)
        poller = zmq.Poller()
        poller.register(self.client_sock, zmq.POLLIN)
        poller.register(self.job_sock, zmq.POLLIN)
        log.info("manager_started", client_endpoint=self.spec.client_endpoint, tiers=[t.name for t in self.tiering.tiers])
        drain_deadline = None
        last_housekeeping = 0.0
        while True:
            busy = self.tiering.has_pending_work() or self.device_jobs or self.pending_resets
            events = dict(poller.poll(5 if busy else 50))
            if self.job_sock in events:
                self._drain_socket(self.job_sock, self._on_job_frames)
            if self.client_sock in events:
                self._drain_socket(self.client_sock, self._on_client_frames)
            self._end_step()
            self._clear_invalidated_slots()
            now = time.monotonic()
            if now - last_housekeeping >= 0.02:
                last_housekeeping = now
                self._housekeeping(now)
            if self.draining:
                drain_deadline = drain_deadline or now + self.cfg.supervisor.drain_timeout_s
                idle = not self.device_jobs and self.tiering.jobs_in_flight() == 0
                if idle or now >= drain_deadline:
                    self._shutdown(idle)
                    return

    def _request_drain(self, signum, _frame) -> None:
        if not self.draining:
            log.info("manager_draining", signal=signal.Signals(signum).name)
        self.draining = True

    def _drain_socket(self, sock: zmq.Socket, handler) -> None:
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handler(frames)
            except Exception:
                log.exception("message_handling_crashed", channel="jobs" if sock is self.job_sock else "clients")

    def _housekeeping(self, now: float) -> None:
        for worker in self.registry.expired(now):
            self._fail_worker(worker.name, "heartbeat_timeout")
        self._expire_leases(now)
        self._answer_due_polls(now)
        self._try_resets(now)
        if self.metrics is not None:
            self.metrics.publish(self.status(now))

    def _shutdown(self, idle: bool) -> None:
        log.info(
            "manager_stopping",
            drained=idle,
            device_jobs=len(self.device_jobs),
            tier_jobs=self.tiering.jobs_in_flight(),
        )
        for name in list(self.registry.workers):
            self._send_worker(name, p.Control(action="shutdown"))
        if self.metrics is not None:
            self.metrics.close()
        if self._auth is not None:
            self._auth.stop()
        self.client_sock.close(linger=0)
        self.job_sock.close(linger=200)
        self.zctx.term()
        if self.warm is not None:
            self.warm.close()

    # ---- tier jobs ------------------------------------------------------------------------

    def _end_step(self) -> None:
        if not self.tiering.has_pending_work():
            return
        self.tiering.end_step()
        self._dispatch_tier_jobs()

    def _dispatch_tier_jobs(self) -> None:
        for job in self.tiering.take_submissions():
            tier = self.tiering.tiers[job.tier].name
            worker = self.registry.live(tier)
            if worker is None:
                log.warning("tier_job_failed_no_worker", tier=tier, job_id=job.job_id)
                self.tiering.apply_result(tier, JobResult(job.job_id, False))
                continue
            msg = p.Job(job.job_id, JOB_KIND_NAMES[job.kind], job.keys, job.slots)
            if self._send_worker(tier, msg):
                worker.jobs.add(job.job_id)
            else:
                self.tiering.apply_result(tier, JobResult(job.job_id, False))
        for tier in self.tiering.tiers:
            touched = self.tiering.take_touched(tier.name)
            if touched and self.registry.live(tier.name) is not None:
                self._send_worker(tier.name, p.TouchKeys(touched))

    def _clear_invalidated_slots(self) -> None:
        """Clear the slot headers of slots freed or reassigned; runs before any slot number
        leaves the manager, so no header describes a slot that is being rewritten."""
        if self.warm is not None:
            self.warm.clear_invalidated()

    def _send_worker(self, name: str, msg) -> bool:
        """False when the message could not be handed to the worker's connection (gone, or its
        queue full): the caller fails the job at once instead of waiting for a timeout."""
        self._clear_invalidated_slots()
        try:
            self.job_sock.send_multipart([name.encode(), p.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            log.error("worker_send_failed", worker=name, kind=type(msg).__name__, error=str(exc))
            return False

    def _fail_worker(self, name: str, reason: str) -> None:
        """Every job in flight on the worker fails: tier jobs through the tiering library, device
        jobs through complete_store/complete_load with a failure event to their client."""
        failed_tier_jobs: list[int] = []
        if name == CPU_WORKER:
            for job_id in list(self.device_jobs):
                self._finish_device_job(job_id, False, None, reason)
            if self.warm is not None:
                self.warm.verify_lost()
        else:
            self.tiering.set_tier_online(name, False)
            failed_tier_jobs = self.tiering.fail_worker_jobs(name)
        log.error("worker_jobs_failed", worker=name, reason=reason, tier_jobs=len(failed_tier_jobs))

    # ---- job channel ----------------------------------------------------------------------

    def _on_job_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.warning("bad_worker_frame", parts=len(frames))
            return
        identity, frame = frames
        name = identity.decode(errors="replace")
        try:
            msg = p.decode_worker_message(frame)
        except p.ProtocolError as exc:
            log.warning("bad_worker_message", worker=name, error=str(exc))
            return
        now = time.monotonic()
        if isinstance(msg, p.WorkerHello):
            self._on_hello(name, msg, now)
            return
        worker = self.registry.seen(name, now)
        if worker is None:
            log.warning("message_from_unknown_worker", worker=name, kind=type(msg).__name__)
            self._send_worker(name, p.Control(action="hello"))
            return
        if isinstance(msg, p.JobDone):
            self._on_job_done(worker, msg)
        elif isinstance(msg, p.IndexUpdate):
            if name != CPU_WORKER:
                self.tiering.apply_index_update(name, msg.added, msg.removed)
                if msg.complete:
                    self.tiering.set_tier_online(name, True)
            worker.index_complete = worker.index_complete or msg.complete
        elif isinstance(msg, p.Heartbeat):
            if msg.degraded != worker.degraded:
                log.warning("worker_degraded" if msg.degraded else "worker_recovered", worker=name)
            worker.degraded = msg.degraded
            worker.inflight = msg.inflight
            worker.stats = msg.stats

    def _on_hello(self, name: str, hello: p.WorkerHello, now: float) -> None:
        if hello.version != p.PROTOCOL_VERSION:
            reason = f"protocol version {hello.version} != manager's {p.PROTOCOL_VERSION}"
        elif name != hello.worker or name not in self.worker_names:
            reason = f"unknown worker {name!r}; expected one of {sorted(self.worker_names)}"
        else:
            reason = ""
        if reason:
            log.error("worker_refused", worker=name, reason=reason)
            self._send_worker(name, p.HelloAck(p.PROTOCOL_VERSION, False, reason))
            return
        known = self.registry.live(name)
        if known is not None and known.pid == hello.pid:
            known.last_seen = now
            self._send_worker(name, p.HelloAck(p.PROTOCOL_VERSION, True))
            return
        previous = self.registry.hello(name, hello.pid, hello.medium, hello.capabilities, now)
        if previous is not None:
            log.warning("worker_restarted", worker=name, old_pid=previous.pid, new_pid=hello.pid)
            self._fail_worker(name, "worker_restarted")
        if name != CPU_WORKER:
            self.tiering.set_tier_online(name, False)
            self.tiering.reset_tier_index(name)
        self._send_worker(name, p.HelloAck(p.PROTOCOL_VERSION, True))
        if name == CPU_WORKER:
            self.cpu_capabilities = frozenset(hello.capabilities)
            for owner, handle in list(self.kv_handles.values()):
                if self._cpu_serves(handle):
                    self._send_worker(name, p.AttachKV(handle))
                else:
                    self._drop_handle(owner, handle.handle_id, "the cpu worker cannot serve it")
            self._send_verify_jobs()
        log.info("worker_connected", worker=name, worker_pid=hello.pid, medium=hello.medium)

    def _send_verify_jobs(self) -> None:
        """Ask the cpu worker to verify the blocks adopted from the slot headers (warm restart)."""
        if self.warm is None:
            return
        worker = self.registry.live(CPU_WORKER)
        for job in self.warm.verify_jobs():
            if worker is None or not self._send_worker(CPU_WORKER, job):
                self.warm.verify_lost()
                return
            worker.jobs.add(job.job_id)

    def _on_job_done(self, worker, done: p.JobDone) -> None:
        worker.jobs.discard(done.job_id)
        if done.job_id in self.device_jobs and worker.name == CPU_WORKER:
            self._finish_device_job(done.job_id, done.success, done.successful_keys, done.error)
            return
        if self.warm is not None and worker.name == CPU_WORKER and self.warm.owns(done.job_id):
            self.warm.verify_done(done.job_id, done.success, done.successful_keys)
            return
        try:
            self.tiering.apply_result(
                worker.name,
                JobResult(
                    done.job_id, done.success, done.successful_keys, done.transfer_s,
                    done.absent_keys, done.full_keys,
                ),
            )
        except TieringError as exc:
            log.warning("job_result_rejected", worker=worker.name, job_id=done.job_id, error=str(exc))
            return
        if not done.success:
            log.warning("tier_job_failed", tier=worker.name, job_id=done.job_id, error=done.error)
        self._dispatch_tier_jobs()

    def _finish_device_job(self, job_id: int, success: bool, successful_keys, error: str) -> None:
        job = self.device_jobs.pop(job_id)
        try:
            if job.kind == "store":
                self.tiering.complete_store(job.scoped_req, job.keys, success, successful_keys)
            else:
                self.tiering.complete_load(job.keys)
        except TieringError as exc:
            log.error("device_job_result_rejected", job_id=job_id, error=str(exc))
            success, successful_keys, error = False, None, f"{exc.code}: {exc}"
        self._dispatch_tier_jobs()
        session = self.sessions.get(job.identity)
        if session is None:
            return
        session.device_jobs.discard(job_id)
        ok = None if success else list(successful_keys or [])
        session.events.append(
            p.JobFinished(job_id, job.req_id, job.kind, success, ok, error)
        )
        self._answer_poll(session)

    # ---- client channel -------------------------------------------------------------------

    def _on_client_frames(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            self._reply(identity, p.Error(-1, "bad_message", f"expected one frame, got {len(frames) - 1}"))
            return
        frame = frames[1]
        try:
            msg = p.decode_client_request(frame)
        except p.ProtocolError as exc:
            log.warning("bad_client_message", error=str(exc)[:200])
            self._reply(identity, p.Error(p.request_id_of(frame), "bad_message", str(exc)[:500]))
            return
        session = self.sessions.get(identity)
        if session is None and not isinstance(msg, p.Connect):
            self._reply(identity, p.Error(msg.rid, "not_connected", "send Connect first"))
            return
        if session is not None:
            session.last_seen = time.monotonic()
        try:
            reply = self._handlers[type(msg)](identity, session, msg)
        except RequestError as exc:
            reply = p.Error(msg.rid, exc.code, str(exc))
        except TieringError as exc:
            reply = p.Error(msg.rid, exc.code, str(exc))
        except Exception as exc:
            log.exception("client_request_crashed", kind=type(msg).__name__)
            reply = p.Error(msg.rid, "internal", f"{type(exc).__name__}: {exc}")
        if reply is not None:
            self._reply(identity, reply)

    def _reply(self, identity: bytes, msg) -> None:
        self._clear_invalidated_slots()
        try:
            self.client_sock.send_multipart([identity, p.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("client_send_failed", error=str(exc))

    def _check_keys(self, keys: list[bytes]) -> None:
        if len(keys) > MAX_KEYS_PER_CALL:
            raise RequestError("too_many_keys", f"{len(keys)} keys > {MAX_KEYS_PER_CALL}")
        lo, hi = self.cfg.pool.key_bytes_min, self.cfg.pool.key_bytes_max
        for key in keys:
            if not lo <= len(key) <= hi:
                raise RequestError("bad_key", f"key of {len(key)} bytes outside {lo}..{hi}")

    def _check_writable(self) -> None:
        if self.draining:
            raise RequestError("draining", "the service is shutting down")

    def _scoped(self, session: ClientSession, req_id: str) -> str:
        scoped = session.scoped(req_id)
        if scoped not in session.requests:
            raise RequestError("unknown_request", f"unknown request {req_id!r}")
        return scoped

    def _device_blocks(self, session: ClientSession, handle_id: str, keys, blocks) -> p.KVHandle:
        owner_handle = self.kv_handles.get(handle_id)
        if owner_handle is None or owner_handle[0] != session.identity:
            raise RequestError("unknown_handle", f"KV handle {handle_id!r} is not registered by this client")
        handle = owner_handle[1]
        if len(blocks) != len(keys):
            raise RequestError("bad_request", f"{len(keys)} keys but {len(blocks)} device blocks")
        for block in blocks:
            if not 0 <= block < handle.num_blocks:
                raise RequestError("block_out_of_range", f"device block {block} outside 0..{handle.num_blocks - 1}")
        return handle

    def _on_connect(self, identity, session, msg: p.Connect):
        if msg.version != p.PROTOCOL_VERSION:
            return p.Error(msg.rid, "version_mismatch", f"client protocol {msg.version} != manager's {p.PROTOCOL_VERSION}")
        if session is None:
            client_id = f"c{self._next_client}"
            self._next_client += 1
            session = ClientSession(identity, client_id, msg.client_name, time.monotonic())
            self.sessions[identity] = session
            log.info("client_connected", client_id=client_id, client_name=msg.client_name)
        pool = self.cfg.pool
        return p.Connected(
            msg.rid,
            p.PROTOCOL_VERSION,
            session.client_id,
            pool.num_slots,
            pool.block_bytes,
            pool.key_bytes_min,
            pool.key_bytes_max,
            self.spec.pool_name,
            [t.name for t in self.tiering.tiers],
            os.getpid(),
        )

    def _on_register_kv(self, identity, session: ClientSession, msg: p.RegisterKV):
        handle = msg.handle
        owner = self.kv_handles.get(handle.handle_id)
        if owner is not None and owner[0] != identity:
            raise RequestError("handle_taken", f"KV handle {handle.handle_id!r} belongs to another client")
        if handle.kind not in (SHM_KIND, CUDA_IPC_KIND):
            raise RequestError("bad_request", f"unknown KV handle kind {handle.kind!r}")
        problem = handle_problem(handle, self.cfg.pool.block_bytes)
        if not problem and handle.kind == SHM_KIND:
            problem = self._shm_handle_problem(handle)
        if problem:
            raise RequestError("bad_handle", f"KV handle {handle.handle_id!r}: {problem}")
        if not self._cpu_serves(handle):
            raise RequestError(
                "handle_unsupported",
                f"KV handle {handle.handle_id!r}: no worker can serve {handle.kind} handles "
                "(the cpu worker has no CUDA device); register a shared-memory KV cache instead",
            )
        self.kv_handles[handle.handle_id] = (identity, handle)
        session.handles.add(handle.handle_id)
        if self.registry.live(CPU_WORKER) is not None:
            self._send_worker(CPU_WORKER, p.AttachKV(handle))
        return p.Ok(msg.rid)

    def _cpu_serves(self, handle: p.KVHandle) -> bool:
        """False when the cpu worker said it cannot serve handles of this kind; True while no
        cpu worker has said anything yet (its hello decides then)."""
        return self.cpu_capabilities is None or handle.kind in self.cpu_capabilities

    def _drop_handle(self, identity: bytes, handle_id: str, reason: str) -> None:
        self.kv_handles.pop(handle_id, None)
        session = self.sessions.get(identity)
        if session is not None:
            session.handles.discard(handle_id)
        log.error("kv_handle_dropped", handle_id=handle_id, reason=reason)

    def _shm_handle_problem(self, handle: p.KVHandle) -> str:
        """Why the segment of an shm handle cannot be a KV cache: a segment of the service (by
        name, or by identity under another name), missing, or too small for its tensors. The
        segment is opened read-only and stat'ed, never mapped."""
        name = handle.shm_name
        if is_run_segment(name):
            return f"{name} is a segment of the service (host pool, slot header table), not a KV cache"
        try:
            st = stat_segment(name, "shm segment")
        except (OSError, ValueError) as exc:
            return str(exc)
        if (st.st_dev, st.st_ino) in self.service_segments:
            return f"{name} is another name of a segment of the service, not a KV cache"
        return segment_problem(handle, st.st_size)

    def _on_new_request(self, identity, session: ClientSession, msg: p.NewRequest):
        scoped = session.scoped(msg.req_id)
        if self.tiering.has_request(scoped):
            raise RequestError(
                "duplicate_request", f"request {msg.req_id!r} is active or still finishing its stores"
            )
        policy = self.tiering.on_new_request(ReqContext.from_params(scoped, msg.params))
        session.requests.add(scoped)
        return p.NewRequestReply(msg.rid, bool(policy))

    def _on_lookup(self, identity, session, msg: p.Lookup):
        self._check_keys(msg.keys)
        scoped = self._scoped(session, msg.req_id)
        reply = self.tiering.lookup(scoped, msg.keys)
        results = bytes(reply.results)
        slots: list[int] = []
        checksums: list[int] = []
        if msg.pin:
            hit_keys = [k for k, r in zip(msg.keys, reply.results) if r is LookupResult.HIT]
            pinned = iter(self.tiering.prepare_load(scoped, hit_keys) if hit_keys else [])
            session.add_pins(hit_keys)
            slots = [next(pinned) if r is LookupResult.HIT else -1 for r in reply.results]
            warm = self.warm
            checksums = [
                warm.checksum_of(slot, key) if warm is not None and slot >= 0 else 0
                for key, slot in zip(msg.keys, slots)
            ]
        return p.LookupReply(
            msg.rid,
            results,
            bytes(reply.reasons),
            reply.hit_prefix,
            reply.ready_prefix,
            slots,
            checksums,
        )

    def _device_request(self, session: ClientSession, msg: p.Store | p.Load) -> str:
        """Checks shared by Store and Load; returns the scoped request id."""
        self._check_writable()
        self._check_keys(msg.keys)
        scoped = self._scoped(session, msg.req_id)
        self._device_blocks(session, msg.handle_id, msg.keys, msg.device_blocks)
        if self.registry.live(CPU_WORKER) is None:
            raise RequestError("worker_unavailable", "the cpu worker is not connected")
        return scoped

    def _on_store(self, identity, session: ClientSession, msg: p.Store):
        scoped = self._device_request(session, msg)
        out = self.tiering.prepare_store(scoped, msg.keys)
        if out is None:
            raise RequestError("no_space", "no primary slots can be freed for this store")
        if not out.keys_to_store:
            return p.JobAccepted(msg.rid, None, [], out.evicted)
        block_of = dict(zip(reversed(msg.keys), reversed(msg.device_blocks)))
        blocks = [block_of[k] for k in out.keys_to_store]
        job_id = self._submit_device_job(
            session,
            scoped,
            msg.req_id,
            "store",
            p.Job(0, "device_store", out.keys_to_store, out.slots, blocks, msg.handle_id),
        )
        return p.JobAccepted(msg.rid, job_id, out.keys_to_store, out.evicted)

    def _on_load(self, identity, session: ClientSession, msg: p.Load):
        scoped = self._device_request(session, msg)
        slots = self.tiering.prepare_load(scoped, msg.keys)
        job_id = self._submit_device_job(
            session,
            scoped,
            msg.req_id,
            "load",
            p.Job(0, "device_load", msg.keys, slots, msg.device_blocks, msg.handle_id),
        )
        return p.JobAccepted(msg.rid, job_id, list(msg.keys))

    def _submit_device_job(self, session, scoped: str, req_id: str, kind: str, job: p.Job) -> int:
        """Track and send a device job; if it cannot be sent it finishes at once as failed
        (its event still reaches the client exactly once)."""
        job.job_id = self.tiering.next_job_id()
        self.device_jobs[job.job_id] = DeviceJob(session.identity, scoped, req_id, kind, list(job.keys))
        session.device_jobs.add(job.job_id)
        if self._send_worker(CPU_WORKER, job):
            self.registry.live(CPU_WORKER).jobs.add(job.job_id)
        else:
            self._finish_device_job(job.job_id, False, None, "worker_unreachable")
        return job.job_id

    def _on_prepare_store(self, identity, session: ClientSession, msg: p.PrepareStore):
        self._check_writable()
        self._check_keys(msg.keys)
        scoped = self._scoped(session, msg.req_id)
        out = self.tiering.prepare_store(scoped, msg.keys)
        if out is None:
            raise RequestError("no_space", "no primary slots can be freed for this store")
        if out.keys_to_store:
            session.add_open_store(scoped, out.keys_to_store)
        return p.Slots(msg.rid, out.keys_to_store, out.slots, out.evicted)

    def _on_complete_store(self, identity, session: ClientSession, msg: p.CompleteStore):
        """Allowed after the request finished: a store prepared before may complete later."""
        self._check_keys(msg.keys)
        scoped = session.scoped(msg.req_id)
        if msg.checksums is not None and len(msg.checksums) != len(msg.keys):
            raise RequestError("bad_request", f"{len(msg.keys)} keys but {len(msg.checksums)} checksums")
        if not session.close_open_store(scoped, msg.keys):
            raise RequestError("not_prepared", "no prepared store with these keys for this request")
        self.tiering.complete_store(scoped, msg.keys, msg.success, msg.successful_keys)
        if msg.checksums is not None and self.warm is not None:
            self._stamp_landed(msg.keys, msg.checksums)
        self._dispatch_tier_jobs()
        return p.Ok(msg.rid)

    def _stamp_landed(self, keys: list[bytes], checksums: list[int]) -> None:
        """Stamp the slot headers of the keys of a direct store that are now ready."""
        generation = self.tiering.next_job_id()
        for key, checksum in zip(keys, checksums):
            if self.tiering.primary.lookup(key) is LookupResult.HIT:
                self.warm.stamp(self.tiering.primary.slot_of(key), key, checksum, generation)

    def _on_prepare_load(self, identity, session: ClientSession, msg: p.PrepareLoad):
        self._check_writable()
        self._check_keys(msg.keys)
        slots = self.tiering.prepare_load(self._scoped(session, msg.req_id), msg.keys)
        session.add_pins(msg.keys)
        return p.Slots(msg.rid, msg.keys, slots)

    def _on_complete_load(self, identity, session: ClientSession, msg: p.CompleteLoad):
        self._check_keys(msg.keys)
        if not session.owns_pins(msg.keys):
            raise RequestError("not_pinned", "these keys are not pinned by this client")
        self.tiering.complete_load(msg.keys)
        session.drop_pins(msg.keys)
        return p.Ok(msg.rid)

    def _on_touch(self, identity, session, msg: p.Touch):
        self._check_keys(msg.keys)
        self.tiering.touch(msg.keys)
        return p.Ok(msg.rid)

    def _on_finish_request(self, identity, session: ClientSession, msg: p.FinishRequest):
        scoped = self._scoped(session, msg.req_id)
        self.tiering.on_request_finished(scoped)
        session.requests.discard(scoped)
        self._dispatch_tier_jobs()
        return p.Ok(msg.rid)

    def _on_end_step(self, identity, session, msg: p.EndStep):
        self.tiering.end_step()
        self._dispatch_tier_jobs()
        return p.Ok(msg.rid)

    def _on_reset_cache(self, identity, session, msg: p.ResetCache):
        """Answered once no job is in flight and the online tiers took every waiting cascade
        (their backoff is skipped), or with ``reset_timeout`` after the drain timeout."""
        deadline = time.monotonic() + self.cfg.supervisor.drain_timeout_s
        self.pending_resets.append((identity, msg.rid, deadline))
        self.tiering.flush_cascade_backlogs()
        self._end_step()
        self._try_resets(time.monotonic())
        return None

    def _try_resets(self, now: float) -> None:
        if not self.pending_resets:
            return
        idle = not self.device_jobs and self.tiering.jobs_in_flight() == 0
        if idle and self.tiering.cascade_backlog(online_only=True) == 0:
            self.tiering.reset_cache()
            for session in self.sessions.values():
                session.pinned.clear()
                session.open_stores.clear()
            log.info("cache_reset", callers=len(self.pending_resets))
            for identity, rid, _ in self.pending_resets:
                self._reply(identity, p.Ok(rid))
            self.pending_resets.clear()
            return
        for entry in [e for e in self.pending_resets if now >= e[2]]:
            self.pending_resets.remove(entry)
            self._reply(entry[0], p.Error(entry[1], "reset_timeout", "jobs or cascades still in flight"))

    def _on_poll(self, identity, session: ClientSession, msg: p.Poll):
        if session.pending_poll is not None:
            self._reply(identity, p.Events(session.pending_poll.rid, []))
        session.pending_poll = PendingPoll(msg.rid, time.monotonic() + msg.wait_ms / 1000)
        self._answer_poll(session, force=msg.wait_ms <= 0)
        return None

    def _answer_poll(self, session: ClientSession, force: bool = False) -> None:
        poll = session.pending_poll
        if poll is None or not (session.events or force):
            return
        events = list(session.events)
        session.events.clear()
        session.pending_poll = None
        self._reply(session.identity, p.Events(poll.rid, events))

    def _answer_due_polls(self, now: float) -> None:
        for session in self.sessions.values():
            if session.pending_poll is not None and now >= session.pending_poll.deadline:
                self._answer_poll(session, force=True)

    def _on_disconnect(self, identity, session: ClientSession, msg: p.Disconnect):
        self._drop_session(session, "disconnected")
        return p.Ok(msg.rid)

    def _on_status(self, identity, session, msg: p.Status):
        return p.StatusReply(msg.rid, self.status(time.monotonic()))

    def status(self, now: float) -> dict:
        return {
            "pid": os.getpid(),
            "uptime_s": round(now - self.started_at, 3),
            "draining": self.draining,
            "pool": {"name": self.spec.pool_name, "block_bytes": self.cfg.pool.block_bytes},
            "tiering": self.tiering.snapshot(),
            "device_jobs_in_flight": len(self.device_jobs),
            "workers": self.registry.snapshot(now),
            "worker_restarts_seen": self.registry.restarts_seen,
            "clients": len(self.sessions),
            "warm_restart": self.warm.snapshot() if self.warm is not None else None,
        }

    # ---- leases ---------------------------------------------------------------------------

    def _expire_leases(self, now: float) -> None:
        lease = self.cfg.service.request_lease_s
        for identity, session in list(self.sessions.items()):
            if now - session.last_seen > lease:
                self._drop_session(session, "lease_expired")

    def _drop_session(self, session: ClientSession, reason: str) -> None:
        """Finish everything a vanished client left: its prepared stores fail, its pins are
        released, its requests finish; its device jobs still complete but deliver no event."""
        del self.sessions[session.identity]
        for scoped, stores in session.open_stores.items():
            for keys in stores:
                self.tiering.complete_store(scoped, keys, success=False)
        if session.pinned:
            self.tiering.complete_load(list(session.pinned.elements()))
        for scoped in session.requests:
            if self.tiering.has_request(scoped):
                self.tiering.on_request_finished(scoped)
        for handle_id in session.handles:
            self.kv_handles.pop(handle_id, None)
            if self.registry.live(CPU_WORKER) is not None:
                self._send_worker(CPU_WORKER, p.DetachKV(handle_id))
        self._dispatch_tier_jobs()
        log.log(
            logging.INFO if reason == "disconnected" else logging.WARNING,
            "client_dropped",
            client_id=session.client_id,
            reason=reason,
            requests=len(session.requests),
            pins=sum(session.pinned.values()),
        )


def _segment_ids(names: list[str]) -> set[tuple[int, int]]:
    """(device, inode) of each named segment that exists."""
    ids = set()
    for name in filter(None, names):
        try:
            st = stat_segment(name, "service segment")
        except (OSError, ValueError) as exc:
            log.warning("service_segment_stat_failed", segment=name, error=str(exc))
            continue
        ids.add((st.st_dev, st.st_ino))
    return ids


def serve(spec: RunSpec) -> None:
    cfg = spec.load_config()
    ManagerServer(spec, cfg).run()

