"""The vLLM worker side at the library level: a real shared-memory pool, vLLM's own transfer
specs and canonical KV tensors, two tensor-parallel ranks (vLLM on CPU runs one rank here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)

from kvoffload.integrations.vllm.blocks import NO_SLOT, PoolBlocks  # noqa: E402
from kvoffload.integrations.vllm.layout import BlockLayout, GeometryError, transfer_rows  # noqa: E402
from kvoffload.integrations.vllm.worker import KVOffloadWorker  # noqa: E402
from kvoffload.memory.blockformat import payload_checksum  # noqa: E402
from kvoffload.memory.pool import HostPool  # noqa: E402

LAYERS = 2
PAGE = 8192  # one vLLM block of one layer (K and V) on one rank
NUM_BLOCKS = 16
WORLD = 2


def kv_caches(seed: int) -> CanonicalKVCaches:
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        CanonicalKVCacheTensor(
            torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen), PAGE
        )
        for _ in range(LAYERS)
    ]
    return CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])


def worker(caches: CanonicalKVCaches, rank: int, **kw) -> KVOffloadWorker:
    layout = BlockLayout(((PAGE,) * LAYERS,), blocks_per_chunk=1, rank=rank, world_size=WORLD)
    return KVOffloadWorker(caches, layout, **kw)


@pytest.fixture
def pool():
    pool = HostPool.create(f"/kvoffload-test-{os.getpid()}-vllm", 8, WORLD * LAYERS * PAGE)
    yield pool
    pool.close()
    pool.unlink()


def blocks(
    pool: HostPool, keys: list[bytes], slots: list[int], manager_pid: int | None = None
) -> PoolBlocks:
    pid = os.getpid() if manager_pid is None else manager_pid
    return PoolBlocks("req", pool.name, pool.num_slots, pool.block_bytes, keys, slots, pid)


def gpu(block_ids: list[int], first_index: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[first_index])


def test_two_ranks_share_one_pool_block_at_their_offsets(pool):
    ranks = [kv_caches(seed=r) for r in range(WORLD)]
    workers = [worker(c, r) for r, c in enumerate(ranks)]
    keys, slots, src = [b"k1" * 8, b"k2" * 8], [5, 2], [3, 9]
    for w in workers:
        assert w.submit_store(1, gpu(src), blocks(pool, keys, slots))
        assert [r.job_id for r in w.get_finished()] == [1]

    for rank, caches in enumerate(ranks):
        for slot, block in zip(slots, src, strict=True):
            for layer in range(LAYERS):
                start = rank * LAYERS * PAGE + layer * PAGE
                got = torch.from_numpy(pool.slot_array(slot)[start : start + PAGE].copy()).view(
                    torch.int8
                )
                assert torch.equal(got, caches.tensors[layer].tensor[block])

    fresh = [kv_caches(seed=10 + r) for r in range(WORLD)]
    loaders = [worker(c, r) for r, c in enumerate(fresh)]
    for w in loaders:
        assert w.submit_load(2, blocks(pool, keys, slots), gpu([0, 1]))
        assert w.get_finished()[0].success
        assert w.take_error_blocks() == set()
    for rank in range(WORLD):
        for layer in range(LAYERS):
            want = ranks[rank].tensors[layer].tensor[src]
            assert torch.equal(fresh[rank].tensors[layer].tensor[[0, 1]], want)


def test_a_key_that_could_not_be_pinned_fails_only_its_blocks(pool):
    caches = kv_caches(seed=0)
    w = worker(caches, 0)
    w.submit_store(1, gpu([4, 5]), blocks(pool, [b"a" * 16, b"b" * 16], [0, 1]))
    target = kv_caches(seed=1)
    before = target.tensors[0].tensor[7].clone()
    loader = worker(target, 0)

    loader.submit_load(2, blocks(pool, [b"a" * 16, b"b" * 16], [0, NO_SLOT]), gpu([6, 7]))

    assert loader.get_finished()[0].success  # vLLM's connector cannot take a failed job
    assert loader.take_error_blocks() == {7}
    assert loader.take_report().failed_loads == {"req": [b"b" * 16]}
    assert torch.equal(target.tensors[0].tensor[6], caches.tensors[0].tensor[4])
    assert torch.equal(target.tensors[0].tensor[7], before)


def test_copies_for_a_dead_manager_are_refused(pool):
    """Slots reserved by a manager that died may be handed to other keys by its successor."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    w = worker(kv_caches(seed=0), 0)
    w.submit_store(1, gpu([1]), blocks(pool, [b"k" * 16], [3]))  # maps the pool, live manager
    w.get_finished()
    w.take_report()

    w.submit_store(2, gpu([2]), blocks(pool, [b"x" * 16], [4], manager_pid=dead.pid))
    w.submit_load(3, blocks(pool, [b"k" * 16], [3], manager_pid=dead.pid), gpu([5]))

    assert [r.success for r in w.get_finished()] == [True, True]
    report = w.take_report()
    assert report.failed_stores == [b"x" * 16]
    assert report.failed_loads == {"req": [b"k" * 16]}
    assert w.take_error_blocks() == {5}


