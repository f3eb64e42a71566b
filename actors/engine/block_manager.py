"""Paged KV blocks per sequence: a hash chain over full blocks, KV cache groups, sliding windows."""

from __future__ import annotations

from typing import cast

from raylane.actors.engine.block_pool import BlockPool
from raylane.actors.engine.group_windows import GroupWindows
from raylane.actors.engine.layer_kinds import first_live_block
from raylane.actors.engine.sequence import Sequence
from raylane.actors.engine.state_slots import SnapshotCache


class BlockManager(BlockPool):
    """Hands out KV blocks and takes them back; never looks at tensors.

    A full block is registered under `hash((parent_hash, tokens))`, so two sequences with the same
    prefix map to the same chain. The blocks themselves, their counts, the free list and the
    hash -> block map are its base's, `BlockPool`.

    A model that mixes sliding and full layers has several KV cache groups (`windows`, one
    per group, see layer_kinds.KVGroups): a sequence holds one table per group over the one
    pool of blocks, the sliding groups' leading blocks are freed as the window moves on, and
    group 0's chain is the one hashed. Another group's full block is cached under (group,
    group 0's chain hash at that block), and a prefix hit also needs each group's blocks that
    the next query sees; entries of a group's table before them are `null_block`.

    Every chain starts from the weight version its sequence was admitted under
    (`Sequence.cache_version`), so KV computed under one version is never reused by a request
    prefilled under another: a weight update bumps `version` and the old chains simply stop
    matching (and age out), with no work at update time and no race with sequences in flight.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        snapshots: SnapshotCache | None = None,
        windows: tuple[int | None, ...] = (None,),
        frees_windows: bool = True,
    ):
        assert snapshots is None or len(windows) == 1, "state snapshots with KV cache groups"
        super().__init__(num_blocks)
        self.block_size = block_size
        frees = frees_windows and any(w is not None for w in windows)
        self.groups = GroupWindows(windows, block_size, frees)
        # linear-attention models: recurrent-state snapshots at block boundaries, by chain hash;
        # a prefix hit then stops at the longest cached prefix that has one
        self.snapshots = snapshots
        self.enable_prefix_caching = enable_prefix_caching
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0  # of those, tokens found
        self.version = 0  # the weights' version: new sequences root their chains at it

    @property
    def windows(self) -> tuple[int | None, ...]:
        return self.groups.windows

    @property
    def frees_windows(self) -> bool:
        return self.groups.frees

    # --- allocation ---------------------------------------------------------------------------

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a fresh sequence the cached blocks of its longest cached prefix; returns tokens.

        At least one token is always left to compute, so the step can produce logits.
        """
        assert not seq.block_table, "sequence already holds blocks"
        self._start_groups(seq)
        if not self.enable_prefix_caching:
            return 0
        full = (len(seq) - 1) // self.block_size
        parent = _root_of(seq)
        hashes: list[int] = []
        for i in range(full):
            tokens = tuple(seq.block_tokens(i))
            h = hash((parent, tokens))
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            hashes.append(parent := h)
        if self.snapshots is not None:
            self._cut_to_snapshot(seq, hashes)
        if len(self.windows) > 1:
            self._take_group_hits(seq, hashes)
        seq.num_hashed_blocks = len(seq.block_table)
        cached = len(seq.block_table) * self.block_size
        self.num_queries += seq.num_prompt_tokens
        self.num_hits += min(cached, seq.num_prompt_tokens)
        return cached

    def _cut_to_snapshot(self, seq: Sequence, hashes: list[int]) -> None:
        """Keep the hit only up to the longest prefix whose recurrent state was snapshotted
        (the state the next token needs); the blocks after it go back."""
        assert self.snapshots is not None
        found = self.snapshots.lookup(hashes)
        keep, seq.restore_snapshot = found if found is not None else (0, None)
        self._cut_hit(seq, keep)

    def _cut_hit(self, seq: Sequence, keep: int) -> None:
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def _take_group_hits(self, seq: Sequence, hashes: list[int]) -> None:
        """Keep the hit only up to the longest prefix whose blocks the next query sees are
        cached in every other group too; the group tables start with null blocks before
        them (never read, never freed). Linear in the prefix: each group's cached blocks are
        looked up once."""
        keep, size = len(seq.block_table), self.block_size
        tokens = [tuple(seq.block_tokens(i)) for i in range(keep)]
        found = [
            [self._cached(_group_hash(g, hashes[i]), tokens[i]) for i in range(keep)]
            for g in range(1, len(self.windows))
        ]
        keep = self.groups.longest_hit(found, keep)
        self._cut_hit(seq, keep)
        for g, block_ids in enumerate(found):
            start = self.groups.first_kept(g + 1, keep * size)
            taken = cast(list[int], block_ids[start:keep])
            for block_id in taken:
                self._take(block_id)
            seq.group_tables[g] = [self.null_block] * start + taken
            seq.group_released[g] = start

    def reserve_snapshot(self, seq: Sequence, num_blocks: int) -> int | None:
        """A snapshot slot for the sequence's state after its first `num_blocks` blocks, keyed
        by their chain hash (None: snapshots are off, or that prefix has one)."""
        if self.snapshots is None:
            return None
        parent = _root_of(seq)
        for i in range(num_blocks):
            parent = hash((parent, tuple(seq.block_tokens(i))))
        return self.snapshots.reserve(parent)

    def blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = seq.num_blocks_for(seq.num_computed_tokens + num_new)
        groups = seq.group_tables or [[]] * (len(self.windows) - 1)
        return sum(max(0, total - len(table)) for table in [seq.block_table, *groups])

    def allocate(self, seq: Sequence, num_new: int) -> None:
        """Extend the sequence's tables (one per group) to cover `num_new` more tokens."""
        self._start_groups(seq)
        total = seq.num_blocks_for(seq.num_computed_tokens + num_new)
        for table in [seq.block_table, *seq.group_tables]:
            while len(table) < total:
                table.append(self._fresh())

    def _start_groups(self, seq: Sequence) -> None:
        if len(seq.group_tables) != len(self.windows) - 1:
            seq.group_tables = [[] for _ in self.windows[1:]]
            seq.group_released = [0] * len(seq.group_tables)

    # --- after a step -------------------------------------------------------------------------

    def commit_full_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Register the hashes of blocks that became full: all their tokens computed, by steps
        whose results arrived (`num_computed`, default the sequence's count)."""
        if not self.enable_prefix_caching:
            return
        start = seq.num_hashed_blocks
        parent = self.blocks[seq.block_table[start - 1]].hash if start else _root_of(seq)
        if parent is None:
            return  # the cache was reset under this sequence: its chain cannot be extended
        if num_computed is None:
            num_computed = seq.num_computed_tokens
        for i in range(start, num_computed // self.block_size):
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.block_tokens(i))
            if block.hash is None:
                self._register(block, hash((parent, tokens)), tokens)
            parent = block.hash
            assert parent is not None
            for g, table in enumerate(seq.group_tables):
                group_block = self.blocks[table[i]]
                # NOTE: a block freed already (outside the window) may be another's now
                if i >= seq.group_released[g] and group_block.hash is None:
                    self._register(group_block, _group_hash(g + 1, parent), tokens)
            seq.num_hashed_blocks = i + 1

    def free_outside_window(self, seq: Sequence, window: int) -> None:
        """Release the sequence's leading blocks that the next query cannot see (every paged
        layer slides over `window` tokens), so it holds O(window) blocks. Their table entries
        stay, stale, for position arithmetic; the block that roots the rest of the hash chain
        is kept while prefix caching can still extend it."""
        end = first_live_block(seq.num_computed_tokens, window, self.block_size)
        if self.enable_prefix_caching:
            end = min(end, max(0, seq.num_hashed_blocks - 1))
        for i in range(seq.num_released_blocks, end):
            self._release(seq.block_table[i])
        seq.num_released_blocks = max(seq.num_released_blocks, end)

    def free_outside_windows(self, seq: Sequence) -> None:
        """Free every group's blocks wholly outside its window (`free_outside_window`, one
        position of slack), when this manager frees windows at all."""
        if not self.frees_windows:
            return
        if self.windows[0] is not None:
            self.free_outside_window(seq, self.windows[0] + 1)
        for g, table in enumerate(seq.group_tables):
            end = self.groups.first_kept(g + 1, seq.num_computed_tokens)
            for i in range(seq.group_released[g], end):
                self._release(table[i])
            seq.group_released[g] = max(seq.group_released[g], end)

    def free_sequence(self, seq: Sequence) -> None:
        # Tail blocks are released first so they are evicted before the shared prefix.
        for g, table in enumerate(seq.group_tables):
            for block_id in reversed(table[seq.group_released[g] :]):
                self._release(block_id)
        for block_id in reversed(seq.block_table[seq.num_released_blocks :]):
            self._release(block_id)
        seq.group_tables, seq.group_released = [], []
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_released_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after new weights); blocks in use are untouched."""
        self._forget_hashes()
        if self.snapshots is not None:
            self.snapshots.clear()


def _root(version: int, salt: str | None = None, lora: tuple[str, int] | None = None) -> int:
    """The parent hash of a chain's first block: the weight version it was computed under, the
    request's cache salt (`SamplingParams.cache_salt`) when it has one, and the LoRA adapter
    version (name, version) it runs on, if any: no KV is shared across adapters or versions."""
    key: tuple = ("weights", version) if salt is None else ("weights", version, salt)
    return hash(key if lora is None else (*key, "lora", *lora))


def _root_of(seq: Sequence) -> int:
    return _root(seq.cache_version, seq.params.cache_salt, seq.lora.key if seq.lora else None)


def _group_hash(group: int, chain_hash: int) -> int:
    """Where group `group`'s block is cached: the chain hash of group 0's block beside it."""
    return hash(("group", group, chain_hash))
