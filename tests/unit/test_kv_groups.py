"""KV cache groups without torch: how a model's sliding and full layers split into groups, and
the block manager keeping one table per group, freeing the sliding groups' blocks outside
their window and serving prefix hits only where every group has what the next query sees."""

from __future__ import annotations

import pytest
from raylane.actors.engine.block_manager import BlockManager
from raylane.actors.engine.layer_kinds import group_size_for, kv_groups
from raylane.actors.engine.sampling_params import SamplingParams
from raylane.actors.engine.sequence import Sequence

BS, WINDOW = 4, 6
S, F = WINDOW, None  # a sliding and a full layer's window


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(), BS)


@pytest.mark.parametrize(
    "windows, want_groups, want_size",
    [
        ([S, F] * 3, (F, S), 3),  # gpt-oss: alternating, equal counts
        ([S] * 5 + [F], (F, S, S, S, S, S), 1),  # Gemma 3: five sliding to one full
        # Gemma 3 1B: 22 sliding + 4 full in groups of 2 (the gcd), none padded
        ([S] * 5 + [F] + [S] * 17 + [F] * 3, (F, F) + (S,) * 11, 2),
        ([S, S, F, S, S, S, F], (F, F, S, S, S, S, S), 1),  # gcd 1: 7 groups, not 2 x 4
        # uneven: gcd 1 would make 8 groups, over twice the 3 of the rarest kind's count: the
        # last sliding group has 2 layers in blocks sized for 3
        ([S, S, F, S, S, S, F, F], (F, S, S), 3),
        ([F, F, F], (F,), 3),  # one kind: one group of every layer
        ([S, S], (S,), 2),
    ],
)
def test_layers_split_into_groups_that_waste_no_rows_unless_too_many(
    windows, want_groups, want_size
):
    groups = kv_groups(windows)
    assert groups.windows == want_groups and groups.group_size == want_size
    # every layer sits in a group of its own window, at an index below the group size, and
    # no two layers share a (group, index): they would write the same cache rows
    assert len(set(groups.layer_groups)) == len(windows)
    for window, (group, index) in zip(windows, groups.layer_groups):
        assert groups.windows[group] == window and index < want_size


def run_decode(bm: BlockManager, seq: Sequence, steps: int) -> list[tuple[int, int]]:
    """Prefill, then decode `steps` tokens as the scheduler does (free, allocate, compute,
    commit); returns (full group, sliding group) blocks held after each allocation."""
    held = []
    for step in range(steps):
        bm.free_outside_windows(seq)
        num_new = len(seq) - seq.num_computed_tokens
        bm.allocate(seq, num_new)
        held.append((len(seq.block_table), len(seq.group_tables[0]) - seq.group_released[0]))
        seq.num_computed_tokens += num_new
        bm.commit_full_blocks(seq)
        seq.append_token(1000 + step, 0.0, None)
    return held


