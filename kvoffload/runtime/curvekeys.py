"""CURVE key pairs for a ``tcp://`` client endpoint (``kvoffload keys generate DIR``).

Writes, with ZeroMQ's own certificate format (``zmq.auth.create_certificates``):

- ``DIR/server.key_secret``: the service's key pair (``service.curve_server_secret_file``);
- ``DIR/server.key``: its public key, which clients name (``--curve-server-key``);
- ``DIR/authorized/<name>.key``: the client's public key, in the directory the service admits
  (``service.curve_authorized_dir``);
- ``DIR/<name>.key_secret``: the client's key pair (``--curve-secret``).

Every file is mode 0600 and ``DIR`` 0700; an existing key is never overwritten.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

SERVER = "server"


class KeysExist(Exception):
    """A key file that would be written is already there."""


@dataclass(frozen=True)
class CurveKeyFiles:
    server_secret: Path
    server_public: Path
    authorized_dir: Path
    client_secret: Path

    def settings(self, endpoint: str) -> str:
        """The settings that use these keys, as the service's TOML and a client's flags."""
        return (
            "[service]\n"
            f'client_endpoint = "{endpoint}"\n'
            f'curve_server_secret_file = "{self.server_secret}"\n'
            f'curve_authorized_dir = "{self.authorized_dir}"\n'
            "\n"
            f"# a client (kvoffload status, tenant drop):\n"
            f"#   --endpoint {endpoint.replace('*', '<host>')} --curve-secret {self.client_secret}"
            f" --curve-server-key {self.server_public}\n"
        )


def generate(directory: Path, client: str = "client") -> CurveKeyFiles:
    """A server key pair and one client key pair under ``directory``; ``KeysExist`` if any
    of their files is there already."""
    directory = directory.resolve()
    authorized = directory / "authorized"
    files = CurveKeyFiles(
        server_secret=directory / f"{SERVER}.key_secret",
        server_public=directory / f"{SERVER}.key",
        authorized_dir=authorized,
        client_secret=directory / f"{client}.key_secret",
    )
    wanted = [files.server_secret, files.server_public, files.client_secret]
    wanted.append(authorized / f"{client}.key")
    present = [str(p) for p in wanted if p.exists()]
    if present:
        raise KeysExist(f"not overwriting existing keys: {', '.join(present)}")
    authorized.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    old_umask = os.umask(0o077)
    try:
        zmq.auth.create_certificates(str(directory), SERVER)
        zmq.auth.create_certificates(str(directory), client)
    finally:
        os.umask(old_umask)
    (directory / f"{client}.key").replace(authorized / f"{client}.key")
    for path in wanted:
        os.chmod(path, 0o600)
    return files
