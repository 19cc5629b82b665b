"""What the supervisor checks before it creates anything: a set-up that cannot run is refused
with one line naming the setting, its value and the fix (``StartRefused``), and nothing is
left behind.

The checks: the modules an enabled feature needs, the engines' programs, the CURVE server key,
the runtime directory and the disk root (writable; the disk root not used by another live run
or held by another disk store), the TCP ports to listen on, and the host pool with its slot
header table against the free space of the shared-memory file system.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import psutil

from kvoffload.config import Config
from kvoffload.extras import install_line, missing_modules
from kvoffload.memory.blockformat import PAGE_BYTES
from kvoffload.memory.slottable import table_bytes as slot_table_bytes
from kvoffload.runtime.locks import flock_held, flock_holder
from kvoffload.runtime.rundir import MAX_IPC_PATH_BYTES, live_runs
from kvoffload.wire.tenant_ids import TENANT_KEY_ENV, TenantKeyError, tenant_key

SHM_DIR = Path("/dev/shm")
OBJECT_WORKER_MODULES = ("obstore",)
RUN_SOCKET_NAME = "00000000-client.sock"
"""The longest socket name a run gives its ipc endpoints (a run id is 8 hex digits)."""


class StartRefused(Exception):
    """The service cannot start as configured. ``str()`` is the operator's line:
    ``<setting> = <value>: <problem>; <fix>``."""

    def __init__(self, setting: str, value: object, problem: str, fix: str) -> None:
        super().__init__(f"{setting} = {show(value)}: {problem}; {fix}")
        self.setting = setting


def show(value: object) -> str:
    """A setting's value as it would be written in the TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, list, tuple)):
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    return str(value)


def size_text(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} bytes"


def check_startup(cfg: Config, runtime_dir: Path) -> None:
    """Every check, in order; StartRefused on the first that fails."""
    check_extras(cfg)
    check_engines(cfg)
    check_curve_key(cfg)
    check_tenant_key()
    check_runtime_dir(cfg, runtime_dir)
    check_disk_root(cfg, runtime_dir)
    check_ports(cfg)
    check_shm_space(cfg)


def check_extras(cfg: Config) -> None:
    if cfg.object.enabled and (absent := missing_modules(OBJECT_WORKER_MODULES)):
        raise StartRefused(
            "object.enabled",
            True,
            f"the object tier needs {', '.join(absent)}, not installed here",
            f"install the object extra ({install_line('object')}) or set object.enabled = false",
        )


def check_engines(cfg: Config) -> None:
    for i, engine in enumerate(cfg.engines):
        program = engine.command[0]
        search = engine.env.get("PATH", os.environ.get("PATH", os.defpath))
        if shutil.which(program, path=search) is None:
            raise StartRefused(
                f"engines[{i}].command",
                engine.command,
                f"{program} is not an executable file or on PATH",
                "install it or fix the command",
            )


def check_curve_key(cfg: Config) -> None:
    path = cfg.service.curve_server_secret_file
    if not cfg.service.client_endpoint.startswith("tcp://") or not path:
        return
    import zmq.auth

    try:
        _, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        secret, problem = None, f"cannot be read as a CURVE key file: {exc}"
    else:
        problem = "holds no secret key (a public key file?)"
    if secret is None:
        raise StartRefused(
            "service.curve_server_secret_file",
            path,
            problem,
            "name the server's .key_secret file (zmq.auth.create_certificates writes one)",
        )


def check_tenant_key() -> None:
    """The file of ``KVOFFLOAD_TENANT_KEY_FILE``, when set, holds a usable key."""
    try:
        tenant_key()
    except TenantKeyError as exc:
        raise StartRefused(
            TENANT_KEY_ENV,
            os.environ.get(TENANT_KEY_ENV, ""),
            str(exc).split(": ", 1)[1],
            "fix the file or unset the variable",
        ) from None


def check_runtime_dir(cfg: Config, runtime_dir: Path) -> None:
    value = cfg.service.runtime_dir or f"{runtime_dir} (the default)"
    fix = "point service.runtime_dir at a directory this user can write"
    socket_bytes = len(os.fsencode(Path(os.path.abspath(runtime_dir)) / RUN_SOCKET_NAME))
    if socket_bytes > MAX_IPC_PATH_BYTES:
        raise StartRefused(
            "service.runtime_dir",
            value,
            f"its socket paths are {socket_bytes} bytes, over the {MAX_IPC_PATH_BYTES}-byte limit "
            "of AF_UNIX addresses",
            "set service.runtime_dir to a shorter directory",
        )
    _check_writable("service.runtime_dir", value, runtime_dir, fix)


