"""Loads copied layer by layer (``layered``) at the worker level: a real shared-memory pool,
vLLM's own transfer specs and canonical KV tensors, the worker's background thread. The
forward is played by calling ``wait_for_layer`` for each layer, as vLLM's attention does; real
engines run them in test_engine.py."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)

from kvoffload.integrations.vllm.blocks import PoolBlocks  # noqa: E402
from kvoffload.integrations.vllm.layout import BlockLayout  # noqa: E402
from kvoffload.integrations.vllm.worker import KVOffloadWorker  # noqa: E402
from kvoffload.memory.blockformat import payload_checksum, slice_checksums  # noqa: E402
from kvoffload.memory.pool import HostPool  # noqa: E402

PAGE = 8192
NUM_BLOCKS = 24
LAYERS = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn")
CPU = {min(os.sched_getaffinity(0))}


def caches(seed: int, pages: tuple[int, ...] = (PAGE,) * 3) -> CanonicalKVCaches:
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        CanonicalKVCacheTensor(
            torch.randint(-128, 127, (NUM_BLOCKS, page), dtype=torch.int8, generator=gen), page
        )
        for page in pages
    ]
    return CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, p) for i, p in enumerate(pages)]])


def named(c: CanonicalKVCaches) -> dict[str, torch.Tensor]:
    return {name: t.tensor for name, t in zip(LAYERS, c.tensors, strict=False)}


@pytest.fixture
def pool():
    pool = HostPool.create(f"/kvoffload-test-{os.getpid()}-layered", 16, 2 * 3 * PAGE)
    yield pool
    pool.close()
    pool.unlink()


def spec(pool: HostPool, keys: list[bytes], slots: list[int], sums=None) -> PoolBlocks:
    return PoolBlocks(
        "req", pool.name, pool.num_slots, pool.block_bytes, keys, slots, os.getpid(), sums or []
    )


def gpu(block_ids: list[int], first_index: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[first_index])


def forward(worker: KVOffloadWorker, order=LAYERS) -> None:
    """One step's forward as vLLM's attention layers see it, then the step's end."""
    for layer in order:
        worker.wait_for_layer(layer)
    worker.get_finished()


def stored(pool, layout: BlockLayout, keys, slots, blocks, seed=0, pages=(PAGE,) * 3):
    """Store ``blocks`` of a fresh cache into ``slots``; the source cache and the checksums a
    load is handed (the whole slot's, or each rank's slice)."""
    src = caches(seed, pages)
    writer = KVOffloadWorker(src, layout, layered_load_cpus=set())
    writer.submit_store(1, gpu(blocks), spec(pool, keys, slots))
    writer.get_finished()
    writer.shutdown()
    if layout.copies == 1:
        sums = [[payload_checksum(pool.slot_array(s))] for s in slots]
    else:
        sums = [
            slice_checksums(pool.slot_array(s), layout.copies, layout.per_rank_bytes) for s in slots
        ]
    return src, sums


def test_layers_wait_only_for_their_own_tensor_once_the_order_is_learned(pool):
    layout = BlockLayout(((PAGE,) * 3,), 1, 0, 1)
    keys, slots = [b"a" * 16, b"b" * 16, b"c" * 16], [3, 4, 5]
    src, sums = stored(pool, layout, keys, slots, [7, 8, 9])
    dst = caches(seed=1)
    w = KVOffloadWorker(dst, layout, layered_load_cpus=CPU)
    w.name_layers(named(dst))

    w.stage_next_loads({10})
    assert w.submit_load(10, spec(pool, keys, slots, sums), gpu([0, 1, 2]))
    assert w.layered_job_ids() == set()  # no forward seen yet: copied whole
    assert [r.job_id for r in w.get_finished()] == [10]

    reversed_order = tuple(reversed(LAYERS))
    forward(w, reversed_order)  # the forward reads the layers last to first
    w.stage_next_loads({11})
    assert w.submit_load(11, spec(pool, keys, slots, sums), gpu([3, 4, 5]))
    assert w.layered_job_ids() == {11}
    w.wait_for_layer(reversed_order[0])
    assert torch.equal(dst.tensors[2].tensor[[3, 4, 5]], src.tensors[2].tensor[[7, 8, 9]])
    for layer in reversed_order[1:]:
        w.wait_for_layer(layer)
    results = w.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in results] == [(11, True, 3 * 3 * PAGE)]
    assert w.take_error_blocks() == set()
    for t in range(3):
        assert torch.equal(dst.tensors[t].tensor[[3, 4, 5]], src.tensors[t].tensor[[7, 8, 9]])
    w.shutdown()


