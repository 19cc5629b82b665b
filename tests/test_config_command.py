"""``kvoffload config check`` refuses what ``kvoffload serve`` refuses, with the same line, and
creates nothing; ``kvoffload config show`` prints the effective configuration, which loads back
as the same, with the secret masked."""

from __future__ import annotations

import socket
import subprocess
import sys
import tomllib
from pathlib import Path

from kvoffload.config import load_config
from kvoffload.testing.helpers import free_port

KVOFFLOAD = [sys.executable, "-m", "kvoffload.cli"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVOFFLOAD, *args], capture_output=True, text=True, timeout=60, env=env)


def test_config_check_refuses_what_serve_refuses_with_the_same_line(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", free_port()))
    taken.listen()
    port = taken.getsockname()[1]
    runtime = tmp_path / "run"
    config = tmp_path / "kvoffload.toml"
    config.write_text(
        f'[service]\nmetrics_port = {port}\nruntime_dir = "{runtime}"\n\n'
        f'[disk]\nroot = "{tmp_path / "disk"}"\n'
    )
    try:
        checked = run("config", "check", "--config", str(config))
        served = run("serve", "--config", str(config))
    finally:
        taken.close()
    assert checked.returncode == served.returncode == 2
    line = checked.stderr.strip()
    assert line.startswith("kvoffload: cannot start: service.metrics_port = ")
    assert line in served.stderr
    assert not (tmp_path / "disk").exists() and not runtime.exists()
    ok = run("config", "check", "--config", str(config))
    assert ok.returncode == 0 and "configuration ok" in ok.stdout


def test_config_check_refuses_a_mistyped_override_as_serve_does(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "KVOFFLOAD_POOL_NUM_SLOTS": "8"}
    checked = run("config", "check", env=env)
    served = run("serve", env=env)
    assert checked.returncode == served.returncode == 2
    assert "did you mean KVOFFLOAD_POOL__NUM_SLOTS?" in checked.stderr
    assert checked.stderr.strip() in served.stderr


def test_config_show_prints_the_effective_configuration_with_the_secret_masked(
    tmp_path: Path,
) -> None:
    config = tmp_path / "kvoffload.toml"
    config.write_text(
        '[pool]\nnum_slots = 77\n\n[object]\nsecret_access_key = "hunter2"\n\n'
        '[tenants.alice]\npool_slots_share = 4\n\n[[engines]]\ncommand = ["python", "-V"]\n'
    )
    env = {"PATH": "/usr/bin:/bin", "KVOFFLOAD_DISK__CAPACITY_BYTES": "1073741824"}
    shown = run("config", "show", "--config", str(config), env=env)
    assert shown.returncode == 0, shown.stderr
    assert "hunter2" not in shown.stdout and 'secret_access_key = "***"' in shown.stdout
    data = tomllib.loads(shown.stdout)
    assert data["pool"]["num_slots"] == 77 and data["disk"]["capacity_bytes"] == 1 << 30
    written = tmp_path / "shown.toml"
    written.write_text(shown.stdout.replace('"***"', '"hunter2"'))
    assert load_config(written, env={}) == load_config(config, env=env)
