"""A compact decoder-only transformer whose attention reads K/V from a paged cache.

Llama-shaped: token embedding, ``layers`` blocks of (RMSNorm, grouped-query attention with
rotary position embeddings, RMSNorm, SwiGLU MLP), a final RMSNorm and an output projection.
Weights are random, drawn from ``ModelConfig.seed``; everything runs in float32 on the CPU, so
the same inputs give the same bits in every process with the same thread count.

``forward`` processes a run of consecutive tokens: it writes their K/V into the cache blocks of
``block_table`` and attends, causally, over every position of the sequence up to the last of
them, read back from the cache. Prefill in chunks, decoding and prefill on top of a loaded prefix
are all the same call.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own convention
from torch import nn

from kvoffload.engine.shapes import ModelConfig

if TYPE_CHECKING:
    from kvoffload.engine.paged_cache import PagedKVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary:
    """Rotary position embedding (rotate-half form); a position's angles do not depend on the
    other positions of the call, so chunked and whole-sequence passes rotate identically."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.inv_freq = 1.0 / theta ** (
            torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        )

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        return angles.cos(), angles.sin()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.qkv = nn.Linear(cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.out = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: PagedKVCache,
        new_slots: torch.Tensor,
        all_slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        q, k, v = self.qkv(x).split(
            [cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim],
            dim=-1,
        )
        q = Rotary.apply(q.view(t, cfg.heads, cfg.head_dim), *rope)
        k = Rotary.apply(k.view(t, cfg.kv_heads, cfg.head_dim), *rope)
        cache.write(self.layer, new_slots, k, v.view(t, cfg.kv_heads, cfg.head_dim))
        keys, values = cache.read(self.layer, all_slots)
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            enable_gqa=True,
        )
        return self.out(attended.squeeze(0).transpose(0, 1).reshape(t, cfg.heads * cfg.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, rope, cache, new_slots, all_slots, mask) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache, new_slots, all_slots, mask)
        return x + self.mlp(self.mlp_norm(x))


class TinyDecoder(nn.Module):
    """The model. Build with ``TinyDecoder(cfg)``: weights come from ``cfg.seed`` alone."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self._init_weights()
        self.eval()
        self.requires_grad_(False)
        self.model_id = self._fingerprint()

    def _init_weights(self) -> None:
        """Unit-variance activations; logits with a standard deviation of about 4, so greedy
        choices are far from ties and survive float reordering between chunkings."""
        gen = torch.Generator().manual_seed(self.cfg.seed)
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, std=1.0, generator=gen)
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=module.in_features**-0.5, generator=gen)
            self.lm_head.weight.mul_(4.0)

    def _fingerprint(self) -> bytes:
        """16 bytes naming this model's config and exact weights (part of every block key)."""
        digest = hashlib.blake2b(repr(sorted(asdict(self.cfg).items())).encode(), digest_size=16)
        for name, tensor in self.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.contiguous().numpy().tobytes())
        return digest.digest()

    @property
    def layout_id(self) -> str:
        """Names the KV layout and weights (``pool.layout_id`` of a service for this model)."""
        return f"tinydecoder-{self.model_id.hex()}"

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        start: int,
        cache: PagedKVCache,
        block_table: list[int],
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run ``tokens`` (1-D int64) at positions ``start..start+T-1``; positions ``< start``
        must already hold K/V in ``block_table``'s blocks. Writes the tokens' K/V there and
        returns logits of the last position (``vocab``) or, with ``all_logits``, of every
        position (``T x vocab``)."""
        t = tokens.shape[0]
        end = start + t
        positions = torch.arange(start, end)
        new_slots = cache.token_slots(block_table, start, end)
        all_slots = cache.token_slots(block_table, 0, end)
        mask = positions[:, None] >= torch.arange(end)[None, :]
        rope = self.rotary.tables(positions)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, rope, cache, new_slots, all_slots, mask)
        x = self.norm(x if all_logits else x[-1:])
        logits = self.lm_head(x)
        return logits if all_logits else logits[0]