def test_sliding_group_holds_o_window_blocks_and_maps_the_window() -> None:
    num_blocks = 30
    bm = BlockManager(num_blocks, BS, windows=(F, S))
    seq = make_seq(list(range(7)))
    held = run_decode(bm, seq, 60)
    n = seq.num_computed_tokens  # 66 tokens: 17 blocks each, 34 unfreed, more than the pool
    assert held[-1][0] == -(-n // BS) and 2 * held[-1][0] > num_blocks
    assert max(sliding for _, sliding in held) <= -(-(WINDOW + 1) // BS) + 2
    assert bm.groups.blocks_to_hold(n + 1, 1) >= max(full + sliding for full, sliding in held)
    # every position the next query sees is in a sliding-group block the sequence holds
    table, released = seq.group_tables[0], seq.group_released[0]
    for p in range(n - WINDOW + 1, n):
        assert p // BS >= released and bm.blocks[table[p // BS]].ref_count == 1
    assert set(table[released:]).isdisjoint(seq.block_table)  # a block is in one group
    bm.free_sequence(seq)
    assert bm.num_free_blocks == num_blocks and seq.group_tables == []


def test_no_freeing_holds_every_block() -> None:
    # what a draft model over a model whose layers all slide gets (setup._frees_windows)
    bm = BlockManager(64, BS, windows=(F, S), frees_windows=False)
    seq = make_seq(list(range(7)))
    held = run_decode(bm, seq, 30)
    assert held[-1][1] == held[-1][0] == -(-36 // BS)
    assert bm.groups.blocks_to_hold(36, 1) == 2 * 9


def test_prefix_hit_takes_each_groups_window_blocks_and_nulls_before_them() -> None:
    bm = BlockManager(64, BS, windows=(F, S))
    prompt = list(range(6 * BS + 2))  # 6 full blocks, then 2 tokens
    first = make_seq(prompt)
    run_decode(bm, first, 1)  # the prompt in one chunk: every block committed while held
    bm.free_sequence(first)
    second = make_seq(prompt)
    cached = bm.allocate_cached_prefix(second)
    assert cached == 6 * BS and len(second.block_table) == 6
    # the query at position 24 sees positions 19.. (window 6, one of slack: 18..): blocks 4, 5
    table = second.group_tables[0]
    assert table[:4] == [bm.null_block] * 4 and second.group_released[0] == 4
    assert all(bm.blocks[b].ref_count == 1 for b in table[4:] + second.block_table)
    bm.free_sequence(second)
    assert bm.num_free_blocks == 64


def test_prefix_hit_is_cut_where_a_sliding_block_is_gone() -> None:
    bm = BlockManager(64, BS, windows=(F, S))
    prompt = list(range(6 * BS + 2))
    first = make_seq(prompt)
    run_decode(bm, first, 1)
    bm.free_sequence(first)
    probe = make_seq(prompt)
    bm.allocate_cached_prefix(probe)
    evicted = probe.group_tables[0][-1]  # the sliding group's block 5
    bm.free_sequence(probe)
    bm.cached.pop(bm.blocks[evicted].hash)  # evicted (as if handed out to another)
    second = make_seq(prompt)
    # block 5 of the sliding group is gone: a hit of 5 blocks needs its blocks 3 and 4 only
    assert bm.allocate_cached_prefix(second) == 5 * BS
    assert second.group_tables[0][:3] == [bm.null_block] * 3 and len(second.block_table) == 5
    bm.free_sequence(second)
    assert bm.num_free_blocks == 64


def test_bench_memory_counts_the_block_managers_held_blocks() -> None:
    from raylane.actors.engine.layer_kinds import LayerKind, ModelLayout

    from benchmarks.hybrid import held_kv_bytes

    kv = 10  # bytes per token per layer
    sliding, full = LayerKind("sliding", kv, window=8), LayerKind("full", kv)
    layout = ModelLayout((sliding, full, sliding, full))  # two groups of two layers
    # at 100 tokens the full group holds 25 blocks; the sliding group the blocks of positions
    # 91 (slack) .. 99 the next query sees: blocks 22, 23, 24; a block holds 2 layers' K/V
    assert held_kv_bytes(layout, 100, block_size=4, chunk=16) == (25 + 3) * 4 * 2 * kv
    assert held_kv_bytes(ModelLayout((full, full)), 100, block_size=4) == 25 * 4 * 2 * kv


def test_longest_hit_equals_a_naive_search() -> None:
    import random

    from raylane.actors.engine.group_windows import GroupWindows

    rng = random.Random(3)
    for _ in range(300):
        windows = (F, *rng.sample([3, 6, 9, 17], k=rng.randint(1, 3)))
        groups = GroupWindows(windows, BS)
        keep = rng.randint(0, 12)
        found = [[None if rng.random() < 0.15 else 1 for _ in range(keep)] for _ in windows[1:]]

        def whole(k: int) -> bool:  # every group has each block the query at block k sees
            return all(
                found[g - 1][i] is not None
                for g in range(1, len(windows))
                for i in range(groups.first_kept(g, k * BS), k)
            )

        want = next(k for k in range(keep, -1, -1) if whole(k))
        assert groups.longest_hit(found, keep) == want


@pytest.mark.parametrize(
    "counts, want",
    [
        ([18, 18], 18),  # gpt-oss
        ([22, 4], 2),  # Gemma 3 1B: the gcd, 13 groups, none padded
        ([40, 8], 8),  # Gemma 3 12B
        ([29, 5], 5),  # Gemma 3 4B: gcd 1 would be 34 groups against 7: one layer padded
        ([52, 10], 10),  # Gemma 3 27B: gcd 2 would be 31 groups against 7
        ([7], 7),
    ],
)
def test_group_size_is_the_gcd_unless_it_more_than_doubles_the_groups(counts, want) -> None:
    assert group_size_for(counts) == want
