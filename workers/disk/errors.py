"""Exceptions raised by the disk store (``CorruptBlock`` comes from ``kvoffload.memory.blockformat``)."""

from __future__ import annotations


class StoreFull(Exception):
    """No record is free and every stored record is pinned by a read or being written."""


class TransientIOError(OSError):
    """A read failed for a reason that may pass (EMFILE, EINTR, a single EIO); the block is kept."""


class LayoutError(RuntimeError):
    """The layout directory belongs to an incompatible store or is open in another process."""
