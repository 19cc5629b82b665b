"""Deployment fingerprints and namespaced keys for vLLM's offload keys.

vLLM's ``OffloadKey`` (block hash + 4-byte KV-cache-group index) says nothing about the model,
so two models would collide on a shared service. Every key sent to kvoffload is therefore
``fingerprint || offload_key``: the 16-byte fingerprint covers everything that makes KV bytes
differ (model identity and weights, revision, KV dtype, block geometry, layout, parallelism).
Instances of the same model with the same settings compute the same fingerprint and share
blocks; anything else never does.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvoffload.wire.events import FINGERPRINT_BYTES

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_WEIGHT_SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True)
class KVIdentity:
    """What a block's KV bytes depend on. ``model_digest`` names the model's config and
    weights (see ``model_digest``); ``layout`` is kvoffload's block layout version plus vLLM's
    KV cache layout name; ``groups`` is vLLM's KV cache groups (group id, tokens per block,
    layer names), so a key's group index means the same layers in every engine that shares
    it."""

    model: str
    model_digest: str
    revision: str
    kv_dtype: str
    tokens_per_block: tuple[int, ...]
    blocks_per_chunk: int
    layout: str
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    per_rank_bytes: int
    groups: tuple[tuple[int, int, tuple[str, ...]], ...] = ()
    namespace: str = ""

    def fingerprint(self) -> bytes:
        """16 bytes; a model with one KV cache group is named without its group, so its
        fingerprint is the one it had before groups were part of the identity."""
        fields = asdict(self)
        if len(self.groups) <= 1:
            del fields["groups"]
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=FINGERPRINT_BYTES).digest()


def model_digest(model: str) -> str:
    """A digest of a local model directory: its config files and, for each weight file, its
    name, size and a blake2b of its first and last MiB (two models initialised
    differently with one config differ there). A model that is not a local directory (a hub
    name) is identified by its name alone."""
    root = Path(model)
    if not root.is_dir():
        return ""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(root.iterdir()):
        if path.suffix == ".json":
            h.update(path.name.encode())
            h.update(path.read_bytes())
        elif path.suffix in _WEIGHT_SUFFIXES:
            size = path.stat().st_size
            h.update(f"{path.name}:{size}".encode())
            with path.open("rb") as f:
                h.update(f.read(_WEIGHT_SAMPLE_BYTES))
                if size > _WEIGHT_SAMPLE_BYTES:
                    f.seek(max(_WEIGHT_SAMPLE_BYTES, size - _WEIGHT_SAMPLE_BYTES))
                    h.update(f.read())
    return h.hexdigest()


def namespaced(fingerprint: bytes, offload_key: bytes) -> bytes:
    return fingerprint + offload_key


def namespaced_all(fingerprint: bytes, offload_keys: Iterable[bytes]) -> list[bytes]:
    """``namespaced`` of each key, in order."""
    return [fingerprint + key for key in offload_keys]


def offload_key_of(namespaced_key: bytes) -> bytes:
    return namespaced_key[FINGERPRINT_BYTES:]


def group_of(namespaced_key: bytes) -> int:
    """vLLM's KV cache group index, the last 4 bytes (big-endian) of its offload key."""
    return int.from_bytes(namespaced_key[-4:], "big")


def hashing_is_seed_dependent(hash_algo: str) -> bool:
    """True when vLLM's block hashes differ between processes: a non-cryptographic prefix hash
    (xxhash variants) with ``PYTHONHASHSEED`` unset seeds its root hash randomly."""
    return hash_algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None