def test_injected_load_faults_fail_loads():
    from kvoffload.wire.protocol import FaultSpec

    w = KVOffloadWorker(
        kv_caches(seed=0),
        BlockLayout(((PAGE,) * LAYERS,), 1, 0, 1),
        FaultSpec(fail_fraction=1.0),
    )
    w.submit_load(
        1, PoolBlocks("r", "/kvoffload-none", 1, 4096, [b"k" * 16], [0], os.getpid()), gpu([3])
    )
    assert w.take_error_blocks() == {3}


def test_store_checksums_are_reported_for_whole_blocks(pool):
    from kvoffload.memory.blockformat import payload_checksum

    w = KVOffloadWorker(kv_caches(seed=0), BlockLayout(((PAGE,) * LAYERS,), 1, 0, 1))
    w.submit_store(1, gpu([2]), blocks(pool, [b"k" * 16], [6]))
    w.get_finished()
    assert w.take_report().store_checksums == {b"k" * 16: {0: payload_checksum(pool.slot_array(6))}}


def test_geometry_error_names_both_sizes_and_the_settings():
    layout = BlockLayout(((PAGE,) * LAYERS,), blocks_per_chunk=2, rank=0, world_size=2)
    with pytest.raises(GeometryError) as err:
        layout.check_fits(32768)
    text = str(err.value)
    assert "32768" in text and str(2 * 2 * LAYERS * PAGE) in text
    assert "pool.block_bytes" in text and "blocks_per_chunk" in text
    layout.check_fits(2 * 2 * LAYERS * PAGE)


def test_rows_pair_blocks_with_keys():
    def rows(num_keys, block_ids, sizes, starts):
        return [
            (r.block_id, r.key_index, r.chunk_block, r.group)
            for r in transfer_rows(num_keys, block_ids, sizes, starts, 2)
        ]

    assert rows(2, [7, 8, 9, 10], [4], [0]) == [
        (7, 0, 0, 0),
        (8, 0, 1, 0),
        (9, 1, 0, 0),
        (10, 1, 1, 0),
    ]
    # a load that starts in the middle of its first chunk
    assert rows(2, [4, 5, 6], [3], [3]) == [(4, 0, 1, 0), (5, 1, 0, 0), (6, 1, 1, 0)]
    # two groups: a sliding window's last chunk and a full group's whole prefix, keys in group
    # order; an empty group takes no key
    assert rows(3, [20, 21, 1, 2, 3, 4], [2, 0, 4], [4, 9, 0]) == [
        (20, 0, 0, 0),
        (21, 0, 1, 0),
        (1, 1, 0, 2),
        (2, 1, 1, 2),
        (3, 2, 0, 2),
        (4, 2, 1, 2),
    ]
    with pytest.raises(ValueError):
        transfer_rows(2, [1, 2, 3], [3], [0], 2)  # 3 blocks from index 0 make 2 keys only half full
    with pytest.raises(ValueError):
        transfer_rows(1, [1, 2, 3], [3], [0], 2)  # they need two keys
    with pytest.raises(ValueError):
        transfer_rows(2, [1, 2, 3, 4], [2, 1], [0, 0], 2)  # the group sizes miss a block


