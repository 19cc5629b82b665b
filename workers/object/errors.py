"""Exceptions raised by the object tier's storage engine.

``KeyError`` (absent block) and ``kvoffload.memory.blockformat.CorruptBlock`` are raised as well; callers
treat every ``ObjectStoreError`` as a miss for the block concerned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.object.release import SlotTransfer


class ObjectStoreError(Exception):
    """The object store refused or failed a request in a way retrying will not fix."""


class ObjectStoreConfigError(ObjectStoreError):
    """Endpoint, credentials or bucket are wrong; the message says which."""


class StoreNotReady(ObjectStoreConfigError):
    """The start-up check failed for a reason the world may fix (the endpoint unreachable, the
    bucket missing, the credentials refused): worth trying again."""


class TransientObjectError(ObjectStoreError):
    """Timeout, 5xx, throttling or connection failure that persisted through bounded retries."""


class ReleaseFailed(ObjectStoreError):
    """A put/get could not release what it holds on the caller's slot.

    The slot must not be reused until ``transfer.release()`` returns without raising.
    ``transfer_error`` is the exception the transfer itself ended with (None: data moved).
    """

    def __init__(self, transfer: SlotTransfer, transfer_error: BaseException | None) -> None:
        outcome = "succeeded" if transfer_error is None else f"failed with {transfer_error!r}"
        super().__init__(f"slot release failed; the transfer {outcome}")
        self.transfer = transfer
        self.transfer_error = transfer_error
