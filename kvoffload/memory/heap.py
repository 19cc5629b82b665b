"""Keeping freed heap memory for reuse in processes that move large messages.

glibc's malloc serves an allocation over its mmap threshold (128 KiB, then raised to the
largest block freed so far) with a fresh ``mmap`` and gives it back on free, and it trims
the top of a heap past its trim threshold: each new message buffer of a MiB then pays a page
fault for every page it writes. ZeroMQ allocates one buffer per message received, the peer
tier one per block it seals, and S3 clients one per object: at 1 MiB blocks the peer worker
took about 100 page faults per MiB received. ``keep_freed_memory`` raises both thresholds
once per process, so these buffers come from, and go back to, memory the process already
holds (at most ``TRIM_THRESHOLD_BYTES`` kept free per heap).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations up to this size come from the heaps: glibc's largest mmap threshold."""
TRIM_THRESHOLD_BYTES = 128 << 20
"""Free memory a heap keeps at its top before it is given back to the system."""


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (module docstring); False where the C library
    has no ``mallopt`` or refuses (nothing changed then: allocations still work, with their
    page faults)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
