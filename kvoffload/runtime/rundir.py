"""Per-run runtime directory: owner records, ipc endpoints, and clean-up after dead runs.

The base directory (mode 0700, owned by the current user, never a symlink) may be shared by
several runs. Each run has a random ``run_id`` and one owner file ``owner-<run_id>.json``
listing its pid and the shared-memory segments it created; its sockets are
``<run_id>-<name>.sock``. The supervisor creates the ``RunDir`` and calls ``remove`` at exit;
``cleanup_stale`` removes what runs whose owner process is gone left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import time
from pathlib import Path

import msgspec
import posix_ipc
import psutil

from kvoffload.logs import get_logger

log = get_logger()

MAX_IPC_PATH_BYTES = 100  # sun_path holds 108 bytes including the NUL; keep a margin
_CREATE_TIME_TOLERANCE_S = 1.0  # /proc boot time may drift by a second between readers


_RUN_SEGMENT = re.compile(r"/*kvoffload-[0-9a-f]{8}-")


def is_run_segment(name: str) -> bool:
    """True when ``name`` has the form ``RunDir.shm_name`` gives a run's own segments (host
    pool, slot header table) of this run or of any other."""
    return _RUN_SEGMENT.match(name) is not None


class RunDirError(Exception):
    """The runtime directory is unsafe to use or an endpoint path does not fit."""


class OwnerRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Contents of ``owner-<run_id>.json``. ``create_time`` is the owner's process start time
    (psutil), used to tell a live owner from a reused pid; None when it could not be read.
    ``disk_root``: the absolute disk tier directory of the run ("" without one), so a second
    run on it is refused."""

    pid: int
    run_id: str
    started_at: float
    create_time: float | None = None
    shm_names: list[str] = []
    disk_root: str = ""


def _owner_path(base: Path, run_id: str) -> Path:
    return base / f"owner-{run_id}.json"


def _owner_tmp_path(base: Path, run_id: str) -> Path:
    return base / f".owner-{run_id}.json.tmp"


def _process_create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _write_owner(base: Path, record: OwnerRecord) -> None:
    """Atomically replace the owner file (temp file + rename in the same directory)."""
    final = _owner_path(base, record.run_id)
    tmp = _owner_tmp_path(base, record.run_id)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(msgspec.json.encode(record))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, final)