def test_loads_are_verified_against_the_checksum_taken_at_store(pool):
    from kvoffload.memory.blockformat import slice_checksums

    w = worker(kv_caches(seed=0), 0)
    w.submit_store(1, gpu([1, 2]), blocks(pool, [b"a" * 16, b"b" * 16], [0, 1]))
    sums = [slice_checksums(pool.slot_array(s), WORLD, LAYERS * PAGE) for s in (0, 1)]
    pool.slot_array(1)[100] ^= 0xFF  # rank 0's slice of "b" changes after it was written
    spec = blocks(pool, [b"a" * 16, b"b" * 16], [0, 1])
    spec.checksums = sums

    w.submit_load(2, spec, gpu([8, 9]))

    assert w.take_error_blocks() == {9}
    assert w.take_report().failed_loads == {"req": [b"b" * 16]}


@pytest.mark.parametrize(
    ("stored", "slots", "loaded"),
    [
        ([9, 3, 14, 6], [5, 1, 2, 7], [0, 12, 4, 11]),  # blocks and slots scattered
        ([9, 3, 14, 6], [2, 3, 4, 5], [10, 11, 12, 13]),  # slots consecutive, stored blocks not
        ([4, 5, 6, 7], [6, 0, 3, 1], [13, 2, 8, 15]),  # stored blocks consecutive, slots not
    ],
)
def test_scattered_blocks_and_slots_copy_every_page_to_its_place(pool, stored, slots, loaded):
    """Keys whose vLLM blocks or pool slots are not consecutive (a KV cache after churn) are
    copied page by page to the right places, both ways, and verified against their digests."""
    from kvoffload.memory.blockformat import slice_checksums

    caches = kv_caches(seed=3)
    w = worker(caches, 0)
    keys = [b"%02d" % i * 8 for i in range(len(stored))]
    w.submit_store(1, gpu(stored), blocks(pool, keys, slots))
    for block, slot in zip(stored, slots, strict=True):
        for layer, cache in enumerate(caches.tensors):
            got = pool.slot_array(slot)[layer * PAGE : (layer + 1) * PAGE]
            assert (torch.from_numpy(got.copy()).view(torch.int8) == cache.tensor[block]).all()
    spec = blocks(pool, keys, slots)
    spec.checksums = [slice_checksums(pool.slot_array(s), WORLD, LAYERS * PAGE) for s in slots]
    w.submit_load(2, spec, gpu(loaded))
    assert w.take_error_blocks() == set()
    for source, target in zip(stored, loaded, strict=True):
        for cache in caches.tensors:
            assert (cache.tensor[target] == cache.tensor[source]).all()


def test_large_transfers_split_between_copy_threads_keep_every_byte_and_checksum():
    from kvoffload.memory.blockformat import payload_checksum

    page, count = 512 * 1024, 6  # 6 blocks of 1 MiB: copied and hashed on several threads
    gen = torch.Generator().manual_seed(5)
    tensors = [
        CanonicalKVCacheTensor(
            torch.randint(-128, 127, (2 * count, page), dtype=torch.int8, generator=gen), page
        )
        for _ in range(LAYERS)
    ]
    caches = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, page) for i in range(LAYERS)]])
    big = HostPool.create(f"/kvoffload-test-{os.getpid()}-vllm-big", count, LAYERS * page)
    w = KVOffloadWorker(caches, BlockLayout(((page,) * LAYERS,), 1, 0, 1))
    try:
        keys, slots = [b"%02d" % i * 8 for i in range(count)], list(range(count))
        w.submit_store(1, gpu(list(range(count))), blocks(big, keys, slots))
        w.get_finished()
        sums = w.take_report().store_checksums
        assert sums == {
            k: {0: payload_checksum(big.slot_array(s))} for k, s in zip(keys, slots, strict=True)
        }
        for slot in slots:
            for layer, cache in enumerate(tensors):
                got = big.slot_array(slot)[layer * page : (layer + 1) * page]
                assert (torch.from_numpy(got.copy()).view(torch.int8) == cache.tensor[slot]).all()

        big.slot_array(4)[7] ^= 0xFF  # one block changes after it was written
        spec = blocks(big, keys, slots)
        spec.checksums = [[sums[k][0]] for k in keys]
        w.submit_load(2, spec, gpu(list(range(count, 2 * count))))
        assert w.take_error_blocks() == {count + 4}
        for i in (0, 1, 2, 3, 5):
            for cache in tensors:
                assert (cache.tensor[count + i] == cache.tensor[i]).all()
    finally:
        w.shutdown()
        big.close()
        big.unlink()


