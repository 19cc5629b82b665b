"""Where records live: slab geometry and the ``layout.json`` that pins it to a directory.

Each deployment fingerprint gets its own directory, ``<root>/<fingerprint hex>/``, holding
``layout.json``, a ``lock`` file, slab files ``slab-NNNNNN.kvs`` and, while no store has it
open after a clean close, an empty ``clean`` file. A record is one header page
(``PAGE_BYTES`` bytes: the 128-byte block header, zero padded) followed by the payload rounded up
to whole pages. Record ``r`` lives in slab ``r // records_per_slab`` at byte offset
``(r % records_per_slab) * record_size``. Paths and offsets derive only from these numbers and
the fingerprint, never from keys.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from kvoffload.memory.blockformat import FORMAT_VERSION, PAGE_BYTES, disk_record_bytes
from workers.disk.errors import LayoutError

STORE_VERSION = 1
LAYOUT_FILE = "layout.json"
LOCK_FILE = "lock"
CLEAN_FILE = "clean"

_FIXED_FIELDS = (
    "store_version",
    "block_format_version",
    "block_bytes",
    "fingerprint",
    "header_page",
    "record_size",
)


@dataclass(frozen=True, slots=True)
class SlabLayout:
    """Geometry of one store; ``n_records`` follows from the capacity, not from the slab size."""

    directory: Path
    block_bytes: int
    fingerprint: bytes
    records_per_slab: int
    n_records: int

    @property
    def record_size(self) -> int:
        return disk_record_bytes(self.block_bytes)

    @property
    def n_slabs(self) -> int:
        return -(-self.n_records // self.records_per_slab)

    def locate(self, record: int) -> tuple[int, int]:
        """(slab number, byte offset of the record's header page in that slab)."""
        slab, index = divmod(record, self.records_per_slab)
        return slab, index * self.record_size

    def first_record(self, slab: int) -> int:
        return slab * self.records_per_slab

    def slab_records(self, slab: int) -> int:
        """Records in ``slab`` (the last slab may hold fewer than ``records_per_slab``)."""
        return min(self.records_per_slab, self.n_records - self.first_record(slab))

    def slab_bytes(self, slab: int) -> int:
        return self.slab_records(slab) * self.record_size

    def slab_path(self, slab: int) -> Path:
        return self.directory / f"slab-{slab:06d}.kvs"

    def description(self) -> dict[str, object]:
        """The content of ``layout.json``."""
        return {
            "store_version": STORE_VERSION,
            "block_format_version": FORMAT_VERSION,
            "block_bytes": self.block_bytes,
            "fingerprint": self.fingerprint.hex(),
            "header_page": PAGE_BYTES,
            "record_size": self.record_size,
            "records_per_slab": self.records_per_slab,
        }


MIN_SLABS = 8
"""A new store spreads its records over at least this many slab files (fewer records per slab
when the capacity is small), so that the writes in flight at once land in different files."""


def plan_layout(
    root: Path, block_bytes: int, fingerprint: bytes, capacity_bytes: int, records_per_slab: int
) -> SlabLayout:
    """The layout a new store would use: at most ``records_per_slab`` records per slab, fewer
    when that leaves under ``MIN_SLABS`` slabs; ValueError if the numbers cannot hold one
    record."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    if records_per_slab < 1:
        raise ValueError(f"records_per_slab must be positive, got {records_per_slab}")
    record_size = disk_record_bytes(block_bytes)
    n_records = capacity_bytes // record_size
    if n_records < 1:
        raise ValueError(
            f"capacity_bytes {capacity_bytes} is below one record ({record_size} bytes)"
        )
    per_slab = min(records_per_slab, max(1, -(-n_records // MIN_SLABS)))
    return SlabLayout(root / fingerprint.hex(), block_bytes, fingerprint, per_slab, n_records)


def adopt_layout(layout: SlabLayout) -> SlabLayout:
    """Check ``layout`` against the directory's ``layout.json``, or write that file if absent.

    An existing file must agree on every field that decides how records are encoded (else
    LayoutError); its ``records_per_slab`` wins over the requested one, since records already
    sit where it put them. The directory must exist. A new file is written durably (fsync);
    the file is mode 0600, an existing one included.
    """
    path = layout.directory / LAYOUT_FILE
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        _write_atomically(path, json.dumps(layout.description(), indent=2) + "\n")
        return layout
    except (OSError, ValueError) as exc:
        raise LayoutError(f"unreadable {path}: {exc}") from exc
    os.chmod(path, 0o600)
    wanted = layout.description()
    differing = [f for f in _FIXED_FIELDS if stored.get(f) != wanted[f]]
    if differing:
        raise LayoutError(f"{path} disagrees on {differing}: stored {stored}, wanted {wanted}")
    stored_per_slab = stored.get("records_per_slab")
    if not isinstance(stored_per_slab, int) or stored_per_slab < 1:
        raise LayoutError(f"{path} has no valid records_per_slab: {stored}")
    if stored_per_slab != layout.records_per_slab:
        structlog.get_logger().info(
            "disk_layout_records_per_slab_kept",
            directory=str(layout.directory),
            stored=stored_per_slab,
            requested=layout.records_per_slab,
        )
    return replace(layout, records_per_slab=stored_per_slab)


def make_private_directory(directory: Path) -> None:
    """Create the store's ``directory`` with mode 0700, and its root (the configured
    ``disk.root``, with missing parents) with mode 0700 when it does not exist yet; an existing
    root keeps its mode. The store directory is set to 0700 even if it existed."""
    with contextlib.suppress(FileExistsError):
        directory.parent.mkdir(mode=0o700, parents=True)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    os.chmod(directory, 0o700)


def take_clean_mark(directory: Path) -> bool:
    """Whether the last store to use ``directory`` closed cleanly (``mark_clean``). The mark is
    removed durably before this returns, so a crash from now on reads as unclean."""
    try:
        (directory / CLEAN_FILE).unlink()
    except FileNotFoundError:
        return False
    fsync_directory(directory)
    return True


def mark_clean(directory: Path) -> None:
    """Record durably that every record in ``directory`` is whole (see ``take_clean_mark``)."""
    _write_atomically(directory / CLEAN_FILE, "")


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    """Write ``path`` (mode 0600) through a temp file and a rename, durably."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)
