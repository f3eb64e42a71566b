"""Hybrid-model bookkeeping without torch: layer kinds and their memory, state slots, state
snapshots, and the block manager freeing blocks wholly outside a sliding window."""

from __future__ import annotations

import pytest
from raylane.actors.engine.block_manager import BlockManager
from raylane.actors.engine.layer_kinds import LayerKind, ModelLayout
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.engine.scheduler import Scheduler
from raylane.actors.engine.sequence import Sequence
from raylane.actors.engine.state_slots import SnapshotCache, StateSlotPool

BS = 4


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(), BS)


# --- layer kinds ------------------------------------------------------------------------------


def test_layer_kinds_validate() -> None:
    with pytest.raises(ValueError, match="unknown"):
        LayerKind("conv")
    with pytest.raises(ValueError, match="window"):
        LayerKind("sliding", 8)
    with pytest.raises(ValueError, match="window"):
        LayerKind("full", 8, window=4)


@pytest.mark.parametrize("n", [0, 1, 5, 8, 9, 10, 11, 12, 13, 40])
def test_sliding_layer_holds_the_blocks_the_next_query_sees(n: int) -> None:
    """Counted naively: the next query (position n) sees positions n-w+1 .. n-1 of the cache;
    a block is held from the first such block to the last cached one."""
    window = 6
    visible = list(range(max(0, n - window + 1), n))
    want_blocks = len(range(visible[0] // BS, -(-n // BS))) if visible else 0
    layer = LayerKind("sliding", 10, window=window)
    assert layer.tokens_held(n, BS) == want_blocks * BS
    assert LayerKind("full", 10).tokens_held(n, BS) == -(-n // BS) * BS


def test_layout_memory_and_fit() -> None:
    full, lin = LayerKind("full", kv_bytes_per_token=100), LayerKind("linear", state_bytes=5000)
    layout = ModelLayout((lin, lin, lin, full))
    assert layout.kinds == {"full", "linear"} and layout.state_bytes == 15000
    assert layout.window is None
    # 40 tokens: 10 blocks of 4 tokens, 100 bytes each in the one full layer, + the state
    assert layout.bytes_per_sequence(40, BS) == 4000 + 15000
    assert layout.bytes_per_sequence(40, BS, snapshots=2) == 4000 + 3 * 15000
    assert (
        layout.max_sequences(kv_bytes=40000, num_state_slots=7, num_tokens=40, block_size=BS) == 7
    )
    assert (
        layout.max_sequences(kv_bytes=20000, num_state_slots=7, num_tokens=40, block_size=BS) == 5
    )
    sliding = ModelLayout(
        (LayerKind("sliding", 1, window=8), lin, LayerKind("sliding", 1, window=8))
    )
    assert sliding.window == 8
    assert ModelLayout((LayerKind("sliding", 1, window=8), full)).window is None


# --- state slots and snapshots ----------------------------------------------------------------


def test_state_slots_allocate_free_preempt_restore() -> None:
    pool = StateSlotPool(2)
    a, b = pool.allocate(1), pool.allocate(2)
    assert {a, b} == {0, 1} and pool.allocate(1) == a  # idempotent for a holder
    assert not pool.can_allocate()
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    pool.free_sequence(2)  # preempted: its slot returns
    assert pool.slot_of(2) is None and pool.allocate(3) == b
    pool.free_sequence(1)
    pool.free_sequence(1)  # twice is harmless
    assert pool.allocate(2) == a  # restored (re-admitted) into a free slot
    with pytest.raises(ValueError, match="num_state_slots"):
        StateSlotPool(0)


def test_snapshots_longest_prefix_and_lru_bound() -> None:
    snaps = SnapshotCache(2)
    s10, s20 = snaps.reserve(10), snaps.reserve(20)
    assert s10 is not None and s20 is not None and snaps.reserve(20) is None
    assert snaps.lookup([10, 20, 30]) == (2, s20)
    assert snaps.lookup([10, 99]) == (1, s10)  # 10 is now the most recently used
    s30 = snaps.reserve(30)  # the pool is full: 20, least recently used, goes
    assert s30 == s20 and snaps.lookup([10, 20]) == (1, s10)
    snaps.clear()  # new weights
    assert snaps.lookup([10, 20, 30]) is None
    assert SnapshotCache(0).reserve(1) is None


def test_prefix_hit_stops_at_the_longest_snapshot_and_new_weights_drop_them() -> None:
    bm = BlockManager(16, BS, snapshots=SnapshotCache(4))
    tokens = list(range(5 * BS + 1))
    first = make_seq(tokens)
    bm.allocate(first, len(first))
    first.num_computed_tokens = len(first)
    bm.commit_full_blocks(first)  # 5 full blocks in the prefix cache
    slot = bm.reserve_snapshot(first, 2)  # its state after 2 blocks (a chunk ended there)
    assert slot is not None and bm.reserve_snapshot(first, 2) is None
    second = make_seq(tokens)
    assert bm.allocate_cached_prefix(second) == 2 * BS  # not 5 blocks: no state past 2
    assert second.restore_snapshot == slot and second.block_table == first.block_table[:2]
    assert all(bm.blocks[b].ref_count == 1 for b in first.block_table[2:])  # given back
    bm.free_sequence(second)
    other = make_seq([7] + tokens[1:])  # another first block: another chain, no snapshot
    assert bm.allocate_cached_prefix(other) == 0 and other.restore_snapshot is None
    bm.free_sequence(other)
    bm.version += 1  # new weights: chains root elsewhere, the old snapshot never matches
    newer = make_seq(tokens)
    newer.cache_version = bm.version
    assert bm.allocate_cached_prefix(newer) == 0
    bm.reset_prefix_cache()  # weights loaded in place: snapshots go with the cached blocks
    assert not bm.snapshots.by_hash


def test_decode_rows_publish_into_the_pool_by_queued_copies() -> None:
    snaps = SnapshotCache(2)
    assert snaps.decode_row(0) == 2 and snaps.decode_row(3) == 5  # after the pool's rows
    snaps.publish(3, chain_hash=77)
    snaps.publish(1, chain_hash=77)  # that block has a snapshot already: nothing to copy
    (copy,) = snaps.take_copies()
    assert copy[0] == 5 and snaps.lookup([77]) == (1, copy[1]) and snaps.take_copies() == ()
    snaps.publish(0, chain_hash=78)
    snaps.clear()  # new weights: a queued copy would fill a slot that is free again
    assert snaps.take_copies() == () and snaps.lookup([77, 78]) is None


def test_queued_copies_wait_for_a_step_that_runs() -> None:
    # an empty step sends no plan: the copies stay queued for the next one that does
    bm = BlockManager(8, BS, snapshots=SnapshotCache(2))
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=16, states=StateSlotPool(2))
    bm.snapshots.publish(1, chain_hash=77)
    assert sched.schedule().snapshot_copies == () and len(bm.snapshots.copies) == 1
    sched.add(make_seq([1, 2, 3]))
    assert sched.schedule().snapshot_copies == ((3, 0),) and not bm.snapshots.copies


# --- sliding-window block freeing -------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_window_freeing_keeps_memory_bounded_and_the_window_mapped(prefix_caching: bool) -> None:
    window, num_blocks = 6, 8
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix_caching)
    seq = make_seq(list(range(3)))
    for step in range(60):  # a 3-token prompt chunk, then decode one token per step
        num_new = len(seq) - seq.num_computed_tokens
        bm.allocate(seq, num_new)
        seq.num_computed_tokens += num_new
        bm.commit_full_blocks(seq)
        bm.free_outside_window(seq, window)
        n = seq.num_computed_tokens
        live = seq.block_table[seq.num_released_blocks :]
        # every position the next query sees is in a block the sequence still holds
        for p in range(max(0, n - window + 1), n):
            assert p // BS >= seq.num_released_blocks
            assert bm.blocks[seq.block_table[p // BS]].ref_count == 1
        assert len(live) <= -(-window // BS) + 2  # O(window), not O(n)
        assert bm.num_free_blocks == num_blocks - len(live)
        seq.append_token(1000 + step, 0.0, None)
    assert len(seq) > num_blocks * BS  # longer than the whole pool could hold unfreed
    bm.free_sequence(seq)
    assert bm.num_free_blocks == num_blocks and seq.num_released_blocks == 0


def test_window_freeing_leaves_a_shared_prefix_to_its_other_holder() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(4 * BS + 1))
    first, second = make_seq(tokens), make_seq(tokens)
    for seq in (first, second):
        cached = bm.allocate_cached_prefix(seq)
        seq.num_computed_tokens = cached
        bm.allocate(seq, len(seq) - cached)
        seq.num_computed_tokens = len(seq)
        bm.commit_full_blocks(seq)
    assert second.block_table[:4] == first.block_table[:4]
    bm.free_outside_window(first, 2)
    released = first.block_table[: first.num_released_blocks]
    assert released and all(bm.blocks[b].ref_count == 1 for b in released)  # second's
    bm.free_sequence(second)
    bm.free_sequence(first)
    assert bm.num_free_blocks == 16