def hybrid_caches(seed: int) -> CanonicalKVCaches:
    """Two groups over two layer tensors, as vLLM lays out a hybrid model: group 0 (a sliding
    window) has layers 0 and 1, group 1 (full attention) only layer 0's tensor: the layers
    of the groups alias the same tensors, and group 1 has fewer bytes per block."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        CanonicalKVCacheTensor(
            torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen), PAGE
        )
        for _ in range(2)
    ]
    refs = [
        [CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)],
        [CanonicalKVCacheRef(0, PAGE)],
    ]
    return CanonicalKVCaches(tensors, refs)


def hybrid_worker(caches: CanonicalKVCaches, **kw) -> KVOffloadWorker:
    return KVOffloadWorker(caches, BlockLayout(((PAGE, PAGE), (PAGE,)), 1, 0, 1), **kw)


def hybrid_gpu(sliding: list[int], full: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(
        sliding + full, group_sizes=[len(sliding), len(full)], block_indices=[5, 0]
    )


def test_each_group_copies_its_own_layers_into_its_keys_slots(pool):
    src = hybrid_caches(seed=3)
    keys = [b"s5" * 8, b"s6" * 8, b"f0" * 8, b"f1" * 8]
    slots = [0, 1, 2, 3]
    w = hybrid_worker(src)
    assert w.submit_store(1, hybrid_gpu([10, 11], [1, 2]), blocks(pool, keys, slots))
    w.get_finished()
    assert set(w.take_report().store_checksums) == set(keys)

    def slot_bytes(slot: int, start: int) -> torch.Tensor:
        return torch.from_numpy(pool.slot_array(slot)[start : start + PAGE].copy()).view(torch.int8)

    for slot, block in ((0, 10), (1, 11)):  # sliding group: both layers
        assert torch.equal(slot_bytes(slot, 0), src.tensors[0].tensor[block])
        assert torch.equal(slot_bytes(slot, PAGE), src.tensors[1].tensor[block])
    for slot, block in ((2, 1), (3, 2)):  # full group: its one layer
        assert torch.equal(slot_bytes(slot, 0), src.tensors[0].tensor[block])

    dst = hybrid_caches(seed=4)
    loader = hybrid_worker(dst)
    assert loader.submit_load(2, blocks(pool, keys, slots), hybrid_gpu([7, 8], [3, 4]))
    assert loader.get_finished()[0].success
    for got, want in ((7, 10), (8, 11)):
        for layer in range(2):
            assert torch.equal(dst.tensors[layer].tensor[got], src.tensors[layer].tensor[want])
    for got, want in ((3, 1), (4, 2)):
        assert torch.equal(dst.tensors[0].tensor[got], src.tensors[0].tensor[want])
    assert loader.take_failed_requests({"req"}) == set()


def test_a_failed_load_of_a_hybrid_model_fails_its_request_not_blocks(pool):
    """vLLM's block ids are unique only within a group: with several groups its scheduler
    takes failures per request and recomputes it from its first token."""
    keys = [b"s5" * 8, b"s6" * 8, b"f0" * 8, b"f1" * 8]
    hybrid_worker(hybrid_caches(seed=3)).submit_store(
        1, hybrid_gpu([10, 11], [1, 2]), blocks(pool, keys, [0, 1, 2, 3])
    )
    loader = hybrid_worker(hybrid_caches(seed=4))

    loader.submit_load(2, blocks(pool, keys, [0, 1, NO_SLOT, 3]), hybrid_gpu([7, 8], [3, 4]))

    assert loader.get_finished()[0].success
    assert loader.take_error_blocks() == set()
    assert loader.take_report().failed_loads == {"req": [b"f0" * 8]}
    assert loader.take_failed_requests(set()) == set()  # kept until its load is reported done
    assert loader.take_failed_requests({"req", "other"}) == {"req"}
    assert loader.take_failed_requests({"req"}) == set()


def test_a_replicated_layout_keeps_one_copy_that_every_rank_reads(pool):
    """MLA under tensor parallelism: every rank holds the same latent KV, so rank 0 writes one
    copy (and its checksum) and both ranks load it from the same bytes."""
    caches = kv_caches(seed=7)
    layouts = [BlockLayout(((PAGE,) * LAYERS,), 1, r, WORLD, replicated=True) for r in range(WORLD)]
    assert layouts[0].needed_block_bytes == LAYERS * PAGE  # one copy, not one per rank
    writers = [KVOffloadWorker(caches, layout) for layout in layouts]
    keys, slots = [b"m1" * 8, b"m2" * 8], [3, 4]
    before = pool.slot_array(4).copy()
    assert writers[1].submit_store(1, gpu([2, 3]), blocks(pool, keys, slots))
    writers[1].get_finished()
    assert (pool.slot_array(4) == before).all()  # rank 1 wrote nothing
    assert writers[1].take_report().store_checksums == {}
    writers[0].submit_store(1, gpu([2, 3]), blocks(pool, keys, slots))
    writers[0].get_finished()
    sums = writers[0].take_report().store_checksums
    assert set(sums) == set(keys)

    for layout in layouts:
        fresh = kv_caches(seed=8)
        reader = KVOffloadWorker(fresh, layout)
        spec = blocks(pool, keys, slots)
        spec.checksums = [[sums[k][0]] for k in keys]
        reader.submit_load(2, spec, gpu([9, 10]))
        assert reader.get_finished()[0].success and reader.take_error_blocks() == set()
        for layer in range(LAYERS):
            assert torch.equal(
                fresh.tensors[layer].tensor[[9, 10]], caches.tensors[layer].tensor[[2, 3]]
            )


def test_the_batched_gpu_copy_plan_writes_what_the_cpu_copies_write(pool):
    """The CUDA path (``copy_plan`` + ``cudacopy.copy_slots``), run on CPU tensors, against the
    CPU path: two groups, two blocks per chunk, rank 1 of 2, a load from the middle of a chunk.
    Every byte a block occupies is the same; the rest of the rank's region is zero."""
    from kvoffload.integrations.vllm.worker import copy_plan
    from kvoffload.memory.cudacopy import StageBuffer, copy_slots

    layout = BlockLayout(((PAGE, PAGE), (PAGE,)), 2, rank=1, world_size=2)
    big = HostPool.create(f"/kvoffload-test-{os.getpid()}-vllm-plan", 6, layout.needed_block_bytes)
    try:
        src = hybrid_caches(seed=11)
        w = KVOffloadWorker(src, layout)
        keys = [b"s%d" % i * 8 for i in range(2)] + [b"f%d" % i * 8 for i in range(2)]
        spec = GPULoadStoreSpec([3, 4, 5, 6, 1, 2, 8, 9], group_sizes=[4, 4], block_indices=[4, 0])
        w.submit_store(1, spec, blocks(big, keys, [0, 1, 2, 3]))
        want = big.as_numpy().copy()

        big.as_numpy()[:] = 0
        rows = w._rows(len(keys), spec)
        tensors = [t.tensor for t in src.tensors]
        region, used, parts = copy_plan(layout, w._group_refs, tensors, rows, [0, 1, 2, 3])
        pool_t = torch.from_numpy(big.as_numpy()).view(torch.int8)
        copy_slots(pool_t, used, region, parts, True, StageBuffer(torch.device("cpu"), 2 * 4096))
        got = big.as_numpy()
        mine = slice(layout.offset(0), layout.offset(0) + layout.per_rank_bytes)
        for slot, rows_of in ((0, (0, 1)), (1, (0, 1))):  # sliding group: both layers per block
            for b in rows_of:
                start = layout.offset(b)
                assert (
                    got[slot, start : start + 2 * PAGE] == want[slot, start : start + 2 * PAGE]
                ).all()
        for slot in (2, 3):  # full group: one layer per block, the stride's rest is zero
            for b in (0, 1):
                start = layout.offset(b)
                assert (got[slot, start : start + PAGE] == want[slot, start : start + PAGE]).all()
                assert not got[slot, start + PAGE : start + 2 * PAGE].any()
        assert not got[:, : mine.start].any()  # rank 0's bytes are not this rank's to write

        dst = hybrid_caches(seed=12)
        load = GPULoadStoreSpec([10, 7, 8, 9], group_sizes=[1, 3], block_indices=[5, 1])
        rows = transfer_rows(3, load.block_ids.tolist(), [1, 3], [5, 1], 2)
        region, used, parts = copy_plan(
            layout, w._group_refs, [t.tensor for t in dst.tensors], rows, [0, 2, 3]
        )
        copy_slots(pool_t, used, region, parts, False, StageBuffer(torch.device("cpu")))
        for layer in (0, 1):  # key 0 = slot 0: its second block (request block 5) was block 4
            assert torch.equal(dst.tensors[layer].tensor[10], src.tensors[layer].tensor[4])
        for got_b, want_b in ((7, 2), (8, 8), (9, 9)):  # the full group from its block 1
            assert torch.equal(dst.tensors[0].tensor[got_b], src.tensors[0].tensor[want_b])
    finally:
        big.close()
        big.unlink()


