"""The tcp:// walk-through of docs/security.md, step by step against a real ``kvoffload serve``:
``kvoffload keys generate``, its printed settings as the service's config, ``kvoffload status``
with the client's keys; a client without an authorized key gets no answer."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tomllib

import zmq
import zmq.auth

from kvoffload.client import KVOffloadClient, ServiceUnavailable
from kvoffload.testing.helpers import REPO_ROOT, free_port, wait_until

KVOFFLOAD = [sys.executable, "-m", "kvoffload.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVOFFLOAD, *args], capture_output=True, text=True, timeout=60)


def test_the_security_guides_tcp_walk_through_serves_a_client_with_generated_keys(tmp_path):
    guide = (REPO_ROOT / "docs" / "security.md").read_text()
    assert "kvoffload keys generate" in guide and "--curve-server-key" in guide
    keys = tmp_path / "curve"
    made = run("keys", "generate", str(keys), "--endpoint", f"tcp://127.0.0.1:{free_port()}")
    assert made.returncode == 0, made.stderr
    for path in [keys / "server.key_secret", keys / "client.key_secret", *keys.glob("*/*.key")]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    printed = made.stdout.split("\n", 2)[2]
    service_table = printed.split("\n\n")[0]
    settings = tomllib.loads(service_table)["service"]
    endpoint = settings["client_endpoint"]
    client_flags = printed.split("#   ", 1)[1].split()
    assert client_flags[:2] == ["--endpoint", endpoint]
    config = tmp_path / "kvoffload.toml"
    config.write_text(
        f'{service_table}\nruntime_dir = "{tmp_path / "run"}"\n\n[pool]\nnum_slots = 16\n'
        "block_bytes = 65536\n\n[disk]\nenabled = false\n"
    )
    again = run("keys", "generate", str(keys))
    assert again.returncode == 2 and "not overwriting" in again.stderr

    serve = subprocess.Popen(
        [*KVOFFLOAD, "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        status = wait_until(
            lambda: (r := run("status", *client_flags)).returncode == 0 and r,
            what="kvoffload status over CURVE",
            timeout_s=60,
        )
        assert "pool" in status.stdout
        stranger_public, stranger_secret = zmq.auth.create_certificates(str(tmp_path), "stranger")
        public, secret = zmq.auth.load_certificate(stranger_secret)
        server, _ = zmq.auth.load_certificate(str(keys / "server.key"))
        assert secret is not None
        try:
            KVOffloadClient(endpoint, timeout_s=1.0, curve_keys=(public, secret, server))
            answered = True
        except ServiceUnavailable:
            answered = False
        assert not answered  # a key outside authorized/ gets no answer
    finally:
        os.kill(serve.pid, signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
