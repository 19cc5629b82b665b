"""Tenant names and the ids the service knows them by.

A tenant is named by the engine: vLLM's ``cache_salt`` of a request, or a namespace set for a
whole engine. The name never leaves the engine's side in clear: clients send ``tenant_id(name)``
(16 hex digits of a blake2b digest), and every key, object name, log line, status field and
metric label of the service carries that id only. A leaf module (the standard library only):
the client, the configuration and the service all import it.

Keyed ids. With a fleet-wide secret in the file named by ``KVOFFLOAD_TENANT_KEY_FILE`` (at least
16 bytes, read once per process), the digest is blake2b in its keyed mode: a MAC, so an id
cannot be tested against guessed names by whoever lists the bucket or reads a metric label.
Without it the ids are plain digests of the names, the same everywhere, and guessable from
names. Every process that names tenants (the service, its engines, ``kvoffload tenant drop``)
must see the same key, and every node of a fleet sharing a bucket: the object tier checks the
bucket's key marker (``key_check``) at start.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re

TENANT_ID_CHARS = 16
NO_TENANT = ""
"""The id of requests that name no tenant."""
NO_TENANT_LABEL = "none"
"""How status and metrics show ``NO_TENANT``."""

_PERSON = b"kvoffload-tnt"
_ID_RE = re.compile(rf"[0-9a-f]{{{TENANT_ID_CHARS}}}")


TENANT_KEY_ENV = "KVOFFLOAD_TENANT_KEY_FILE"
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 64
_KEY_CHECK_NAME = "kvoffload:tenant-key-check"


class TenantKeyError(ValueError):
    """The file named by ``KVOFFLOAD_TENANT_KEY_FILE`` cannot serve as a key."""


def read_key(path: str) -> bytes:
    """The key in ``path`` (surrounding whitespace stripped); TenantKeyError naming the
    problem."""
    try:
        key = open(path, "rb").read().strip()  # noqa: SIM115 - a small file read at once
    except OSError as exc:
        raise TenantKeyError(f"{TENANT_KEY_ENV}={path}: cannot read it: {exc.strerror}") from exc
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise TenantKeyError(
            f"{TENANT_KEY_ENV}={path}: a key is {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes, "
            f"the file holds {len(key)} (make one: head -c 32 /dev/urandom | base64)"
        )
    return key


@functools.cache
def tenant_key() -> bytes | None:
    """This process's key (None: ids are unkeyed); TenantKeyError for an unusable file."""
    path = os.environ.get(TENANT_KEY_ENV, "")
    return read_key(path) if path else None


def tenant_id(name: str | None, key: bytes | None = None) -> str:
    """The id of the tenant named ``name`` (``NO_TENANT`` for None or an empty name), keyed
    by ``key``, else by this process's ``tenant_key``."""
    if not name:
        return NO_TENANT
    digest = hashlib.blake2b(
        name.encode(),
        digest_size=TENANT_ID_CHARS // 2,
        person=_PERSON,
        key=key if key is not None else tenant_key() or b"",
    )
    return digest.hexdigest()


def key_check(key: bytes | None = None) -> str:
    """What proves which key made the ids (the same for every holder of one key; another for
    another key or none): the id of a fixed name."""
    return tenant_id(_KEY_CHECK_NAME, key)


def is_tenant_id(value: str) -> bool:
    """True for ``NO_TENANT`` and for the ids ``tenant_id`` makes."""
    return value == NO_TENANT or _ID_RE.fullmatch(value) is not None


def tenant_label(tid: str) -> str:
    """The id as status and metrics show it."""
    return tid or NO_TENANT_LABEL