def test_an_unregistered_worker_copies_nothing_until_restored(pool):
    """vLLM 0.33's sleep mode releases the KV tensors' memory between ``unregister_kv_caches``
    and ``restore_kv_caches``: a copy then would touch freed memory, so loads fail their keys
    (recomputed) and stores are dropped, and copies resume once restored."""
    caches = kv_caches(seed=0)
    w = worker(caches, 0)
    w.unregister()
    w.unregister()  # idempotent
    w.submit_store(1, gpu([1]), blocks(pool, [b"a" * 16], [0]))
    w.submit_load(2, blocks(pool, [b"a" * 16], [0]), gpu([2]))
    assert [r.success for r in w.get_finished()] == [True, True]
    report = w.take_report()
    assert report.failed_stores == [b"a" * 16] and report.failed_loads == {"req": [b"a" * 16]}
    assert w.take_error_blocks() == {2}

    w.restore()
    w.restore()
    w.submit_store(3, gpu([1]), blocks(pool, [b"a" * 16], [0]))
    w.submit_load(4, blocks(pool, [b"a" * 16], [0]), gpu([2]))
    w.get_finished()
    assert not w.take_report().failed_loads and w.take_error_blocks() == set()
    assert torch.equal(caches.tensors[0].tensor[2], caches.tensors[0].tensor[1])


