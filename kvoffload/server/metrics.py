"""Prometheus text exposition of the manager's status, served from a background HTTP thread.

The manager's loop calls ``publish(status)``; the HTTP thread only reads the last rendered text,
so it never touches the manager's state."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PREFIX = "kvoffload_"


def render(status: dict) -> str:
    """Flatten numeric leaves of the status dict; per-tier and per-worker maps become labels."""
    lines: list[str] = []
    tiering = status.get("tiering", {})
    for name, value in tiering.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            lines.append(f"{PREFIX}{name} {value}")
    for tier, counters in tiering.get("per_tier", {}).items():
        for name, value in counters.items():
            lines.append(f'{PREFIX}tier_{name}{{tier="{tier}"}} {value}')
    for worker, info in status.get("workers", {}).items():
        lines.append(f'{PREFIX}worker_up{{worker="{worker}"}} 1')
        lines.append(f'{PREFIX}worker_degraded{{worker="{worker}"}} {int(info["degraded"])}')
        lines.append(f'{PREFIX}worker_inflight{{worker="{worker}"}} {info["inflight"]}')
    lines.append(f"{PREFIX}worker_restarts_total {status.get('worker_restarts_seen', 0)}")
    lines.append(f"{PREFIX}device_jobs_in_flight {status.get('device_jobs_in_flight', 0)}")
    lines.append(f"{PREFIX}clients {status.get('clients', 0)}")
    return "\n".join(lines) + "\n"


class MetricsEndpoint:
    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self._text = "# no data yet\n"
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server naming)
                body = endpoint._text.encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                return None

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def publish(self, status: dict) -> None:
        self._text = render(status)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
