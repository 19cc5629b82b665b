"""The engine's paged KV cache: fixed-size blocks of K and V per layer, and their allocation.

Storage is ``2 * layers`` block-major float32 tensors in the order layer 0 K, layer 0 V, layer 1
K, ... each of shape ``(num_blocks, block_tokens, kv_heads, head_dim)``. ``shared`` puts them in a
``SharedKVCache`` (one shm segment) so the service's cpu worker copies a block's rows straight
between this cache and a pool slot; the block's bytes in the slot are the rows concatenated in
that order. ``local`` keeps them in process memory (an engine without the service).

Token ``p`` of a sequence with block table ``B`` lives at row ``p % block_tokens`` of block
``B[p // block_tokens]``.
"""

from __future__ import annotations

import hashlib

import torch

from kvoffload.engine.shapes import ModelConfig
from kvoffload.memory.kvcache import SharedKVCache
from kvoffload.wire.protocol import KVHandle


class CacheFull(RuntimeError):
    """Fewer free blocks than asked for."""


class PagedKVCache:
    def __init__(
        self, cfg: ModelConfig, tensors: list[torch.Tensor], shared: SharedKVCache | None = None
    ) -> None:
        """``tensors``: ``2 * cfg.layers`` float32 tensors ``(num_blocks, block_tokens, kv_heads,
        head_dim)``; ``shared``: the segment they live in, if any (closed by ``close``)."""
        self.cfg = cfg
        self.num_blocks = int(tensors[0].shape[0])
        self.tensors = tensors
        self._flat = [
            t.view(self.num_blocks * cfg.block_tokens, cfg.kv_heads, cfg.head_dim) for t in tensors
        ]
        self._shared = shared
        self._free = list(range(self.num_blocks - 1, -1, -1))

    @classmethod
    def shared(cls, cfg: ModelConfig, num_blocks: int) -> PagedKVCache:
        """A cache in a new shm segment (``handle`` describes it to the service)."""
        kv = SharedKVCache.create(None, num_blocks, [cfg.kv_row_bytes] * (2 * cfg.layers))
        shape = (num_blocks, cfg.block_tokens, cfg.kv_heads, cfg.head_dim)
        return cls(cfg, [v.view(shape) for v in kv.torch_views(torch.float32)], kv)

    @classmethod
    def local(cls, cfg: ModelConfig, num_blocks: int) -> PagedKVCache:
        """A cache in process memory."""
        shape = (num_blocks, cfg.block_tokens, cfg.kv_heads, cfg.head_dim)
        return cls(cfg, [torch.zeros(shape) for _ in range(2 * cfg.layers)])

    @property
    def segment(self) -> SharedKVCache | None:
        """The shm segment holding the tensors (None for a local cache)."""
        return self._shared

    def handle(self, handle_id: str) -> KVHandle:
        """The shm handle to register with the service (ValueError for a local cache)."""
        if self._shared is None:
            raise ValueError("a local KV cache cannot be registered with the service")
        return self._shared.handle(handle_id)

    # ---- allocation -----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` free blocks, lowest ids first; CacheFull if there are fewer."""
        if count > len(self._free):
            raise CacheFull(
                f"asked for {count} blocks, {len(self._free)} of {self.num_blocks} free"
            )
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
        self._free.sort(reverse=True)

    # ---- token access ---------------------------------------------------------------------

    def token_slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat row indices of positions ``start..end-1``."""
        bt = self.cfg.block_tokens
        positions = torch.arange(start, end)
        table = torch.as_tensor(block_table, dtype=torch.int64)
        return table[positions // bt] * bt + positions % bt

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` (``len(slots) x kv_heads x head_dim``) at ``slots``."""
        self._flat[2 * layer].index_copy_(0, slots, k)
        self._flat[2 * layer + 1].index_copy_(0, slots, v)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (copies)."""
        return self._flat[2 * layer].index_select(0, slots), self._flat[2 * layer + 1].index_select(
            0, slots
        )

    # ---- block bytes ----------------------------------------------------------------------

    def block_bytes(self, block: int) -> bytes:
        """One block's bytes as a pool slot holds them (rows concatenated in tensor order)."""
        return b"".join(t[block].contiguous().numpy().tobytes() for t in self.tensors)

    def block_digest(self, block: int) -> bytes:
        """16-byte blake2b of ``block_bytes(block)``."""
        digest = hashlib.blake2b(digest_size=16)
        for t in self.tensors:
            digest.update(t[block].contiguous().numpy().data)
        return digest.digest()

    def close(self) -> None:
        """Drop the views; unmap and unlink a shared segment. Idempotent."""
        self.tensors, self._flat = [], []
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.close()
            shared.unlink()