def test_each_rank_checks_its_own_slice_and_a_block_of_another_layout_is_refused(pool):
    """Tensor parallelism: each rank hashes its own slice when it stores, and checks its own
    slice against that digest when it loads. A rank whose slice changed fails the key (vLLM
    then recomputes the blocks on every rank); a block stored with another number of ranks
    fails on every rank."""
    ranks = [kv_caches(seed=20 + r) for r in range(WORLD)]
    keys, slots = [b"t1" * 8, b"t2" * 8], [6, 7]
    digests: dict[bytes, dict[int, int]] = {}
    for rank, caches in enumerate(ranks):
        w = worker(caches, rank)
        w.submit_store(1, gpu([4, 5]), blocks(pool, keys, slots))
        w.get_finished()
        for key, by_rank in w.take_report().store_checksums.items():
            assert set(by_rank) == {rank}  # its own slice only
            digests.setdefault(key, {}).update(by_rank)
    recorded = [[digests[k][r] for r in range(WORLD)] for k in keys]
    pool.slot_array(7)[LAYERS * PAGE + 10] ^= 0xFF  # rank 1's slice of "t2" changes

    def load(rank: int, checksums: list[list[int]]) -> tuple[set[int], dict]:
        loader = worker(kv_caches(seed=30 + rank), rank)
        spec = blocks(pool, keys, slots)
        spec.checksums = checksums
        loader.submit_load(2, spec, gpu([8, 9]))
        assert loader.get_finished()[0].success
        return loader.take_error_blocks(), loader.take_report().failed_loads

    assert load(0, recorded) == (set(), {})  # rank 0's slices are intact
    assert load(1, recorded) == ({9}, {"req": [b"t2" * 8]})
    one_rank = [[payload_checksum(pool.slot_array(s))] for s in slots]  # a TP=1 block's digest
    for rank in range(WORLD):
        assert load(rank, one_rank) == ({8, 9}, {"req": keys})