def check_disk_root(cfg: Config, runtime_dir: Path) -> None:
    disk = cfg.disk
    if not disk.enabled:
        return
    root = Path(os.path.abspath(disk.root))
    fix = "point disk.root at a directory this user can write"
    _check_writable("disk.root", disk.root, root, fix)
    for run in live_runs(runtime_dir):
        if run.disk_root and Path(run.disk_root) == root and run.pid != os.getpid():
            raise StartRefused(
                "disk.root",
                disk.root,
                f"{root} is the disk tier of the running kvoffload service {run.run_id} "
                f"(pid {run.pid})",
                "stop that service, or give this one another disk.root",
            )
    for lock in sorted(root.glob("*/lock")) if root.is_dir() else []:
        if flock_held(lock):
            holder = flock_holder(lock)
            who = "another process" if holder is None else f"pid {holder} ({_process(holder)})"
            raise StartRefused(
                "disk.root",
                disk.root,
                f"{lock.parent} is open in another disk store: {who}",
                "stop that process, or give this service another disk.root",
            )


def check_ports(cfg: Config) -> None:
    svc = cfg.service
    if svc.metrics_port:
        _check_port(
            "service.metrics_port", svc.metrics_port, svc.metrics_host, svc.metrics_port, "port"
        )
    endpoint = svc.client_endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if port.isdigit() and int(port) > 0:
            host = host.strip("[]")
            _check_port(
                "service.client_endpoint", endpoint, "" if host == "*" else host, int(port), "port"
            )


def check_shm_space(cfg: Config, shm_dir: Path = SHM_DIR) -> None:
    pool = cfg.pool
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    pool_bytes = pool.num_slots * pool.block_bytes
    table_bytes = _pages(slot_table_bytes(pool.num_slots)) if pool.slot_headers else 0
    if pool_bytes + table_bytes <= free:
        return
    per_slot = pool.block_bytes + (slot_table_bytes(1) if pool.slot_headers else 0)
    fits = max(0, (free - PAGE_BYTES) // per_slot)
    table = f" and its slot header table ({size_text(table_bytes)})" if table_bytes else ""
    lower = f"lower pool.num_slots to at most {fits} or " if fits else ""
    raise StartRefused(
        "pool.num_slots",
        pool.num_slots,
        f"the host pool ({pool.num_slots} x {pool.block_bytes}-byte blocks = "
        f"{size_text(pool_bytes)}){table} need{'' if table else 's'} more than the "
        f"{size_text(free)} free in {shm_dir}",
        f"{lower}make {shm_dir} larger (e.g. docker run --shm-size)",
    )


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def _check_writable(setting: str, value: object, path: Path, fix: str) -> None:
    """``path`` is a writable directory, or can be made one: the nearest existing ancestor is a
    directory in which this user can create entries (probed with an entry removed at once)."""
    path = Path(os.path.abspath(path))
    existing = path
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        what = "is not a directory" if existing == path else f"cannot be made: {existing} is a file"
        raise StartRefused(setting, value, f"{path} {what}", fix)
    try:
        probe = tempfile.mkdtemp(prefix=".kvoffload-probe-", dir=existing)
        os.rmdir(probe)
    except OSError as exc:
        where = f"{path}" if existing == path else f"{path} cannot be made in {existing}"
        raise StartRefused(setting, value, f"{where}: {exc.strerror}", fix) from None


def _check_port(setting: str, value: object, host: str, port: int, what: str) -> None:
    """The port can be listened on (as the manager will, with SO_REUSEADDR)."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return  # an interface name ZeroMQ resolves itself: the manager reports it
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                owner = _port_owner(port)
                problem = f"{what} {port} is in use" + (f" by {owner}" if owner else "")
                fix = f"stop that process or choose another {setting}"
            else:
                problem = f"cannot listen on {address[0]}:{port}: {exc.strerror}"
                fix = f"choose an address and port of this host for {setting}"
            raise StartRefused(setting, value, problem, fix) from None


def _port_owner(port: int) -> str:
    """``pid N (name)`` of a process listening on TCP ``port``, or "" when it cannot be told."""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                return "" if conn.pid is None else f"pid {conn.pid} ({_process(conn.pid)})"
    except (psutil.Error, OSError):
        pass
    return ""


def _process(pid: int) -> str:
    """A short description of process ``pid``: its command line, cut to 80 characters."""
    try:
        text = " ".join(psutil.Process(pid).cmdline()) or psutil.Process(pid).name()
    except psutil.Error:
        return "gone"
    return text if len(text) <= 80 else text[:77] + "..."
