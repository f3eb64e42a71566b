"""BlockManager: allocation, ref counts, hash-chain prefix matching, LRU eviction, counters."""

from __future__ import annotations

import pytest
from raylane.actors.engine.block_manager import BlockManager
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.engine.sequence import Sequence

BS = 4


def make_seq(tokens: list[int], block_size: int = BS) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(), block_size)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """What one engine step does for a fresh sequence: look up, allocate, compute, commit."""
    cached = bm.allocate_cached_prefix(seq)
    seq.num_computed_tokens = cached
    bm.allocate(seq, len(seq) - cached)
    seq.num_computed_tokens = len(seq)
    bm.commit_full_blocks(seq)


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def block_run(start: int, n_blocks: int) -> list[int]:
    """Tokens filling `n_blocks` blocks, distinct per block."""
    return list(range(start, start + n_blocks * BS))


# --- allocation and ref counts ----------------------------------------------------------------


def test_allocate_covers_tokens_and_sets_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(10)))  # 10 tokens -> 3 blocks
    assert bm.blocks_needed(seq, 10) == 3
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    assert bm.usage() == pytest.approx(3 / 8)


def test_allocate_extends_only_when_a_block_fills():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(6)))
    bm.allocate(seq, 6)
    seq.num_computed_tokens = 6
    seq.append_token(100, None, None)
    seq.append_token(101, None, None)
    assert bm.blocks_needed(seq, 1) == 0  # position 6 is in block 1
    seq.num_computed_tokens = 7
    assert bm.blocks_needed(seq, 1) == 0  # position 7 is the last slot of block 1
    seq.num_computed_tokens = 8
    assert bm.blocks_needed(seq, 1) == 1
    assert bm.can_allocate(5) and not bm.can_allocate(7)


def test_free_sequence_returns_blocks():
    bm = BlockManager(num_blocks=6, block_size=BS)
    seq = make_seq(list(range(9)))
    compute_all(bm, seq)
    bm.free_sequence(seq)
    assert seq.block_table == [] and seq.num_hashed_blocks == 0
    assert bm.num_free_blocks == 6 and ref_counts(bm) == [0] * 6


# --- hash chain -------------------------------------------------------------------------------


def test_shared_prefix_shares_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(block_run(0, 3) + [99])
    compute_all(bm, a)
    b = make_seq(block_run(0, 2) + block_run(500, 1) + [7])  # third block differs
    assert bm.allocate_cached_prefix(b) == 2 * BS
    assert b.block_table == a.block_table[:2]
    assert b.num_hashed_blocks == 2
    for i, block_id in enumerate(a.block_table):
        assert bm.blocks[block_id].ref_count == (2 if i < 2 else 1)


def test_divergent_block_breaks_chain_even_if_later_blocks_match():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(block_run(0, 3) + [99])
    compute_all(bm, a)
    # block 0 differs, blocks 1 and 2 are identical to a's: the chain hash makes them misses
    b = make_seq(block_run(700, 1) + a.token_ids[BS:])
    assert bm.allocate_cached_prefix(b) == 0
    assert b.block_table == []
    # identical block 0, different block 1, identical block 2: only block 0 hits
    c = make_seq(a.token_ids[:BS] + block_run(800, 1) + a.token_ids[2 * BS :])
    assert bm.allocate_cached_prefix(c) == BS
    assert c.block_table == a.block_table[:1]


def test_lookup_leaves_at_least_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(block_run(0, 3))
    compute_all(bm, a)
    same = make_seq(block_run(0, 3))  # exactly the 3 cached full blocks
    same.num_computed_tokens = bm.allocate_cached_prefix(same)
    assert same.num_computed_tokens == 2 * BS
    assert bm.blocks_needed(same, BS) == 1  # the last token needs its own (fresh) block
    one_block = make_seq(block_run(0, 1))
    assert bm.allocate_cached_prefix(one_block) == 0


