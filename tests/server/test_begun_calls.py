"""Calls sent ahead of their reply (``begin_lookup``, ``begin_prepare_store``) through a real
service: replies read while other calls run are kept for them, errors and ended sessions are
raised by ``result``, and the bench's pipelined engine-side paths leave no pin behind."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.bench.service import engine_load_prefixes, engine_store_prefixes
from kvoffload.client import KVOffloadError
from kvoffload.memory.slotcopy import shared_copier
from kvoffload.testing.helpers import keys_for
from kvoffload.testing.service import service_pool
from kvoffload.tiering import LookupResult
from kvoffload.wire.vocab import ErrorCode

HIT, HIT_PENDING, MISS = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS
BLOCK = 65536


def rows_for(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, BLOCK), dtype=np.uint8)


def test_begun_calls_are_answered_in_order_around_other_calls(start_service):
    service = start_service(block_bytes=BLOCK)
    keys = keys_for("begun", 4)
    rows = rows_for(4, 1)
    with service.client("engine") as client, service_pool(client) as pool:
        client.new_request("r")
        stores = client.begin_prepare_store("r", keys[:2])
        later_stores = client.begin_prepare_store("r", keys[2:])
        lookup_before = client.begin_lookup("r", keys, pin=True)
        assert client.status().tiering.pinned_slots == 0  # read every reply above, kept them
        for call, part in ((later_stores, rows[2:]), (stores, rows[:2])):
            prepared = call.result()
            sums = shared_copier().copy_with_checksums(
                [
                    (pool.slot_array(slot), row)
                    for slot, row in zip(prepared.slots, part, strict=True)
                ]
            )
            client.complete_store("r", list(prepared.keys), checksums=[[s] for s in sums])
        before = lookup_before.result()  # sent before the stores completed
        assert before.results == [HIT_PENDING] * 4 and lookup_before.result() is before
        lookup_after = client.begin_lookup("r", keys, pin=True)
        plain = client.lookup("r", keys)
        outcome = lookup_after.result()
        assert plain.results == outcome.results == [HIT] * 4
        assert client.status().tiering.pinned_slots == 4
        for slot, row in zip(outcome.slots, rows, strict=True):
            assert np.array_equal(pool.slot_array(slot), row)
        client.complete_load("r", keys)
        assert client.status().tiering.pinned_slots == 0


def test_a_begun_call_raises_its_error_and_the_client_keeps_serving(start_service):
    service = start_service(block_bytes=BLOCK)
    keys = keys_for("begun-error", 2)
    with service.client("engine") as client:
        unknown = client.begin_lookup("never-opened", keys, pin=True)
        client.new_request("r")
        with pytest.raises(KVOffloadError) as raised:
            unknown.result()
        assert raised.value.code is ErrorCode.UNKNOWN_REQUEST
        with pytest.raises(KVOffloadError):
            unknown.result()
        assert client.lookup("r", keys).results == [MISS]


def test_a_call_begun_before_a_reconnect_is_sent_again_or_reported_ended(start_service):
    service = start_service(block_bytes=BLOCK)
    keys = keys_for("begun-reconnect", 2)
    with service.client("engine") as client:
        client.new_request("r")
        ended = client.begin_lookup("r", keys, pin=True)
        client.reconnect()
        with pytest.raises(KVOffloadError) as raised:
            ended.result()
        assert raised.value.code is ErrorCode.NOT_CONNECTED
    with service.client("engine") as client:
        client.auto_reconnect = True
        client.new_request("r")
        again = client.begin_prepare_store("r", keys)
        client.reconnect()
        prepared = again.result()  # sent again in the new session
        assert list(prepared.keys) == keys
        client.complete_store("r", keys, success=False)


def test_pipelined_engine_copies_round_trip_and_release_every_pin(start_service):
    service = start_service(block_bytes=BLOCK)
    keys = keys_for("pipelined", 12)
    rows = rows_for(12, 2)
    batches = [keys[i : i + 4] for i in range(0, 12, 4)]
    with service.client("engine") as client, service_pool(client) as pool:
        client.new_request("r")
        engine_store_prefixes(client, "r", batches, pool, rows)
        assert client.lookup("r", keys).results == [HIT] * 12
        out = np.zeros_like(rows)
        engine_load_prefixes(client, "r", batches, pool, out)
        assert np.array_equal(out, rows)
        assert client.status().tiering.pinned_slots == 0

        missing = [batches[0], keys_for("never-stored", 4), batches[2]]
        out[:] = 0
        with pytest.raises(RuntimeError, match="missed"):
            engine_load_prefixes(client, "r", missing, pool, out)
        assert np.array_equal(out[:4], rows[:4])
        status = client.status()  # the third batch's lookup was sent, then released
        assert status.tiering.pinned_slots == 0
        assert not client.deferred_errors


def test_a_pipelined_store_that_fails_ends_every_slot_it_prepared(start_service):
    service = start_service(block_bytes=BLOCK)
    keys = keys_for("pipelined-store-fails", 9)
    rows = rows_for(9, 3)
    batches = [keys[0:3], keys[3:6], keys[6:9]]
    with service.client("engine") as client, service_pool(client) as pool:
        client.new_request("r")
        short = rows[:5]  # the second batch runs out of rows: its copy raises
        with pytest.raises(ValueError):
            engine_store_prefixes(client, "r", batches, pool, short)
        outcome = client.lookup("r", keys)
        assert outcome.results[:3] == [HIT] * 3
        assert outcome.results[3] == MISS  # neither the failed batch nor the one prepared ahead
        assert client.lookup("r", keys[6:]).results == [MISS]
        assert not client.deferred_errors
