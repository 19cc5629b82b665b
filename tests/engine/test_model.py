"""The reference model: paged attention over a cache built piecewise equals one full pass; greedy
decoding equals teacher forcing; weights and block geometry are what the service expects."""

from __future__ import annotations

import os

import pytest

from kvoffload.testing.helpers import skip_without_extra

skip_without_extra("engine")

import torch  # noqa: E402

from kvoffload.engine import DEMO_MODEL, Engine, ModelConfig, PagedKVCache, TinyDecoder  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> TinyDecoder:
    return TinyDecoder(DEMO_MODEL)


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, DEMO_MODEL.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    )


def kv_of(cache: PagedKVCache, table: list[int], length: int) -> list[torch.Tensor]:
    slots = cache.token_slots(table, 0, length)
    return [t for layer in range(cache.cfg.layers) for t in cache.read(layer, slots)]


def test_cache_built_in_two_halves_matches_one_full_pass(model: TinyDecoder) -> None:
    tokens = prompt(100)
    whole = PagedKVCache.local(model.cfg, 16)
    whole_table = whole.allocate(7)
    full = model(tokens, 0, whole, whole_table, all_logits=True)

    paged = PagedKVCache.local(model.cfg, 16)
    table = paged.allocate(16)[::-2][:7]  # scattered, out-of-order blocks
    first = model(tokens[:45], 0, paged, table, all_logits=True)
    second = model(tokens[45:], 45, paged, table, all_logits=True)
    halves = torch.cat([first, second])

    assert halves.shape == full.shape == (100, model.cfg.vocab_size)
    torch.testing.assert_close(halves, full, atol=ATOL, rtol=0)
    assert torch.equal(halves.argmax(-1), full.argmax(-1))
    for a, b in zip(kv_of(paged, table, 100), kv_of(whole, whole_table, 100), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert not torch.equal(
        second[0], model(tokens[45:46], 0, PagedKVCache.local(model.cfg, 1), [0])
    ), "the second half must depend on the first half's K/V"


def test_same_shapes_give_identical_bits_whatever_the_blocks(model: TinyDecoder) -> None:
    tokens = prompt(70, seed=1)
    a, b = PagedKVCache.local(model.cfg, 10), PagedKVCache.local(model.cfg, 10)
    ta, tb = a.allocate(5), b.allocate(10)[5:]
    model(tokens[:48], 0, a, ta)
    model(tokens[:48], 0, b, tb)
    assert all(a.block_bytes(x) == b.block_bytes(y) for x, y in zip(ta[:3], tb[:3], strict=True))
    assert torch.equal(
        model(tokens[48:], 48, a, ta, all_logits=True),
        model(tokens[48:], 48, b, tb, all_logits=True),
    )


def test_greedy_decoding_matches_teacher_forcing(model: TinyDecoder) -> None:
    tokens = prompt(37, seed=2).tolist()
    with Engine.local(model, 8, prefill_chunk=16) as engine:
        out = engine.generate(tokens, 10)
    assert len(out.tokens) == 10 and out.logits.shape == (10, model.cfg.vocab_size)
    assert out.computed_tokens == 37 and out.reused_blocks == 0
    cache = PagedKVCache.local(model.cfg, 8)
    forced = model(
        torch.tensor(tokens + out.tokens[:-1]), 0, cache, cache.allocate(3), all_logits=True
    )[36:]
    torch.testing.assert_close(out.logits, forced, atol=ATOL, rtol=0)
    assert forced.argmax(-1).tolist() == out.tokens


def test_weights_come_from_the_seed_alone(model: TinyDecoder) -> None:
    assert TinyDecoder(DEMO_MODEL).model_id == model.model_id
    assert TinyDecoder(ModelConfig(seed=1)).model_id != model.model_id
    logits = model(prompt(20), 0, PagedKVCache.local(model.cfg, 2), [0, 1], all_logits=True)
    assert 2.0 < float(logits.std()) < 8.0


def test_block_geometry_matches_a_pool_slot(model: TinyDecoder) -> None:
    cfg = model.cfg
    assert (
        cfg.block_bytes
        == 2 * cfg.layers * cfg.block_tokens * cfg.kv_heads * cfg.head_dim * 4
        == 65536
    )
    cache = PagedKVCache.shared(cfg, 4)
    name = cache.segment.name
    try:
        table = cache.allocate(2)
        model(prompt(20), 0, cache, table)
        assert len(cache.block_bytes(table[0])) == cfg.block_bytes == cache.segment.block_bytes
        assert cache.block_bytes(table[0]) == cache.segment.block(table[0])
        assert cache.block_bytes(table[1])[: cfg.kv_row_bytes // 4] != bytes(cfg.kv_row_bytes // 4)
    finally:
        cache.close()
    assert not os.path.exists(f"/dev/shm{name}")


def test_allocation_is_exclusive_until_freed() -> None:
    cache = PagedKVCache.local(DEMO_MODEL, 4)
    first = cache.allocate(3)
    assert sorted(first) == [0, 1, 2] and cache.num_free == 1
    with pytest.raises(RuntimeError):
        cache.allocate(2)
    cache.free(first)
    assert cache.num_free == 4
