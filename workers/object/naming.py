"""Object names of blocks: ``{prefix}/{fingerprint_hex}/{key_hex}``.

Only the configured prefix and the hex of the fingerprint and key appear in a name, so a caller's
key can never address anything outside the deployment's namespace.
"""

from __future__ import annotations

import re

from kvoffload.memory.blockformat import MAX_KEY_BYTES

_PREFIX_RE = re.compile(r"[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*")


def normalize_prefix(prefix: str) -> str:
    """Strip surrounding slashes; raise ValueError unless the rest is slash-separated safe segments."""
    stripped = prefix.strip("/")
    if stripped and (not _PREFIX_RE.fullmatch(stripped) or ".." in stripped.split("/")):
        raise ValueError(f"object prefix {prefix!r} must be /-separated segments of [A-Za-z0-9._-]")
    return stripped


def check_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"block key must be bytes, not {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"block key length {len(key)} outside 1..{MAX_KEY_BYTES}")


def namespace(prefix: str, fingerprint: bytes) -> str:
    """The directory holding every block of one deployment, with a trailing slash."""
    head = f"{prefix}/" if prefix else ""
    return f"{head}{fingerprint.hex()}/"


def object_name(prefix: str, fingerprint: bytes, key: bytes) -> str:
    check_key(key)
    return namespace(prefix, fingerprint) + bytes(key).hex()
