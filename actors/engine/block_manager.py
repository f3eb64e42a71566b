"""Paged KV blocks: reference counts, a hash chain over full blocks, LRU eviction of cached ones."""

from __future__ import annotations

from collections import OrderedDict

from raylane.actors.engine.layer_kinds import first_live_block
from raylane.actors.engine.sequence import Sequence
from raylane.actors.engine.state_slots import SnapshotCache


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "tokens")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.tokens: tuple[int, ...] | None = None


class BlockManager:
    """Hands out KV blocks and takes them back; never looks at tensors.

    A full block is registered under `hash((parent_hash, tokens))`, so two sequences with the same
    prefix map to the same chain. A block whose count drops to 0 keeps its hash and waits in the
    free list, oldest first; it is evicted only when a fresh block is needed.

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
    ):
        self.block_size = block_size
        # linear-attention models: recurrent-state snapshots at block boundaries, by chain hash;
        # a prefix hit then stops at the longest cached prefix that has one
        self.snapshots = snapshots
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # chain hash -> block id
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0  # of those, tokens found
        self.version = 0  # the weights' version: new sequences root their chains at it

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    # --- allocation ---------------------------------------------------------------------------

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a fresh sequence the cached blocks of its longest cached prefix; returns tokens.

        At least one token is always left to compute, so the step can produce logits.
        """
        assert not seq.block_table, "sequence already holds blocks"
        if not self.enable_prefix_caching:
            return 0
        full = (len(seq) - 1) // self.block_size
        parent = _root(seq.cache_version, seq.params.cache_salt)
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
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def reserve_snapshot(self, seq: Sequence, num_blocks: int) -> int | None:
        """A snapshot slot for the sequence's state after its first `num_blocks` blocks, keyed
        by their chain hash (None: snapshots are off, or that prefix has one)."""
        if self.snapshots is None:
            return None
        parent = _root(seq.cache_version, seq.params.cache_salt)
        for i in range(num_blocks):
            parent = hash((parent, tuple(seq.block_tokens(i))))
        return self.snapshots.reserve(parent)

    def blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = seq.num_blocks_for(seq.num_computed_tokens + num_new)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free)

    def allocate(self, seq: Sequence, num_new: int) -> None:
        """Extend the sequence's table to cover `num_new` more tokens."""
        for _ in range(self.blocks_needed(seq, num_new)):
            block_id, _ = self.free.popitem(last=False)  # least recently freed
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]  # evict
            block.hash, block.tokens, block.ref_count = None, None, 1
            seq.block_table.append(block_id)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    # --- after a step -------------------------------------------------------------------------

    def commit_full_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Register the hashes of blocks that became full: all their tokens computed, by steps
        whose results arrived (`num_computed`, default the sequence's count)."""
        if not self.enable_prefix_caching:
            return
        start = seq.num_hashed_blocks
        parent = (
            self.blocks[seq.block_table[start - 1]].hash
            if start
            else _root(seq.cache_version, seq.params.cache_salt)
        )
        if parent is None:
            return  # the cache was reset under this sequence: its chain cannot be extended
        if num_computed is None:
            num_computed = seq.num_computed_tokens
        for i in range(start, num_computed // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                tokens = tuple(seq.block_tokens(i))
                block.hash, block.tokens = hash((parent, tokens)), tokens
                self.cached.setdefault(block.hash, block.block_id)
            parent = block.hash
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

    def free_sequence(self, seq: Sequence) -> None:
        # Tail blocks are released first so they are evicted before the shared prefix.
        for block_id in reversed(seq.block_table[seq.num_released_blocks :]):
            self._release(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_released_blocks = 0

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after new weights); blocks in use are untouched."""
        self.cached.clear()
        if self.snapshots is not None:
            self.snapshots.clear()
        for block in self.blocks:
            block.hash, block.tokens = None, None


def _root(version: int, salt: str | None = None) -> int:
    """The parent hash of a chain's first block: the weight version it was computed under, and
    the request's cache salt (`SamplingParams.cache_salt`) when it has one."""
    return hash(("weights", version) if salt is None else ("weights", version, salt))
