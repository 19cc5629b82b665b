"""Tiering semantics as a pure library, with no sockets, threads or processes.

The contract it implements is docs/design/tiering.md.
"""

from kvoffload.tiering.ledger import TieringLedger
from kvoffload.tiering.primary import PrimaryIndex
from kvoffload.tiering.secondary import SecondaryTier, TierSpec
from kvoffload.tiering.types import (
    Locality,
    Medium,
    OffloadPolicy,
    PrefixResult,
    PrepareStoreOutput,
    ReqContext,
    RequestState,
    TierFilter,
    TieringError,
    TierMatcher,
    TransferJob,
    TransferResult,
    WriteBack,
    parse_tier_filter,
)
from kvoffload.wire.vocab import JobKind, LookupResult, MissReason

__all__ = [
    "JobKind",
    "Locality",
    "LookupResult",
    "Medium",
    "MissReason",
    "OffloadPolicy",
    "PrefixResult",
    "PrepareStoreOutput",
    "PrimaryIndex",
    "ReqContext",
    "RequestState",
    "SecondaryTier",
    "TierFilter",
    "TierMatcher",
    "TierSpec",
    "TieringError",
    "TieringLedger",
    "TransferJob",
    "TransferResult",
    "WriteBack",
    "parse_tier_filter",
]
