"""Tenant names and the ids the service knows them by.

A tenant is named by the engine: vLLM's ``cache_salt`` of a request, or a namespace set for a
whole engine. The name never leaves the engine's side in clear: clients send ``tenant_id(name)``
(16 hex digits of a blake2b digest), and every key, object name, log line, status field and
metric label of the service carries that id only. The digest is the same on every node, so a
fleet sharing one bucket agrees on each tenant's objects. A leaf module (the standard library
only): the client, the configuration and the service all import it.
"""

from __future__ import annotations

import hashlib
import re

TENANT_ID_CHARS = 16
NO_TENANT = ""
"""The id of requests that name no tenant."""
NO_TENANT_LABEL = "none"
"""How status and metrics show ``NO_TENANT``."""

_PERSON = b"kvoffload-tnt"
_ID_RE = re.compile(rf"[0-9a-f]{{{TENANT_ID_CHARS}}}")


def tenant_id(name: str | None) -> str:
    """The id of the tenant named ``name`` (``NO_TENANT`` for None or an empty name)."""
    if not name:
        return NO_TENANT
    digest = hashlib.blake2b(name.encode(), digest_size=TENANT_ID_CHARS // 2, person=_PERSON)
    return digest.hexdigest()


def is_tenant_id(value: str) -> bool:
    """True for ``NO_TENANT`` and for the ids ``tenant_id`` makes."""
    return value == NO_TENANT or _ID_RE.fullmatch(value) is not None


def tenant_label(tid: str) -> str:
    """The id as status and metrics show it."""
    return tid or NO_TENANT_LABEL
