"""Start-up refusals of ``kvoffload serve``: a set-up that cannot run is refused before anything
is created, with one line naming the setting, its value and the fix, exit code 2, no
traceback, and no segment or runtime file left behind."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from kvoffload.testing.helpers import free_port
from kvoffload.testing.service import to_toml

SMALL = {"pool": {"num_slots": 16, "block_bytes": 65536}, "disk": {"enabled": False}}
REFUSE_WITHIN_S = 30.0


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    """A short runtime directory (AF_UNIX path limit), not created yet."""
    parent = Path(tempfile.mkdtemp(prefix="kvref-"))
    yield parent / "run"
    shutil.rmtree(parent, ignore_errors=True)


def write_config(path: Path, runtime_dir: Path, **sections: dict) -> Path:
    merged = {name: dict(table) for name, table in SMALL.items()}
    merged["service"] = {"runtime_dir": str(runtime_dir)}
    for name, table in sections.items():
        merged.setdefault(name, {}).update(table)
    path.write_text(to_toml(merged))
    return path


def serve(config: Path, env: dict[str, str] | None = None, blocked: tuple[str, ...] = ()):
    """``kvoffload serve --config config`` (with the modules ``blocked`` made unimportable in
    the supervisor); fails the test when it is still running after REFUSE_WITHIN_S."""
    code = (
        "import sys\n"
        f"for name in {list(blocked)!r}:\n"
        "    sys.modules[name] = None\n"
        "from kvoffload.cli import main\n"
        f"sys.exit(main(['serve', '--config', {str(config)!r}]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        out, err = proc.communicate(timeout=REFUSE_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"kvoffload serve was still running after {REFUSE_WITHIN_S} s:\n{err[-3000:]}")
    return proc.returncode, out, err


def assert_refused(config: Path, *parts: str, **kwargs) -> str:
    """Serve ``config``: exit code 2 and one stderr line naming each of ``parts``."""
    code, out, err = serve(config, **kwargs)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, out, err[-3000:])
    line = lines[0]
    assert line.startswith("kvoffload: cannot start: "), line
    for part in parts:
        assert part in line, (part, line)
    return line


def assert_nothing_left(runtime_dir: Path, keep_run: str = "") -> None:
    """No files in ``runtime_dir`` but those of the run ``keep_run``: no run was created, so no
    segment either (a run records its segments in its owner file before creating them)."""
    if runtime_dir.is_dir():
        left = [p.name for p in runtime_dir.iterdir() if not keep_run or keep_run not in p.name]
        assert left == [], left


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_pool_larger_than_the_shm_file_system_is_refused(tmp_path, runtime_dir) -> None:
    st = os.statvfs("/dev/shm")
    block = 262144
    slots = 2 * st.f_blocks * st.f_frsize // block  # twice the whole file system
    config = write_config(tmp_path / "k.toml", runtime_dir, pool={"block_bytes": block})
    line = assert_refused(
        config,
        f"pool.num_slots = {slots}",
        "free in /dev/shm",
        "lower pool.num_slots to at most",
        "make /dev/shm larger",
        env={"KVOFFLOAD_POOL__NUM_SLOTS": str(slots)},
    )
    assert "GiB" in line
    assert_nothing_left(runtime_dir)


def test_a_second_service_on_a_disk_root_in_use_is_refused_naming_that_run(
    tmp_path, start_service
) -> None:
    first = start_service(workers=("cpu", "disk"))
    disk_root = first.cfg.disk.root
    same_dir = {"runtime_dir": str(first.runtime_dir)}
    second = write_config(
        tmp_path / "second.toml",
        first.runtime_dir,
        service=same_dir,
        disk={"enabled": True, "root": disk_root, "capacity_bytes": 67108864},
    )
    assert_refused(
        second,
        f'disk.root = "{disk_root}"',
        f"running kvoffload service {first.run_id} (pid {first.serve.pid})",
        "give this one another disk.root",
    )
    assert_nothing_left(first.runtime_dir, keep_run=first.run_id)
    # in another runtime directory the run is not listed: the store's lock names its holder
    elsewhere = Path(tempfile.mkdtemp(prefix="kvref-"))
    try:
        third = write_config(
            tmp_path / "third.toml",
            elsewhere / "run",
            disk={"enabled": True, "root": disk_root, "capacity_bytes": 67108864},
        )
        disk_pid = first.worker_pid("disk")
        assert_refused(third, "is open in another disk store", f"pid {disk_pid} (")
        assert_nothing_left(elsewhere / "run")
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)
    assert first.status().workers["disk"].pid == disk_pid, "the first service is unharmed"


def test_unwritable_directories_are_refused(tmp_path, runtime_dir) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    under_a_file = write_config(tmp_path / "rt.toml", a_file / "run")
    assert_refused(
        under_a_file,
        f'service.runtime_dir = "{a_file / "run"}"',
        f"{a_file} is a file",
        "point service.runtime_dir at a directory this user can write",
    )
    disk_under_a_file = write_config(
        tmp_path / "disk.toml",
        runtime_dir,
        disk={"enabled": True, "root": str(a_file / "disk"), "capacity_bytes": 67108864},
    )
    assert_refused(
        disk_under_a_file,
        f'disk.root = "{a_file / "disk"}"',
        "point disk.root at a directory this user can write",
    )
    too_long = tmp_path / ("d" * 120)
    assert_refused(
        write_config(tmp_path / "long.toml", too_long),
        "over the 100-byte limit of AF_UNIX addresses",
        "set service.runtime_dir to a shorter directory",
    )
    assert a_file.read_text() == "not a directory" and not too_long.exists()
    assert_nothing_left(runtime_dir)
    if os.getuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert_refused(
            write_config(
                tmp_path / "ro.toml", runtime_dir, disk={"enabled": True, "root": str(locked / "d")}
            ),
            "disk.root",
            "Permission denied",
        )


def test_ports_in_use_are_refused_naming_the_listener(tmp_path, runtime_dir) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        metrics = write_config(tmp_path / "m.toml", runtime_dir, service={"metrics_port": port})
        assert_refused(
            metrics,
            f"service.metrics_port = {port}",
            f"port {port} is in use by pid {os.getpid()}",
            "choose another service.metrics_port",
        )
        keys = tmp_path / "keys"
        keys.mkdir()
        authorized = tmp_path / "authorized"
        authorized.mkdir()
        _, server_secret = zmq.auth.create_certificates(keys, "server")
        endpoint = f"tcp://127.0.0.1:{port}"
        tcp = write_config(
            tmp_path / "t.toml",
            runtime_dir,
            service={
                "client_endpoint": endpoint,
                "curve_server_secret_file": str(server_secret),
                "curve_authorized_dir": str(authorized),
            },
        )
        assert_refused(tcp, f'service.client_endpoint = "{endpoint}"', f"port {port} is in use")
    assert_nothing_left(runtime_dir)


def test_a_missing_engine_program_is_refused(tmp_path, runtime_dir) -> None:
    missing = str(tmp_path / "no-such-engine")
    config = tmp_path / "e.toml"
    write_config(config, runtime_dir)
    config.write_text(
        config.read_text() + f'\n[[engines]]\ncommand = ["{missing}", "--port", "1"]\n'
    )
    assert_refused(config, f'engines[0].command = ["{missing}", "--port", "1"]', "install it")
    assert_nothing_left(runtime_dir)


def test_the_object_tier_without_its_extra_is_refused(tmp_path, runtime_dir) -> None:
    config = write_config(
        tmp_path / "o.toml",
        runtime_dir,
        object={"enabled": True, "endpoint": f"http://127.0.0.1:{free_port()}"},
    )
    assert_refused(
        config,
        "object.enabled = true",
        "needs obstore",
        "pip install 'kvoffload[object]'",
        blocked=("obstore",),
    )
    assert_nothing_left(runtime_dir)
