"""Disk tier storage engine: ``DiskStore`` keeps fixed-size blocks in preallocated slab files."""

from kvoffload.memory.blockformat import CorruptBlock
from workers.disk.errors import LayoutError, StoreFull, TransientIOError
from workers.disk.slab import FAULT_OPS, DiskStore, FaultHook

__all__ = [
    "FAULT_OPS",
    "CorruptBlock",
    "DiskStore",
    "FaultHook",
    "LayoutError",
    "StoreFull",
    "TransientIOError",
]
