"""Binding the manager's two ROUTER sockets, with size limits and CURVE for TCP clients."""

from __future__ import annotations

import os

import zmq
import zmq.auth

from kvoffload.config import ServiceConfig
from kvoffload.runtime.handshakes import CurveGate
from kvoffload.runtime.runspec import FatalStartError

# Frames a little over the protocol limit still arrive, so the manager can answer them with a
# typed "bad_message" error; beyond this, ZeroMQ drops the connection of the sender.
TRANSPORT_SLACK_BYTES = 1 << 20


def bind_client_socket(
    zctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, svc: ServiceConfig
) -> tuple[zmq.Socket[bytes], CurveGate | None]:
    """ROUTER for engine clients. A tcp:// endpoint is served only with CURVE: the server's
    secret key file and a directory of authorized client public keys, checked by a
    ``CurveGate`` that logs and counts the handshakes it refuses. FatalStartError when the
    endpoint cannot be listened on (a port in use)."""
    sock = zctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, svc.max_message_bytes + TRANSPORT_SLACK_BYTES)
    gate = None
    if endpoint.startswith("tcp://"):
        if not (svc.curve_server_secret_file and svc.curve_authorized_dir):
            raise ValueError("a tcp:// client endpoint requires CURVE keys (service.curve_*)")
        public, secret = zmq.auth.load_certificate(svc.curve_server_secret_file)
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_server = True
        gate = CurveGate(zctx, sock, svc.curve_authorized_dir)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        if gate is not None:
            gate.stop()
        sock.close()
        raise FatalStartError(
            f"service.client_endpoint = {endpoint!r}: cannot listen: {exc.strerror}; stop the "
            "process using it or choose another endpoint"
        ) from exc
    _restrict_ipc_file(endpoint)
    return sock, gate


def bind_job_socket(
    zctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, max_message_bytes: int
) -> zmq.Socket[bytes]:
    """ROUTER for tier workers; a restarted worker reclaims its identity (ROUTER_HANDOVER), and
    a send to a worker that is not connected fails at once (ROUTER_MANDATORY)."""
    sock = zctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + TRANSPORT_SLACK_BYTES)
    sock.bind(endpoint)
    _restrict_ipc_file(endpoint)
    return sock


def _restrict_ipc_file(endpoint: str) -> None:
    """Set an ipc:// endpoint's socket file to mode 0600 (bind creates it with the umask's
    mode); abstract (``ipc://@name``) and non-ipc endpoints have no file."""
    path = endpoint.removeprefix("ipc://")
    if path != endpoint and not path.startswith("@"):
        os.chmod(path, 0o600)
