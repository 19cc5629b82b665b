"""The client guide's example (docs/examples/client_example.py) runs against a real service."""

from __future__ import annotations

import os
import subprocess
import sys

from kvoffload.testing.helpers import REPO_ROOT

EXAMPLE = REPO_ROOT / "docs" / "examples" / "client_example.py"


def test_client_guide_example_runs_against_a_service(start_service):
    service = start_service(workers=("cpu", "disk"))
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--empty-pool"],
        check=False,
        cwd=REPO_ROOT,
        env={**os.environ, "KVOFFLOAD_ENDPOINT": service.endpoint},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == "", "the client library logs nothing unless asked"
    lines = result.stdout.splitlines()
    assert lines[-1] == "ok"
    assert "second request: loaded 4 blocks from the host pool" in lines
    assert "third request: loaded 4 blocks promoted from disk" in lines
    assert "direct path: stored and read back 2 blocks through pool slots" in lines
    status = service.status().tiering
    assert status.pinned_slots == 0 and status.requests == 0


def test_client_guide_links_its_example():
    guide = (REPO_ROOT / "docs" / "client.md").read_text()
    assert "examples/client_example.py" in guide
    assert "docs/client.md" in (REPO_ROOT / "README.md").read_text()
