"""The peer tier's index and the ordering of one node's stream, as pure bookkeeping."""

from __future__ import annotations

from workers.peer.index import (
    DISK_TIER,
    POOL_TIER,
    Change,
    NodeFeed,
    PeerIndex,
    TierChange,
)


def stored(tier: int, *keys: bytes) -> TierChange:
    return TierChange(Change.STORED, tier, keys)


def removed(tier: int, *keys: bytes) -> TierChange:
    return TierChange(Change.REMOVED, tier, keys)


CLEARED = TierChange(Change.CLEARED)


def test_a_key_is_indexed_while_some_node_holds_it_in_some_tier():
    index = PeerIndex(max_keys=100)
    index.apply("a", [stored(POOL_TIER, b"k1", b"k2"), stored(DISK_TIER, b"k1")])
    index.apply("b", [stored(POOL_TIER, b"k2")])
    assert index.take_changes() == ([b"k1", b"k2"], [])
    assert index.holders(b"k2") == ["a", "b"]

    index.apply("a", [removed(POOL_TIER, b"k1")])  # still on a's disk
    index.apply("a", [removed(POOL_TIER, b"k2")])  # still on b
    assert index.take_changes() == ([], [])
    assert index.holders(b"k1") == ["a"] and index.holders(b"k2") == ["b"]

    index.apply("a", [removed(DISK_TIER, b"k1"), removed(POOL_TIER, b"never-told")])
    index.clear("b")
    assert index.take_changes() == ([], [b"k1", b"k2"])
    assert len(index) == 0


def test_a_key_that_comes_and_goes_between_reports_is_not_reported():
    index = PeerIndex(max_keys=100)
    index.apply("a", [stored(POOL_TIER, b"k"), removed(POOL_TIER, b"k")])
    assert index.take_changes() == ([], [])


def test_the_index_is_bounded_and_counts_what_it_left_out():
    index = PeerIndex(max_keys=2)
    index.apply("a", [stored(POOL_TIER, b"k1", b"k2", b"k3")])
    assert len(index) == 2 and index.keys_not_indexed == 1
    index.apply("b", [stored(POOL_TIER, b"k1")])  # a second holder of an indexed key fits
    assert index.holders(b"k1") == ["a", "b"]


def test_a_restarted_manager_gets_the_whole_index_and_then_only_changes():
    index = PeerIndex(max_keys=100)
    index.apply("a", [stored(POOL_TIER, b"k1", b"k2")])
    assert sorted(index.announce_all()) == [b"k1", b"k2"]
    assert index.take_changes() == ([], [])
    index.apply("a", [CLEARED, stored(POOL_TIER, b"k2")])
    assert index.take_changes() == ([], [b"k1"])


def test_batches_apply_in_sequence_after_the_snapshot():
    feed = NodeFeed()
    assert feed.wants_snapshot
    assert feed.on_batch(5, [stored(POOL_TIER, b"early")]) == []  # kept until the snapshot
    assert feed.on_batch(7, [stored(POOL_TIER, b"after")]) == []
    ready = feed.on_snapshot("run1", 6, [CLEARED, stored(POOL_TIER, b"snap")])
    # the snapshot, then nothing: batch 6 is missing, batch 5 is older than the snapshot
    assert ready == [[CLEARED, stored(POOL_TIER, b"snap")]]
    assert feed.replay_from == 6
    ready = feed.on_replay("run1", [(6, [stored(POOL_TIER, b"six")])])
    assert ready == [[stored(POOL_TIER, b"six")], [stored(POOL_TIER, b"after")]]
    assert feed.next_seq == 8 and feed.replay_from == -1


def test_a_gap_asks_for_a_catch_up_and_a_duplicate_is_ignored():
    feed = NodeFeed()
    feed.on_snapshot("run1", 0, [CLEARED])
    assert feed.on_batch(0, [stored(POOL_TIER, b"a")]) == [[stored(POOL_TIER, b"a")]]
    assert feed.on_batch(2, [stored(POOL_TIER, b"c")]) == []
    assert feed.replay_from == 1
    assert feed.on_batch(2, [stored(POOL_TIER, b"c")]) == []  # a resend while waiting
    ready = feed.on_replay("run1", [(1, [stored(POOL_TIER, b"b")]), (2, [])])
    assert ready == [[stored(POOL_TIER, b"b")], [stored(POOL_TIER, b"c")]]


def test_a_new_run_or_a_replay_that_no_longer_reaches_back_wants_a_snapshot():
    feed = NodeFeed()
    feed.on_snapshot("run1", 10, [CLEARED])
    assert feed.on_replay("run2", []) == []  # the node's manager restarted
    assert feed.wants_snapshot

    feed = NodeFeed()
    feed.on_snapshot("run1", 10, [CLEARED])
    feed.on_batch(12, [])
    assert feed.on_replay("run1", [(13, [])]) == []  # batch 11 is gone from the node's buffer
    assert feed.wants_snapshot

    feed = NodeFeed()
    feed.on_snapshot("run1", 10, [CLEARED])
    assert feed.on_batch(0, []) == []  # numbered from 0 again: a restart
    assert feed.wants_snapshot


def test_a_feed_too_far_behind_gives_up_on_catching_up():
    feed = NodeFeed(max_kept=3)
    feed.on_snapshot("run1", 0, [CLEARED])
    for seq in range(2, 6):
        feed.on_batch(seq, [])
    assert feed.wants_snapshot
