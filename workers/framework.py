"""The common tier-worker process: job channel, job threads, results, heartbeats and control.

Every worker ``main`` calls ``worker_main`` (or ``run_worker``) with its ``Backend``. The loop:

1. configure logging, pin CPUs, attach the host pool (and the slot header table for a backend
   with ``use_slot_headers``), ``backend.start``;
2. send ``WorkerHello`` every second until a ``HelloAck`` arrives (refused: exit code 2, no ack
   within the timeout: exit code 1);
3. announce the backend's index in ``IndexUpdate`` batches (the last one ``complete``);
4. serve: validate each ``Job`` and queue it on a bounded pool of job threads (loads,
   promotions and probes before stores and cascades), heartbeat, apply control messages:
   ``drain`` (refuse new jobs with error "draining", finish the others, keep heartbeating),
   ``shutdown`` (drain, then exit; also SIGTERM/SIGINT), ``faults`` (replace the fault spec),
   ``hello`` (a restarted manager asks again: hello, and re-announce the index once acked).

Jobs run in ``workers.jobs.JobRunner`` (a result is never early, docs/design/tiering.md): a
finished job's ``BackendOutcome.release`` is called on the main thread, and only after it
returned is the one ``JobDone`` of that job sent; a release that raises is retried every
``RELEASE_RETRY_S``. Job threads never touch the socket: they wake the main loop through an
eventfd polled next to the DEALER.

Exit codes: 0 after shutdown (control, SIGTERM or SIGINT), 1 on start-up failure or hello
timeout, 2 when the manager refuses the hello or the run spec is invalid, 3 when the backend
cannot start for a reason a restart cannot fix (``FatalStartError``, a missing module; the
reason goes to the supervisor, ``kvoffload.runtime.runspec.exit_fatal``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import msgspec
import psutil
import zmq

from kvoffload.config import Config
from kvoffload.logs import configure_logging, get_logger
from kvoffload.memory.heap import keep_freed_memory
from kvoffload.memory.pool import HostPool
from kvoffload.runtime.runspec import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REFUSED,
    FatalStartError,
    RunSpec,
    exit_fatal,
    load_runspec,
)
from kvoffload.wire.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    AttachKV,
    Control,
    ControlAction,
    DetachKV,
    FaultSpec,
    Heartbeat,
    HelloAck,
    IndexUpdate,
    Job,
    ProtocolError,
    TouchKeys,
    WorkerHello,
    decode_manager_message,
    encode,
)
from kvoffload.wire.status import MediumStats, WorkerLoopStats, WorkerStats
from workers.backend import (
    INDEX_BATCH_KEYS,
    AttachRefused,
    Backend,
)
from workers.faults import FaultInjector
from workers.jobs import JobRunner
from workers.landing import LandingNotifier
from workers.slotheaders import SlotHeaders

log = get_logger()

HELLO_RESEND_S = 1.0
CONNECT_RETRY_S = 0.02
RELEASE_RETRY_S = 0.01
MAX_FRAMES_PER_TURN = 1024
CLOSE_LINGER_MS = 1000


def pin_cpus(cores: Sequence[int]) -> None:
    """Pin this process to ``cores`` (no-op when empty); failures are logged, not raised."""
    if not cores:
        return
    try:
        psutil.Process().cpu_affinity(list(cores))
    except (AttributeError, NotImplementedError, OSError, ValueError, psutil.Error) as exc:
        log.warning("cpu_affinity_unsupported", cores=list(cores), error=repr(exc))
        return
    log.info("cpu_affinity_set", cores=list(cores))


class _Worker:
    def __init__(
        self,
        backend: Backend,
        spec: RunSpec,
        cfg: Config,
        pool: HostPool,
        faults: FaultInjector,
        threads: int,
        hello_timeout_s: float,
    ) -> None:
        self._backend = backend
        self._spec = spec
        self._pool = pool
        self._faults = faults
        self._hello_timeout_s = hello_timeout_s
        self._heartbeat_s = cfg.service.heartbeat_interval_s
        self._drain_timeout_s = cfg.supervisor.drain_timeout_s

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, backend.name.encode())
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        # queue only on a live connection: no pile of stale hellos while the manager is down
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_pending = False
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_fd, zmq.POLLIN)

        self._outbox: deque[bytes] = deque()

        self.abandoned = False  # shutdown gave up on running jobs: their memory stays mapped
        self._exit_code = EXIT_OK
        self._rehello_sent_at: float | None = None
        self._stop_requested = False
        self._supervisor_pid = os.getppid()
        self._draining = False
        self._shutdown_deadline: float | None = None
        self._loop_stats = WorkerLoopStats()
        self._notifier = LandingNotifier()
        self._jobs = JobRunner(
            backend,
            pool.num_slots,
            faults,
            threads,
            self._loop_stats,
            self._send,
            self._wake,
            self._notifier,
        )

    # ---- lifecycle -----------------------------------------------------------------------------

    def _wake(self) -> None:
        """Rouse the main loop (from a job thread), unless a wake-up is already on its way: the
        main loop reads the eventfd, then clears ``_wake_pending``, then takes every finished
        job and progress report queued, so what is queued after the clear wakes it again."""
        if not self._wake_pending:
            self._wake_pending = True
            os.eventfd_write(self._wake_fd, 1)

    def request_stop(self) -> None:
        """Signal-safe: ask the main loop to shut down."""
        self._stop_requested = True
        with contextlib.suppress(OSError):  # already closed: the loop is over anyway
            os.eventfd_write(self._wake_fd, 1)

    def run(self) -> int:
        """Connect, hand-shake, serve until shutdown. Returns the exit code."""
        try:
            self._sock.connect(self._spec.job_endpoint)
            code = self._handshake()
            if code is not None:
                return code
            if not self._announce_index():
                return EXIT_FAILED
            self._jobs.start()
            self.abandoned = not self._serve()
            return self._exit_code
        finally:
            self._close()

    def _close(self) -> None:
        """Stop the job threads, send what is queued, close the socket and the backend. With
        ``abandoned`` jobs the backend stays open: a job thread may still be using it."""
        self._jobs.stop(join=not self.abandoned)
        self._flush()
        if not self.abandoned:
            self._notifier.close()
        self._sock.close(linger=CLOSE_LINGER_MS)
        self._ctx.term()
        wake_fd, self._wake_fd = self._wake_fd, -1
        os.close(wake_fd)
        if not self.abandoned:
            try:
                self._backend.close()
            except Exception:
                log.exception("backend_close_failed")

    # ---- handshake and index ------------------------------------------------------------------

    def _hello(self) -> WorkerHello:
        backend = self._backend
        return WorkerHello(
            version=PROTOCOL_VERSION,
            worker=backend.name,
            medium=backend.medium,
            pid=os.getpid(),
            capabilities=list(backend.capabilities),
        )

    def _handshake(self) -> int | None:
        """None once accepted, else the exit code."""
        hello = encode(self._hello())
        deadline = time.monotonic() + self._hello_timeout_s
        next_send = 0.0
        while True:
            now = time.monotonic()
            if self._stop_requested:
                log.info("worker_stopped_before_ack")
                return EXIT_OK
            if now >= deadline:
                log.error(
                    "hello_timeout",
                    endpoint=self._spec.job_endpoint,
                    timeout_s=self._hello_timeout_s,
                )
                return EXIT_FAILED
            if now >= next_send:
                try:
                    self._sock.send(hello, zmq.NOBLOCK)
                    next_send = now + HELLO_RESEND_S
                except zmq.Again:  # not connected yet
                    next_send = now + CONNECT_RETRY_S
            wait_s = max(0.0, min(next_send, deadline) - now)
            events = dict(self._poller.poll(int(wait_s * 1000)))
            self._drain_wake(events)
            if events.get(self._sock):
                frame = self._recv_one()
                if frame is None:
                    continue
                try:
                    msg = decode_manager_message(frame)
                except ProtocolError as exc:
                    self._bad_message(len(frame), str(exc))
                    continue
                if not isinstance(msg, HelloAck):
                    log.warning("message_before_ack", type=type(msg).__name__)
                    continue
                if not self._accepted(msg):
                    return EXIT_REFUSED
                return None

    def _accepted(self, ack: HelloAck) -> bool:
        if not ack.accepted or ack.version != PROTOCOL_VERSION:
            log.error(
                "worker_refused",
                reason=ack.reason or f"manager protocol version {ack.version}",
                version=ack.version,
                worker_version=PROTOCOL_VERSION,
            )
            return False
        log.info("worker_accepted", endpoint=self._spec.job_endpoint)
        return True

    def _rehello(self) -> None:
        """``Control(hello)``: a restarted manager does not know this worker. Hello again (at
        most once per HELLO_RESEND_S while unacked); the ack re-announces the index."""
        now = time.monotonic()
        if self._rehello_sent_at is not None and now - self._rehello_sent_at < HELLO_RESEND_S:
            return
        self._rehello_sent_at = now
        log.info("worker_rehello")
        self._send(self._hello())

    def _on_late_ack(self, ack: HelloAck) -> None:
        if self._rehello_sent_at is None:
            log.debug("extra_hello_ack")
            return
        self._rehello_sent_at = None
        if not self._accepted(ack):
            self._exit_code = EXIT_REFUSED
            self._begin_shutdown("refused")
            return
        self._announce_index()

    def _announce_index(self) -> bool:
        """Send the start-up index in batches of at most INDEX_BATCH_KEYS keys, the last one
        marked complete (a lone empty complete update without an index). False on failure."""
        pending: list[bytes] = []
        total = 0
        try:
            for batch in self._backend.initial_index():
                pending.extend(batch)
                total += len(batch)
                while len(pending) > INDEX_BATCH_KEYS:
                    self._send(IndexUpdate(added=pending[:INDEX_BATCH_KEYS]))
                    del pending[:INDEX_BATCH_KEYS]
        except Exception:
            log.exception("initial_index_failed")
            return False
        self._send(IndexUpdate(added=pending, complete=True))
        self._flush()
        log.info("index_announced", keys=total)
        return True

    # ---- main loop ----------------------------------------------------------------------------

    def _serve(self) -> bool:
        """Serve until shutdown. False when the drain timed out with jobs still running."""
        next_heartbeat = time.monotonic()
        while True:
            now = time.monotonic()
            if self._stop_requested and self._shutdown_deadline is None:
                self._begin_shutdown("signal")
            if self._shutdown_deadline is not None:
                if not self._jobs.inflight:
                    log.info("worker_shutdown", reason="drained")
                    return True
                if now >= self._shutdown_deadline:
                    log.error(
                        "shutdown_drain_timeout",
                        inflight=self._jobs.inflight,
                        timeout_s=self._drain_timeout_s,
                    )
                    return False
            wait_s = max(0.0, next_heartbeat - now)
            if self._jobs.releasing or self._outbox:
                wait_s = min(wait_s, RELEASE_RETRY_S)
            if self._shutdown_deadline is not None:
                wait_s = min(wait_s, max(0.0, self._shutdown_deadline - now))
            events = dict(self._poller.poll(int(wait_s * 1000)))
            self._drain_wake(events)
            if events.get(self._sock):
                self._receive()
            self._jobs.collect_finished()
            self._jobs.send_progress()
            self._jobs.release_finished()
            self._send_index_changes()
            now = time.monotonic()
            if now >= next_heartbeat:
                self._heartbeat()
                next_heartbeat = now + self._heartbeat_s
                self._check_supervisor()
            self._flush()

    def _check_supervisor(self) -> None:
        """A worker whose supervisor died (it was re-parented) shuts down: no one would restart
        its manager, and it must not keep the pool mapped."""
        if self._shutdown_deadline is None and os.getppid() != self._supervisor_pid:
            log.warning("supervisor_gone", supervisor_pid=self._supervisor_pid)
            self._begin_shutdown("supervisor_gone")

    def _frame_waiting(self) -> bool:
        """A message from the manager waits to be received (cheaper to ask than the zmq.Again
        a non-blocking receive raises)."""
        return bool(cast(int, self._sock.get(zmq.EVENTS)) & zmq.POLLIN)

    def _recv_one(self) -> bytes | None:
        """One single-part frame, or None when none is waiting (multi-part frames are logged
        and dropped)."""
        if not self._frame_waiting():
            return None
        try:
            parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return None
        if len(parts) != 1:
            self._bad_message(sum(len(p) for p in parts), f"{len(parts)}-part message")
            return b""
        return parts[0]

    def _receive(self) -> None:
        for _ in range(MAX_FRAMES_PER_TURN):
            frame = self._recv_one()
            if frame is None:
                return
            if frame:
                self._dispatch(frame)

    def _drain_wake(self, events: dict[Any, int]) -> None:
        if events.get(self._wake_fd):
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._wake_fd)
            self._wake_pending = False  # after the read: a wake-up written before it is taken

    def _bad_message(self, nbytes: int, error: str) -> None:
        self._loop_stats.bad_messages += 1
        log.warning("bad_manager_message", bytes=nbytes, error=error)

    def _dispatch(self, frame: bytes) -> None:
        try:
            msg = decode_manager_message(frame)
        except ProtocolError as exc:
            self._bad_message(len(frame), str(exc))
            return
        backend = self._backend
        try:
            if isinstance(msg, Job):
                self._jobs.submit(msg, self._draining, alone=not self._frame_waiting())
            elif isinstance(msg, TouchKeys):
                backend.touch(msg.keys)
            elif isinstance(msg, AttachKV):
                self._attach(msg)
            elif isinstance(msg, DetachKV):
                backend.detach_kv(msg.handle_id)
                log.info("kv_detached", handle_id=msg.handle_id)
            elif isinstance(msg, Control):
                self._control(msg)
            else:
                self._on_late_ack(msg)
        except Exception:
            log.exception("manager_message_failed", type=type(msg).__name__)

    def _attach(self, msg: AttachKV) -> None:
        handle = msg.handle
        try:
            self._backend.attach_kv(handle)
        except AttachRefused as exc:
            log.error(
                "kv_attach_refused", handle_id=handle.handle_id, kind=handle.kind, error=str(exc)
            )
            return
        log.info(
            "kv_attached", handle_id=handle.handle_id, kind=handle.kind, blocks=handle.num_blocks
        )

    def _control(self, msg: Control) -> None:
        """The action is one of ``ControlAction`` (decoding refused any other)."""
        if msg.action is ControlAction.DRAIN:
            self._draining = True
            log.info("worker_draining", inflight=self._jobs.inflight)
        elif msg.action is ControlAction.SHUTDOWN:
            self._begin_shutdown("control")
        elif msg.action is ControlAction.FAULTS:
            self._faults.replace(msg.faults if msg.faults is not None else FaultSpec())
        else:
            self._rehello()

    def _begin_shutdown(self, reason: str) -> None:
        self._draining = True
        self._shutdown_deadline = time.monotonic() + self._drain_timeout_s
        log.info("worker_shutting_down", reason=reason, inflight=self._jobs.inflight)

    # ---- outgoing -----------------------------------------------------------------------------

    def _send_index_changes(self) -> None:
        added, removed = self._backend.take_index_changes()
        for start in range(0, max(len(added), len(removed)), INDEX_BATCH_KEYS):
            self._send(
                IndexUpdate(
                    added=added[start : start + INDEX_BATCH_KEYS],
                    removed=removed[start : start + INDEX_BATCH_KEYS],
                )
            )

    def _heartbeat(self) -> None:
        """Queue a heartbeat, unless frames are still waiting for the socket (a stale
        heartbeat is useless)."""
        if self._outbox:
            return
        medium: MediumStats | None
        try:
            medium = self._backend.stats()
        except Exception as exc:  # noqa: BLE001 - stats never stop heartbeats
            log.warning("backend_stats_failed", error=repr(exc))
            medium = None
        self._loop_stats.queued = self._jobs.queued()
        self._loop_stats.releasing = self._jobs.releasing
        self._loop_stats.landing_notices = self._notifier.sent
        self._loop_stats.landing_notices_dropped = self._notifier.dropped
        stats = WorkerStats(loop=msgspec.structs.replace(self._loop_stats), medium=medium)
        self._send(
            Heartbeat(
                inflight=self._jobs.inflight, degraded=bool(self._backend.degraded), stats=stats
            )
        )

    def _send(self, msg: msgspec.Struct) -> None:
        self._outbox.append(encode(msg))

    def _flush(self) -> None:
        """Send queued frames without blocking; what the socket cannot take now stays queued."""
        while self._outbox:
            try:
                self._sock.send(self._outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._outbox.popleft()


def run_worker(
    backend: Backend,
    spec: RunSpec,
    *,
    config: Config | None = None,
    hello_timeout_s: float = 30.0,
) -> int:
    """Run ``backend`` as the worker process of ``spec`` until shutdown; returns the exit code.

    Configures logging as ``backend.name``, pins CPUs, keeps freed heap memory for reuse
    (``kvoffload.memory.heap``: message buffers without page faults), attaches the host pool
    (closed on exit), starts the backend, then runs the loop described in the module
    docstring. SIGTERM and SIGINT shut down like ``Control(shutdown)``.
    """
    cfg = config if config is not None else spec.load_config()
    configure_logging(proc=backend.name, level=cfg.service.log_level)
    pin_cpus(backend.cpu_affinity(cfg))
    if not keep_freed_memory():
        log.info("heap_thresholds_unchanged", reason="mallopt is missing or refused")
    try:
        pool = HostPool.attach(spec.pool_name, cfg.pool.num_slots, cfg.pool.block_bytes)
    except Exception as exc:  # noqa: BLE001 - any attach failure is a start failure
        log.error("pool_attach_failed", pool=spec.pool_name, error=repr(exc))
        return EXIT_FAILED
    faults = FaultInjector(cfg.faults)
    if faults.active:
        log.warning("faults_enabled", **msgspec.structs.asdict(faults.spec))
    headers: SlotHeaders | None = None
    try:
        headers = SlotHeaders.open(spec.slot_table_name, cfg, pool)
        if headers is not None:
            backend.use_slot_headers(headers)
        backend.start(pool, faults)
    except Exception as exc:
        fatal = isinstance(exc, (FatalStartError, ImportError))
        if fatal:
            log.error("backend_start_failed", worker=backend.name, fatal=True, reason=str(exc))
        else:
            log.exception("backend_start_failed", worker=backend.name)
        if headers is not None:
            headers.close()
        pool.close()
        return exit_fatal(str(exc)) if fatal else EXIT_FAILED
    worker = _Worker(backend, spec, cfg, pool, faults, backend.job_threads(cfg), hello_timeout_s)
    previous = {
        sig: signal.signal(sig, lambda *_: worker.request_stop())
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        log.info("worker_started", run_id=spec.run_id, endpoint=spec.job_endpoint)
        code = worker.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not worker.abandoned:
            if headers is not None:
                headers.close()
            pool.close()
    log.info("worker_exit", code=code)
    return code


def worker_main(
    build_backend: Callable[[Config, RunSpec], Backend], argv: Sequence[str] | None = None
) -> int:
    """``python -m workers.<name> --spec RUNSPEC_JSON [--hello-timeout S]``: load the run spec,
    build the backend from its config and the run spec, ``run_worker``. Returns the exit
    code."""
    parser = argparse.ArgumentParser(description="kvoffload tier worker")
    parser.add_argument(
        "--spec", required=True, help="run spec JSON file written by the supervisor"
    )
    parser.add_argument(
        "--hello-timeout", type=float, default=30.0, help="seconds to wait for the manager's ack"
    )
    args = parser.parse_args(argv)
    try:
        spec = load_runspec(args.spec)
        cfg = spec.load_config()
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        configure_logging(proc="worker")
        log.error("runspec_invalid", path=args.spec, error=str(exc))
        return EXIT_REFUSED
    configure_logging(proc="worker", level=cfg.service.log_level)  # until the backend is named
    return run_worker(
        build_backend(cfg, spec), spec, config=cfg, hello_timeout_s=args.hello_timeout
    )