def test_hit_and_query_counters():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(block_run(0, 2) + [1, 2])  # 10 prompt tokens, nothing cached yet
    compute_all(bm, a)
    b = make_seq(block_run(0, 2) + [3])  # 9 prompt tokens, 8 cached
    bm.allocate_cached_prefix(b)
    assert bm.num_queries == 10 + 9
    assert bm.num_hits == 8


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    a = make_seq(block_run(0, 3) + [1])
    compute_all(bm, a)
    assert all(bm.blocks[b].hash is None for b in a.block_table)
    b = make_seq(block_run(0, 3) + [1])
    assert bm.allocate_cached_prefix(b) == 0 and b.block_table == []


# --- commit_full_blocks -----------------------------------------------------------------------


def test_commit_registers_only_fully_computed_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(block_run(0, 3) + [5])
    bm.allocate(a, len(a))
    a.num_computed_tokens = BS + 2  # chunked prefill stopped inside block 1
    bm.commit_full_blocks(a)
    assert a.num_hashed_blocks == 1
    assert bm.blocks[a.block_table[0]].hash is not None
    assert bm.blocks[a.block_table[1]].hash is None
    probe = make_seq(block_run(0, 3) + [6])
    assert bm.allocate_cached_prefix(probe) == BS
    bm.free_sequence(probe)
    a.num_computed_tokens = len(a)  # the next chunk finishes the prompt
    bm.commit_full_blocks(a)
    assert a.num_hashed_blocks == 3
    probe = make_seq(block_run(0, 3) + [6])
    assert bm.allocate_cached_prefix(probe) == 3 * BS


def test_commit_hashes_generated_tokens_too():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(block_run(0, 1) + [1, 2])
    compute_all(bm, a)
    for tok in (3, 4):  # decode fills block 1 with two generated tokens
        a.append_token(tok, None, None)
        bm.allocate(a, 1)
        a.num_computed_tokens += 1
        bm.commit_full_blocks(a)
    assert a.num_hashed_blocks == 2
    b = make_seq(block_run(0, 1) + [1, 2, 3, 4, 9])
    assert bm.allocate_cached_prefix(b) == 2 * BS
    assert b.block_table == a.block_table[:2]


def test_commit_after_shared_prefix_extends_the_same_chain():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(block_run(0, 2) + [1])
    compute_all(bm, a)
    b = make_seq(block_run(0, 2) + block_run(300, 1) + [2])
    compute_all(bm, b)  # hits 2 blocks, computes and registers block 2
    c = make_seq(block_run(0, 2) + block_run(300, 1) + [3])
    assert bm.allocate_cached_prefix(c) == 3 * BS
    assert c.block_table == b.block_table[:3]


# --- eviction ---------------------------------------------------------------------------------


def fill_exactly(bm: BlockManager, tokens: list[int]) -> Sequence:
    seq = make_seq(tokens)
    compute_all(bm, seq)
    return seq


def test_unreferenced_cached_blocks_survive_until_needed():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = fill_exactly(bm, block_run(0, 3) + [1])
    bm.free_sequence(a)
    b = make_seq(block_run(0, 3) + [2])
    assert bm.allocate_cached_prefix(b) == 3 * BS


def test_eviction_takes_tail_blocks_before_shared_prefix():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = fill_exactly(bm, block_run(0, 4))  # 4 full blocks, all hashed, cache full
    assert bm.num_free_blocks == 0
    table = list(a.block_table)
    bm.free_sequence(a)
    other = make_seq(block_run(900, 3))
    bm.allocate(other, 1)  # needs one fresh block: must evict a's last block
    assert other.block_table == [table[3]]
    b = make_seq(block_run(0, 4) + [1])
    assert bm.allocate_cached_prefix(b) == 3 * BS  # blocks 0..2 still cached
    bm.free_sequence(b)
    other.num_computed_tokens = BS
    bm.allocate(other, 2 * BS)  # two more: evicts block 2 then block 1
    assert other.block_table[1:] == [table[2], table[1]]
    c = make_seq(block_run(0, 4))
    assert bm.allocate_cached_prefix(c) == BS