def test_a_corrupt_slot_fails_only_its_blocks(pool):
    layout = BlockLayout(((PAGE,) * 3,), 1, 0, 1)
    keys, slots = [b"a" * 16, b"b" * 16], [0, 1]
    _, sums = stored(pool, layout, keys, slots, [2, 3])
    pool.slot_array(1)[2 * PAGE + 5] ^= 0xFF  # the last layer's page of key b
    dst = caches(seed=2)
    w = KVOffloadWorker(dst, layout, layered_load_cpus=CPU)
    w.name_layers(named(dst))
    forward(w)
    w.stage_next_loads({1})
    w.submit_load(1, spec(pool, keys, slots, sums), gpu([10, 11]))
    assert w.layered_job_ids() == {1}
    forward(w)
    assert w.take_error_blocks() == {11}
    assert w.take_report().failed_loads == {"req": [b"b" * 16]}
    w.shutdown()


def test_a_forward_that_skips_a_layer_keeps_loads_whole(pool):
    layout = BlockLayout(((PAGE,) * 3,), 1, 0, 1)
    keys, slots = [b"a" * 16], [0]
    _, sums = stored(pool, layout, keys, slots, [2])
    dst = caches(seed=3)
    w = KVOffloadWorker(dst, layout, layered_load_cpus=CPU)
    w.name_layers(named(dst))
    forward(w, LAYERS[:2])  # a layer that reads a loaded tensor never asked
    w.stage_next_loads({1})
    w.submit_load(1, spec(pool, keys, slots, sums), gpu([5]))
    assert w.layered_job_ids() == set()
    w.shutdown()


def test_without_layered_load_cpus_no_load_is_layered(pool):
    layout = BlockLayout(((PAGE,) * 3,), 1, 0, 1)
    dst = caches(seed=4)
    w = KVOffloadWorker(dst, layout, layered_load_cpus=set())
    w.name_layers(named(dst))
    forward(w)
    w.stage_next_loads({1})
    w.submit_load(1, spec(pool, [b"a" * 16], [0]), gpu([5]))
    assert w.layered_job_ids() == set()
    w.shutdown()


@pytest.mark.parametrize(
    ("layout", "pages"),
    [
        # two vLLM blocks per key: a key's pieces are not in slot order stage by stage, so its
        # slot is hashed once every stage ran
        (BlockLayout(((PAGE,) * 3,), 2, 0, 1), (PAGE,) * 3),
        # rank 1 of 2: its slice of each slot
        (BlockLayout(((PAGE,) * 3,), 1, 1, 2), (PAGE,) * 3),
        # pages smaller than the stride: the slot's unused rest is fed last
        (BlockLayout(((PAGE // 2,) * 3,), 1, 0, 1, stride=3 * PAGE), (PAGE // 2,) * 3),
    ],
)
def test_digests_cover_what_the_whole_load_checks(pool, layout, pages):
    keys, slots = [b"a" * 16, b"b" * 16], [6, 7]
    blocks = list(range(2 * layout.blocks_per_chunk))
    src, sums = stored(pool, layout, keys, slots, [b + 10 for b in blocks], pages=pages)
    dst = caches(seed=5, pages=pages)
    w = KVOffloadWorker(dst, layout, layered_load_cpus=CPU)
    w.name_layers(named(dst))
    forward(w)
    w.stage_next_loads({1})
    w.submit_load(1, spec(pool, keys, slots, sums), gpu(blocks))
    assert w.layered_job_ids() == {1}
    forward(w)
    assert w.take_error_blocks() == set()
    for t in range(3):
        assert torch.equal(
            dst.tensors[t].tensor[blocks], src.tensors[t].tensor[[b + 10 for b in blocks]]
        )
    pool.slot_array(7)[layout.offset(0) + 1] ^= 1
    w.stage_next_loads({2})
    w.submit_load(2, spec(pool, keys, slots, sums), gpu(blocks))
    forward(w)
    assert w.take_error_blocks() == set(blocks[len(blocks) // 2 :])
    w.shutdown()


def test_by_default_layered_loads_copy_on_the_cpus_the_worker_thread_is_not_bound_to(pool):
    """vLLM binds its CPU worker's thread to its OpenMP cores and leaves the rest to
    connectors: those are where layered loads copy; a thread bound to nothing leaves none."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing is left beside the worker thread")
    layout = BlockLayout(((PAGE,) * 3,), 1, 0, 1)
    keys, slots = [b"a" * 16], [0]
    _, sums = stored(pool, layout, keys, slots, [2])
    unbound_kv = caches(seed=6)
    unbound = KVOffloadWorker(unbound_kv, layout)
    bound = min(cpus)
    os.sched_setaffinity(0, {bound})
    try:
        dst = caches(seed=7)
        w = KVOffloadWorker(dst, layout)
        w.name_layers(named(dst))
        forward(w)
        w.stage_next_loads({1})
        w.submit_load(1, spec(pool, keys, slots, sums), gpu([4]))
        assert w.layered_job_ids() == {1}
        forward(w)
        assert w.take_error_blocks() == set()
        w.shutdown()
    finally:
        os.sched_setaffinity(0, cpus)
    unbound.name_layers(named(unbound_kv))
    forward(unbound)
    unbound.stage_next_loads({1})
    unbound.submit_load(1, spec(pool, keys, slots, sums), gpu([4]))
    assert unbound.layered_job_ids() == set()
    unbound.shutdown()
