"""``SyncLoads`` (pool hits loaded in the scheduling step, on vLLM 0.32) step by step, on
stand-ins of the few vLLM scheduler fields it reads; real engines run it in test_engine.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402

from kvoffload.integrations.vllm.sync_loads import SyncLoads, Unhashed  # noqa: E402

CHUNK = 32  # tokens per chunk (one 32-token block)


def scheduler(*req_ids: str, keys: int = 8):
    status = {
        r: SimpleNamespace(
            group_states=[SimpleNamespace(offload_keys=[f"{r}-k{i}" for i in range(keys)])],
            partial_tail_boundary=None,
            transfer_jobs=set(),
            num_locally_computed_tokens=0,
        )
        for r in req_ids
    }
    config = SimpleNamespace(kv_group_configs=[SimpleNamespace(tokens_per_chunk=CHUNK)])
    return SimpleNamespace(_req_status=status, config=config, _jobs={})


def request(req_id: str, tokens: int = 8 * CHUNK + 5):
    return SimpleNamespace(request_id=req_id, num_tokens=tokens)


def test_a_hit_is_synchronous_only_when_every_condition_holds():
    pool = {"r1-k0", "r1-k1", "r1-k2", "r2-k0", "r2-k1", "r2-k2", "r2-k3"}
    asked = []

    def in_pool(req_id, keys):
        asked.append((req_id, list(keys)))
        return set(keys) <= pool

    sync = SyncLoads(budget_bytes=5 * CHUNK * 10, bytes_per_token=10, in_pool=in_pool)
    sched = scheduler("r1", "r2", "r3")
    assert not sync.choose(sched, request("r1"), 0, 3 * CHUNK, load_async=False)  # not a load
    assert not sync.choose(sched, request("r1"), 0, None, load_async=True)  # deferred
    assert not sync.choose(
        sched, request("r1", tokens=3 * CHUNK), 0, 3 * CHUNK, True
    )  # no token left
    assert sync.choose(sched, request("r1"), 0, 3 * CHUNK, True)
    assert asked[-1] == ("r1", ["r1-k0", "r1-k1", "r1-k2"])
    # 3 of the 5 chunks of budget are taken: r2's 4 do not fit this step
    assert not sync.choose(sched, request("r2"), 0, 4 * CHUNK, True)
    # a key the pool does not hold: asynchronous
    assert not sync.choose(sched, request("r3"), 0, CHUNK, True)
    sched._req_status["r2"].partial_tail_boundary = 100
    meta = sync.end_step(SimpleNamespace(load_jobs={}, store_jobs={}, jobs_to_flush=None))
    assert meta.sync_job_ids == set()
    assert not sync.choose(sched, request("r2"), 0, 4 * CHUNK, True)  # a partial tail
    sched._req_status["r2"].partial_tail_boundary = None
    assert sync.choose(sched, request("r2"), 2 * CHUNK, 2 * CHUNK, True)  # the budget is new
    assert asked[-1] == ("r2", ["r2-k2", "r2-k3"])

    assert not SyncLoads(0, 10, in_pool).choose(sched, request("r1"), 0, CHUNK, True)


def test_blocks_past_the_computed_ones_are_handed_over_unhashed():
    sync = SyncLoads(1 << 30, 1, lambda req_id, keys: True)
    sched = scheduler("r1")
    sched._req_status["r1"].num_locally_computed_tokens = CHUNK
    blocks = KVCacheBlocks(
        ([SimpleNamespace(block_id=i, is_null=False, block_hash=b"h") for i in range(4)],)
    )
    assert sync.blocks_for_alloc(request("r1"), blocks, CHUNK, sched) is blocks  # not chosen
    assert sync.choose(sched, request("r1"), CHUNK, 3 * CHUNK, True)

    (handed,) = sync.blocks_for_alloc(request("r1"), blocks, CHUNK, sched).blocks

    assert handed[0] is blocks.blocks[0][0]  # the locally computed block stays as it is
    assert handed[1:] == [Unhashed(i, False) for i in (1, 2, 3)]


def test_a_pending_synchronous_load_is_hidden_from_each_step_until_vllm_completes_it():
    sync = SyncLoads(1 << 30, 1, lambda req_id, keys: True)
    sched = scheduler("r1", "r2")
    assert sync.choose(sched, request("r1"), 0, CHUNK, True)
    sched._jobs.update({7: "load r1", 8: "store r2"})
    sched._req_status["r1"].transfer_jobs.add(7)
    sync.note_load_jobs(request("r1"), [7])
    sync.note_load_jobs(request("r2"), [8])  # r2 was not chosen: not a synchronous load
    meta = sync.end_step(SimpleNamespace(load_jobs={7: "job"}, store_jobs={}, jobs_to_flush=None))
    assert meta.sync_job_ids == {7}

    # next step: vLLM builds its metadata while the report of job 7 is still to come
    sync.hide(sched)
    assert sched._req_status["r1"].transfer_jobs == set()
    status = sched._req_status.pop("r1")  # vLLM dropped the request as having no job left
    sync.restore(sched)
    assert sched._req_status["r1"] is status and status.transfer_jobs == {7}

    del sched._jobs[7]  # vLLM completed it
    sync.hide(sched)
    sync.restore(sched)
    assert status.transfer_jobs == {7}  # left to vLLM, which removes it when it completes
    assert sync._pending == {}