def cache_two(bm: BlockManager, free_order: str) -> dict[str, list[int]]:
    """Compute "a" (tokens 0..) and "b" (100..), two blocks each, and free them in `free_order`."""
    seqs = {"a": fill_exactly(bm, block_run(0, 2)), "b": fill_exactly(bm, block_run(100, 2))}
    tables = {name: list(seq.block_table) for name, seq in seqs.items()}
    for name in free_order:
        bm.free_sequence(seqs[name])
    return tables


def evict_two(bm: BlockManager) -> list[int]:
    fresh = make_seq(block_run(900, 2))
    bm.allocate(fresh, 2 * BS)
    return sorted(fresh.block_table)


def test_eviction_order_is_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    tables = cache_two(bm, "ba")  # a freed last: most recently used
    assert evict_two(bm) == sorted(tables["b"])
    assert bm.allocate_cached_prefix(make_seq(block_run(0, 2) + [1])) == 2 * BS
    assert bm.allocate_cached_prefix(make_seq(block_run(100, 2) + [1])) == 0


def test_a_hit_refreshes_recency():
    bm = BlockManager(num_blocks=4, block_size=BS)
    tables = cache_two(bm, "ab")
    reuse = make_seq(block_run(0, 2) + [7])  # a's blocks are taken again, then released
    bm.allocate_cached_prefix(reuse)
    bm.free_sequence(reuse)
    assert evict_two(bm) == sorted(tables["b"])


def test_unused_blocks_are_taken_before_cached_ones():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = fill_exactly(bm, block_run(0, 2))
    bm.free_sequence(a)
    fresh = make_seq(block_run(900, 4))
    bm.allocate(fresh, 4 * BS)  # exactly the 4 never-used blocks
    assert not set(fresh.block_table) & set(a.block_table)
    assert bm.allocate_cached_prefix(make_seq(block_run(0, 2) + [1])) == 2 * BS


def test_evicted_block_no_longer_matches_its_old_prefix():
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = fill_exactly(bm, block_run(0, 2))
    bm.free_sequence(a)
    other = fill_exactly(bm, block_run(500, 2))  # overwrites both blocks
    bm.free_sequence(other)
    assert bm.allocate_cached_prefix(make_seq(block_run(0, 2) + [1])) == 0
    assert bm.allocate_cached_prefix(make_seq(block_run(500, 2) + [1])) == 2 * BS


# --- reset ------------------------------------------------------------------------------------


def test_reset_prefix_cache_forgets_hashes_but_keeps_blocks_in_use():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = fill_exactly(bm, block_run(0, 2) + [1])
    done = fill_exactly(bm, block_run(100, 2) + [1])
    bm.free_sequence(done)
    held = list(a.block_table)
    bm.reset_prefix_cache()
    assert all(bm.blocks[b].ref_count == 1 for b in held)
    assert bm.num_free_blocks == 8 - len(held)
    assert bm.allocate_cached_prefix(make_seq(block_run(0, 2) + [1])) == 0
    assert bm.allocate_cached_prefix(make_seq(block_run(100, 2) + [1])) == 0
    # a fresh computation after the reset registers again
    new = fill_exactly(bm, block_run(200, 2) + [1])
    bm.free_sequence(new)
    assert bm.allocate_cached_prefix(make_seq(block_run(200, 2) + [2])) == 2 * BS


def test_sequence_running_across_a_reset_does_not_register_a_broken_chain():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(block_run(0, 3) + [1])
    bm.allocate(a, len(a))
    a.num_computed_tokens = BS
    bm.commit_full_blocks(a)
    bm.reset_prefix_cache()
    a.num_computed_tokens = len(a)
    bm.commit_full_blocks(a)
    # block 1's hash would hang off a forgotten parent: nothing below block 0 may match
    assert bm.allocate_cached_prefix(make_seq(block_run(0, 3) + [2])) == 0
