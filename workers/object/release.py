"""What one put/get holds on a caller's host-pool slot, and its release.

Every memoryview the engine derives from a slot (or from a response buffer) is registered with
the transfer's ``SlotTransfer`` and released at one point, before put/get returns. Until then the
slot's shared memory stays exported (``mmap.close()`` raises ``BufferError``), so a release that
fails keeps everything held and is reported, never hidden: the caller retries ``release()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

ReleaseHook = Callable[[], None]


class SlotTransfer:
    """Views held by one transfer; ``release()`` drops them all or raises and keeps them all."""

    def __init__(self, release_hook: ReleaseHook | None = None) -> None:
        self._views: list[memoryview] = []
        self._hook = release_hook
        self._lock = threading.Lock()

    def hold(self, view: memoryview) -> memoryview:
        """Register a view for release; returns it."""
        self._views.append(view)
        return view

    @property
    def released(self) -> bool:
        return not self._views

    def release(self) -> None:
        """Release every held view. Idempotent; raises (holding everything) if a step fails.

        The release hook runs first: a fault injection point that models a release step failing.
        """
        with self._lock:
            if not self._views:
                return
            if self._hook is not None:
                self._hook()
            while self._views:
                self._views.pop().release()
