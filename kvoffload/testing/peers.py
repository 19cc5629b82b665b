"""Nodes of a fleet whose peer tiers fetch from each other, on one machine (tests, benchmarks).

``PeerNode`` is one node's keys and endpoints: a CURVE server key pair (its manager's,
serving its node stream and its fetch endpoint), a client key pair (used towards the nodes it
follows) and the directory of the client keys it admits, with tcp:// endpoints on free local
ports. ``fleet(root, names)`` makes nodes that admit each other; ``sections`` gives a node's
config tables, following the nodes named.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq.auth

from kvoffload.testing.helpers import free_port


@dataclass(frozen=True)
class PeerNode:
    name: str
    keys: Path
    events_endpoint: str
    replay_endpoint: str
    fetch_endpoint: str
    bulk_endpoint: str

    @property
    def server_public(self) -> Path:
        return self.keys / "server.key"

    @property
    def server_secret(self) -> Path:
        return self.keys / "server.key_secret"

    @property
    def client_public(self) -> Path:
        return self.keys / "client.key"

    @property
    def client_secret(self) -> Path:
        return self.keys / "client.key_secret"

    @property
    def authorized(self) -> Path:
        return self.keys / "authorized"

    def admit(self, other: PeerNode) -> None:
        """Let ``other`` follow this node (its client key in this node's authorized dir)."""
        shutil.copy(other.client_public, self.authorized / f"{other.name}.key")

    def node_entry(self) -> dict[str, str]:
        """This node as a ``[peer] nodes`` entry of a node that follows it."""
        return {
            "name": self.name,
            "events_endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "fetch_endpoint": self.fetch_endpoint,
            "bulk_endpoint": self.bulk_endpoint,
            "server_key_file": str(self.server_public),
        }

    def sections(
        self, follows: list[PeerNode], serve: bool = True, **peer: Any
    ) -> dict[str, dict[str, Any]]:
        """Config tables of this node: CURVE keys, its node stream (by key), its fetch
        endpoint when ``serve``, the nodes it ``follows``; ``peer``: more ``[peer]`` keys."""
        return {
            "service": {
                "curve_server_secret_file": str(self.server_secret),
                "curve_authorized_dir": str(self.authorized),
            },
            "events": {
                "endpoint": self.events_endpoint,
                "replay_endpoint": self.replay_endpoint,
                "key_form": "key",
            },
            "peer": {
                "fetch_endpoint": self.fetch_endpoint if serve else "",
                "bulk_endpoint": self.bulk_endpoint if serve else "",
                "curve_client_secret_file": str(self.client_secret),
                "nodes": [node.node_entry() for node in follows],
                **peer,
            },
        }


def make_node(root: Path, name: str) -> PeerNode:
    keys = root / f"keys-{name}"
    (keys / "authorized").mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(str(keys), "server")
    zmq.auth.create_certificates(str(keys), "client")
    ports = [free_port() for _ in range(4)]
    return PeerNode(name, keys, *(f"tcp://127.0.0.1:{port}" for port in ports))


def fleet(root: Path, names: list[str]) -> list[PeerNode]:
    """Nodes that admit each other's client keys."""
    nodes = [make_node(root, name) for name in names]
    for node in nodes:
        for other in nodes:
            if other is not node:
                node.admit(other)
    return nodes
