"""Health and readiness for a load balancer or an orchestrator, served beside ``/metrics``.

- ``/healthz``: 200 while the manager's loop turns (it published its status within
  ``STALE_S``) and its supervisor lives; 503 with the reason otherwise.
- ``/readyz``: 200 when the service serves: healthy, not draining, the cpu worker up, and every
  configured tier's worker up with its index complete (the tier online). Otherwise 503, and the
  body names each reason, one a line (``tier disk: down``). A tier that is down makes the
  service *degraded*: the body says so, as do ``kvoffload status`` and the
  ``kvoffload_degraded`` metric.

The manager's loop hands each status to ``Health.publish``; the HTTP thread reads the last one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from kvoffload.wire.status import ManagerStatus

STALE_S = 5.0
"""A status older than this: the manager's loop is stuck."""
CPU_WORKER = "cpu"

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def tiers_down(status: ManagerStatus) -> list[str]:
    """The configured secondary tiers that are not serving now (worker down or index not
    complete), in the manager's order."""
    return [name for name, tier in status.tiering.tiers.items() if not tier.online]


def not_ready(status: ManagerStatus) -> list[str]:
    """Why the service does not serve (empty: it is ready)."""
    reasons = ["draining"] if status.draining else []
    cpu = status.workers.get(CPU_WORKER)
    if cpu is None or not cpu.alive:
        reasons.append("cpu worker: down")
    reasons.extend(f"tier {name}: down" for name in tiers_down(status))
    return reasons


class Health:
    def __init__(self, supervisor_alive: Callable[[], bool]) -> None:
        self._lock = threading.Lock()
        self._status: ManagerStatus | None = None
        self._at = 0.0
        self._supervisor_alive = supervisor_alive

    def publish(self, status: ManagerStatus) -> None:
        with self._lock:
            self._status, self._at = status, time.monotonic()

    def healthz(self) -> tuple[bool, list[str]]:
        with self._lock:
            status, at = self._status, self._at
        reasons = []
        if status is None:
            reasons.append("manager: starting")
        elif time.monotonic() - at > STALE_S:
            reasons.append(f"manager: no status for {time.monotonic() - at:.0f} s")
        if not self._supervisor_alive():
            reasons.append("supervisor: gone")
        return not reasons, reasons

    def readyz(self) -> tuple[bool, list[str]]:
        healthy, reasons = self.healthz()
        with self._lock:
            status = self._status
        if healthy and status is not None:
            reasons = not_ready(status)
            if tiers_down(status):
                reasons.append("degraded")
        return not reasons, reasons


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged (a probe every few seconds would fill the log)."""


def serve_http(host: str, port: int, metrics: WsgiApp, health: Health) -> WSGIServer:
    """Serve ``/metrics`` (``metrics``), ``/healthz`` and ``/readyz`` on ``host:port`` from a
    daemon thread; OSError when it cannot listen."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/readyz"):
            ok, reasons = health.healthz() if path == "/healthz" else health.readyz()
            body = ("ok\n" if ok else "".join(f"{r}\n" for r in reasons)).encode()
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
            )
            return [body]
        return metrics(environ, start_response)

    server = make_server(host, port, app, _ThreadingServer, _QuietHandler)
    threading.Thread(target=server.serve_forever, name="kvoffload-http", daemon=True).start()
    return server
