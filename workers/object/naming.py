"""Object names of blocks: ``{prefix}/{fingerprint_hex}/{key_hex}``, and a tenant's blocks
``{prefix}/{fingerprint_hex}/tenants/{tenant_id}/{key_hex}``.

Only the configured prefix and the hex of the fingerprint, the tenant's id (a digest of its
name, never the name) and the key appear in a name, so a caller's key can never address
anything outside the deployment's namespace, and every node of a fleet names a tenant's blocks
alike (a tenant drop on one node removes the others').
"""

from __future__ import annotations

import re

from kvoffload.memory.blockformat import MAX_KEY_BYTES
from kvoffload.wire.tenant_ids import NO_TENANT, is_tenant_id

TENANTS_DIR = "tenants"

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


def tenant_namespace(prefix: str, fingerprint: bytes, tenant: str) -> str:
    """The directory holding every block of one tenant (by id), with a trailing slash."""
    if tenant == NO_TENANT or not is_tenant_id(tenant):
        raise ValueError(f"not a tenant id: {tenant!r}")
    return f"{namespace(prefix, fingerprint)}{TENANTS_DIR}/{tenant}/"


def object_name(prefix: str, fingerprint: bytes, key: bytes, tenant: str = NO_TENANT) -> str:
    """The name of the block ``key`` of ``tenant`` (an id; ``NO_TENANT``: none)."""
    check_key(key)
    if tenant == NO_TENANT:
        return namespace(prefix, fingerprint) + bytes(key).hex()
    return tenant_namespace(prefix, fingerprint, tenant) + bytes(key).hex()
