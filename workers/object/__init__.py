"""Object tier: KV blocks in an S3-compatible bucket (engine, circuit breaker, errors)."""

from workers.object.breaker import BreakerOpen, CircuitBreaker
from workers.object.errors import (
    ObjectStoreConfigError,
    ObjectStoreError,
    ReleaseFailed,
    TransientObjectError,
)
from workers.object.release import SlotTransfer
from workers.object.s3store import S3BlockStore

__all__ = [
    "BreakerOpen",
    "CircuitBreaker",
    "ObjectStoreConfigError",
    "ObjectStoreError",
    "ReleaseFailed",
    "S3BlockStore",
    "SlotTransfer",
    "TransientObjectError",
]
