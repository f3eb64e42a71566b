"""`BlockPool`: the pool of paged KV blocks under `BlockManager` — each block's reference count
and the hash it is cached under, the free blocks in the order they were freed, and the chain
hash -> block map of the prefix cache, whose entry goes when its block is handed out again."""

from __future__ import annotations

from collections import OrderedDict


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "tokens")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.tokens: tuple[int, ...] | None = None


class BlockPool:
    """A block whose count drops to 0 keeps its hash and waits in the free list, oldest first;
    it is evicted only when a fresh block is needed."""

    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # chain hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def null_block(self) -> int:
        """A table entry for a block never read (before a window): the runner's scratch
        block, which is never handed out."""
        return len(self.blocks)

    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free)

    def _fresh(self) -> int:
        block_id, _ = self.free.popitem(last=False)  # least recently freed
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]  # evict
        block.hash, block.tokens, block.ref_count = None, None, 1
        return block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def _cached(self, chain_hash: int, tokens: tuple[int, ...]) -> int | None:
        block_id = self.cached.get(chain_hash)
        return None if block_id is None or self.blocks[block_id].tokens != tokens else block_id

    def _register(self, block: Block, chain_hash: int, tokens: tuple[int, ...]) -> None:
        block.hash, block.tokens = chain_hash, tokens
        self.cached.setdefault(chain_hash, block.block_id)

    def _forget_hashes(self) -> None:
        """Drop every cached hash; blocks in use are untouched."""
        self.cached.clear()
        for block in self.blocks:
            block.hash, block.tokens = None, None
