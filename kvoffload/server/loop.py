"""The manager process: one zmq.Poller loop that carries the tiering library over ZeroMQ.

The loop owns the turn: it drains the job and client sockets into the worker channel
(``jobs``) and the client API (``api``), runs a step of the tiering library, and does the
housekeeping (heartbeats, leases, due polls, resets, metrics) and the drain on SIGTERM. The
manager assigns job ids (the tiering library's counter) and never maps the pool's bytes.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import cast

import structlog
import zmq

from kvoffload.config import Config
from kvoffload.runtime.runspec import RunSpec
from kvoffload.server.api import ClientApi
from kvoffload.server.handles import KVHandles
from kvoffload.server.jobs import WorkerChannel
from kvoffload.server.state import ManagerState

log = structlog.get_logger()

HOUSEKEEPING_PERIOD_S = 0.02
TURN_MESSAGES = 32
"""Messages taken from one socket before the other gets its turn."""
MAX_MESSAGES_PER_POLL = 2000
"""Messages taken between two steps of the tiering library and housekeeping."""


class ManagerServer:
    def __init__(self, spec: RunSpec, cfg: Config) -> None:
        self.state = ManagerState(spec, cfg)
        handles = KVHandles(self.state)
        self.workers = WorkerChannel(self.state, handles)
        self.api = ClientApi(self.state, handles, self.workers)
        self.metrics = self.state.metrics

    def run(self) -> None:
        state = self.state
        signal.signal(signal.SIGTERM, self._request_drain)
        signal.signal(signal.SIGINT, self._request_drain)
        poller = zmq.Poller()
        poller.register(state.client_sock, zmq.POLLIN)
        poller.register(state.job_sock, zmq.POLLIN)
        log.info(
            "manager_started",
            client_endpoint=state.spec.client_endpoint,
            tiers=[t.name for t in state.tiering.tiers],
        )
        drain_deadline = None
        last_housekeeping = 0.0
        while True:
            busy = (
                state.tiering.has_pending_work()
                or state.device_jobs
                or state.pending_resets
                or state.waiting_lookups
            )
            events = dict(poller.poll(5 if busy else 50))
            self._serve_sockets(state.job_sock in events, state.client_sock in events)
            now = time.monotonic()
            if state.waiting_lookups and state.job_sock in events:
                self.api.serve_waiting_lookups(now)
            state.run_tier_step()
            state.events.collect()
            state.clear_invalidated_slots()
            if now - last_housekeeping >= HOUSEKEEPING_PERIOD_S:
                last_housekeeping = now
                self._housekeeping(now)
            if state.draining:
                drain_deadline = drain_deadline or now + state.cfg.supervisor.drain_timeout_s
                idle = state.idle()
                if idle or now >= drain_deadline:
                    self._shutdown(idle)
                    return

    def _request_drain(self, signum: int, _frame: FrameType | None) -> None:
        if not self.state.draining:
            log.info("manager_draining", signal=signal.Signals(signum).name)
        self.state.draining = True

    def _serve_sockets(self, jobs: bool, clients: bool) -> None:
        """Take the waiting messages of both sockets in turns of at most ``TURN_MESSAGES``
        each, up to ``MAX_MESSAGES_PER_POLL`` in all: a burst of a worker's progress reports
        never holds a client's call back for long, nor the reverse."""
        state = self.state
        taken = 0
        while (jobs or clients) and taken < MAX_MESSAGES_PER_POLL:
            if jobs:
                got = self._drain_socket(state.job_sock, self.workers.on_frames, "jobs")
                jobs = got == TURN_MESSAGES
                taken += got
            if clients:
                got = self._drain_socket(state.client_sock, self.api.on_frames, "clients")
                clients = got == TURN_MESSAGES
                taken += got

    @staticmethod
    def _drain_socket(
        sock: zmq.Socket[bytes], handler: Callable[[list[bytes]], None], channel: str
    ) -> int:
        """Handle up to ``TURN_MESSAGES`` waiting messages; returns how many."""
        for done in range(TURN_MESSAGES):
            if not cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
                return done  # cheaper than the zmq.Again a non-blocking receive raises
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return done
            try:
                handler(frames)
            except Exception:
                log.exception("message_handling_crashed", channel=channel)
        return TURN_MESSAGES

    def _housekeeping(self, now: float) -> None:
        if not self.state.draining and not self.state.supervisor_alive():
            # re-parented: no one would restart this manager or clean up after it
            log.warning("supervisor_gone", supervisor_pid=self.state.supervisor_pid)
            self.state.draining = True
        self.workers.kill_silent_workers(now)
        self.api.housekeeping(now)
        if self.metrics is not None:
            self.metrics.publish(self.state.status(now))

    def _shutdown(self, idle: bool) -> None:
        state = self.state
        log.info(
            "manager_stopping",
            drained=idle,
            device_jobs=len(state.device_jobs),
            tier_jobs=state.tiering.jobs_in_flight(),
        )
        self.workers.shutdown_workers()
        if self.metrics is not None:
            self.metrics.close()
        if state.node_stream is not None:
            state.events.collect()
            state.node_stream.close()
        if state.auth is not None:
            state.auth.stop()
        state.client_sock.close(linger=0)
        state.job_sock.close(linger=200)
        state.zctx.term()
        if state.warm is not None:
            state.warm.close()


def serve(spec: RunSpec) -> None:
    ManagerServer(spec, spec.load_config()).run()