def _secure_base(base: Path) -> Path:
    """Create ``base`` (mode 0700) or check an existing one: a directory, not a symlink, owned
    by this uid; its mode is forced to 0700. Raises RunDirError otherwise."""
    base = Path(os.path.abspath(base))
    base.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(base, 0o700)
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        kind = "a symlink" if base.is_symlink() else "not a directory"
        raise RunDirError(f"runtime dir {base} is {kind}; refusing to use it") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise RunDirError(
                f"runtime dir {base} is owned by uid {st.st_uid}, not {os.getuid()}; "
                "refusing to use it"
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return base


def _owner_alive(record: OwnerRecord) -> bool:
    if record.pid == os.getpid():
        return True
    try:
        proc = psutil.Process(record.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        started = proc.create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
    if record.create_time is None:
        return True
    return abs(started - record.create_time) <= _CREATE_TIME_TOLERANCE_S


def _read_owner(path: Path) -> OwnerRecord | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=OwnerRecord)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("owner_file_unreadable", path=str(path), error=repr(exc))
        return None


def _run_files(base: Path, run_id: str) -> list[Path]:
    """The run's sockets and spec files: every ``<run_id>-*`` entry of the base dir."""
    return sorted(base.glob(f"{run_id}-*"))


def _unlink_quietly(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def live_runs(base: Path) -> list[OwnerRecord]:
    """Owner records in ``base`` whose owner process is alive (for status and clients)."""
    base = Path(base)
    if not base.is_dir():
        return []
    records = (_read_owner(p) for p in sorted(base.glob("owner-*.json")))
    return [r for r in records if r is not None and _owner_alive(r)]


def cleanup_stale(base: Path) -> list[str]:
    """Remove what dead runs in ``base`` left: their recorded shm segments, their sockets and
    their owner files. Live runs' files are never touched. Returns the names removed (shm names
    as recorded, sockets and owner files as paths); a missing ``base`` removes nothing."""
    base = Path(base)
    if not base.is_dir():
        return []
    removed: list[str] = []
    for owner_file in sorted(base.glob("owner-*.json")):
        record = _read_owner(owner_file)
        if record is None or _owner_alive(record):
            continue
        names: list[str] = []
        for shm_name in record.shm_names:
            try:
                posix_ipc.unlink_shared_memory(shm_name)
                names.append(shm_name)
            except posix_ipc.ExistentialError:
                pass
        names.extend(str(p) for p in _run_files(base, record.run_id) if _unlink_quietly(p))
        _unlink_quietly(_owner_tmp_path(base, record.run_id))
        if _unlink_quietly(owner_file):
            names.append(str(owner_file))
        log.info("stale_run_cleaned", run_id=record.run_id, pid=record.pid, removed=names)
        removed.extend(names)
    return removed


class RunDir:
    """One run's view of the runtime directory. Create it with ``RunDir.create``."""

    def __init__(self, base: Path, record: OwnerRecord) -> None:
        self._base = base
        self._record = record

    @classmethod
    def create(cls, base: Path, disk_root: str = "") -> RunDir:
        """Secure ``base``, pick a fresh run id and write this process's owner file (with the
        run's ``disk_root``, if any)."""
        base = _secure_base(Path(base))
        while True:
            run_id = secrets.token_hex(4)
            if not _owner_path(base, run_id).exists():
                break
        pid = os.getpid()
        record = OwnerRecord(
            pid=pid,
            run_id=run_id,
            started_at=time.time(),
            create_time=_process_create_time(pid),
            shm_names=[],
            disk_root=disk_root,
        )
        _write_owner(base, record)
        return cls(base, record)

    @property
    def base(self) -> Path:
        return self._base

    @property
    def run_id(self) -> str:
        return self._record.run_id

    @property
    def owner_file(self) -> Path:
        return _owner_path(self._base, self._record.run_id)

    @property
    def shm_names(self) -> list[str]:
        return list(self._record.shm_names)

    def shm_name(self, name: str) -> str:
        """The per-run POSIX shm name for ``name``: ``/kvoffload-<run_id>-<name>``."""
        return f"/kvoffload-{self._record.run_id}-{name}"

    def socket_path(self, name: str) -> Path:
        """Filesystem path of this run's ipc socket ``name``; RunDirError if too long for
        an AF_UNIX address."""
        path = self._base / f"{self._record.run_id}-{name}.sock"
        length = len(os.fsencode(path))
        if length > MAX_IPC_PATH_BYTES:
            raise RunDirError(
                f"ipc socket path {path} is {length} bytes, over the {MAX_IPC_PATH_BYTES}-byte "
                "limit of AF_UNIX addresses; set service.runtime_dir to a shorter directory"
            )
        return path

    def file_path(self, name: str) -> Path:
        """Path of a run-owned file (removed by ``remove`` and by ``cleanup_stale``)."""
        return self._base / f"{self._record.run_id}-{name}"

    def endpoint(self, name: str) -> str:
        """ZeroMQ endpoint ``ipc://<base>/<run_id>-<name>.sock``."""
        return f"ipc://{self.socket_path(name)}"

    def record_shm(self, name: str) -> None:
        """Add a shm segment name to the owner file (before creating the segment, so a crash
        in between leaves nothing unrecorded)."""
        if name in self._record.shm_names:
            return
        self._record = msgspec.structs.replace(
            self._record, shm_names=[*self._record.shm_names, name]
        )
        _write_owner(self._base, self._record)

    def remove(self) -> None:
        """Unlink this run's sockets and owner file (idempotent). Shm segments are unlinked by
        whoever created them, not here."""
        for path in _run_files(self._base, self._record.run_id):
            _unlink_quietly(path)
        _unlink_quietly(self.owner_file)
