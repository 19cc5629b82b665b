"""The local S3 server the tests, the soak and the benchmarks start (``kvoffload.testing.
s3server``): stopped or killed, it leaves none of weed's gRPC sockets in the temp dir, and
weed's own log files stay in the server's directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.testing.helpers import skip_without_extra

skip_without_extra("object")

from kvoffload.testing.s3server import S3Server  # noqa: E402


@pytest.mark.parametrize("end", ["stop", "kill"])
def test_a_stopped_or_killed_server_leaves_no_grpc_socket(tmp_path: Path, end: str) -> None:
    server = S3Server(tmp_path / "s3")
    server.start()
    try:
        made = [path for path in server.grpc_sockets() if path.is_socket()]
        assert made, "weed made none of the sockets its stop must remove"
    finally:
        getattr(server, end)()
    assert not server.running
    assert [path for path in server.grpc_sockets() if path.exists()] == []
    assert list((tmp_path / "s3").glob("weed.*.log.*")), "weed's log files are not in its directory"
