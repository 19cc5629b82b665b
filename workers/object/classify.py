"""Map a client exception to what the engine does with it: miss, config error, retry, or give up."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from obstore.exceptions import GenericError, PermissionDeniedError, UnauthenticatedError

_STATUS_RE = re.compile(r"status code: (\d{3})")
_CODE_RE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests"}
)
_DETAIL_CHARS = 300


class ErrorKind(enum.Enum):
    NOT_FOUND = "not_found"  # the object is absent
    NO_BUCKET = "no_bucket"  # the bucket is absent
    AUTH = "auth"  # 401/403: credentials rejected or not allowed
    THROTTLED = "throttled"  # 429, SlowDown: server alive but busy
    SERVER = "server"  # 5xx
    CONNECTION = "connection"  # refused, reset, timeout, broken body: server unreachable
    REJECTED = "rejected"  # any other 4xx: retrying will not help


RETRYABLE = frozenset({ErrorKind.THROTTLED, ErrorKind.SERVER, ErrorKind.CONNECTION})
"""Kinds worth another attempt."""

UNREACHABLE = frozenset({ErrorKind.SERVER, ErrorKind.CONNECTION})
"""Kinds the circuit breaker counts as failures; every other outcome proves the server answers."""


@dataclass(frozen=True, slots=True)
class Failure:
    kind: ErrorKind
    status: int | None
    code: str | None
    detail: str

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE


def classify(exc: BaseException) -> Failure:
    """Classify an obstore (or OS-level) exception by status code, S3 error code and type."""
    text = str(exc)
    detail = text.split("\n\nDebug source")[0].replace("\n", " ")[:_DETAIL_CHARS]
    status_match = _STATUS_RE.search(text)
    status = int(status_match.group(1)) if status_match else None
    code_match = _CODE_RE.search(text)
    code = code_match.group(1) if code_match else None
    return Failure(_kind(exc, status, code), status, code, detail)


def _kind(exc: BaseException, status: int | None, code: str | None) -> ErrorKind:
    if code == "NoSuchBucket":
        return ErrorKind.NO_BUCKET
    if isinstance(exc, FileNotFoundError) or status == 404:
        return ErrorKind.NOT_FOUND
    if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)) or status in (401, 403):
        return ErrorKind.AUTH
    if status == 429 or code in _THROTTLE_CODES:
        return ErrorKind.THROTTLED
    if status is not None and status >= 500:
        return ErrorKind.SERVER
    if status == 408:
        return ErrorKind.CONNECTION
    if status is None and isinstance(exc, (GenericError, ConnectionError, TimeoutError)):
        return ErrorKind.CONNECTION  # no HTTP status: the request or its body never completed
    return ErrorKind.REJECTED
