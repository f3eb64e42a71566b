"""Per-sequence recurrent state (linear-attention layers): a fixed pool of slots, and a bounded
cache of state snapshots for prefix caching. Bookkeeping only; the runner owns the tensors.

A slot holds one sequence's conv and recurrent state for every linear-attention layer (row
`slot` of each layer's state pools). The scheduler allocates a slot when it admits a sequence
and frees it when the sequence finishes or is preempted (by recompute: the state is rebuilt
by prefilling again, from a snapshot when one matches). A snapshot is a copy of a slot taken
once a sequence's state covers a whole number of blocks, keyed by the prefix-cache hash of
the chain up to that block, so a request sharing the prefix resumes from it; snapshots live in
their own fixed pool, least recently used first out, so their memory is bounded.

Decode boundaries: each state slot also has a decode row (after the pool: row
`num_slots + slot`), which a decoding sequence's state is copied into whenever a decode step
ends on a block; when the sequence finishes or is preempted, the row's state is published into
the pool under that block's chain hash (a queued copy the next plan carries), so the next turn
of a conversation, or the sequence's own recompute, resumes past its prompt.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlotPool:
    """Hands out state slots to sequences and takes them back."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_state_slots must be at least 1, got {num_slots}")
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.owner: dict[int, int] = {}  # seq id -> slot

    @property
    def num_free(self) -> int:
        return len(self.free)

    def can_allocate(self, num: int = 1) -> bool:
        return num <= len(self.free)

    def allocate(self, seq_id: int) -> int:
        """A slot for the sequence (the one it holds, if any). The runner zeroes it, or fills
        it from a snapshot, before the sequence's first chunk."""
        if seq_id in self.owner:
            return self.owner[seq_id]
        if not self.free:
            raise RuntimeError("no free state slot: the scheduler must check can_allocate")
        self.owner[seq_id] = slot = self.free.pop()
        return slot

    def slot_of(self, seq_id: int) -> int | None:
        return self.owner.get(seq_id)

    def free_sequence(self, seq_id: int) -> None:
        """Finished or preempted: the slot returns to the pool (a no-op for a slot-less one)."""
        slot = self.owner.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot)


class SnapshotCache:
    """Snapshots of recurrent state at block boundaries, by prefix-chain hash, in a fixed pool of
    `num_slots` snapshot slots; the least recently used one is overwritten first."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.by_hash: OrderedDict[int, int] = OrderedDict()  # chain hash -> snapshot slot
        self.free = list(range(num_slots - 1, -1, -1))
        self.copies: list[tuple[int, int]] = []  # (decode row, snapshot slot) for the next plan

    def decode_row(self, state_slot: int) -> int:
        """The snapshot row that holds a state slot's latest decode boundary."""
        return self.num_slots + state_slot

    def publish(self, state_slot: int, chain_hash: int) -> None:
        """The slot's decode row holds the state at `chain_hash`'s block: copy it into the pool
        (by the next plan, before anything else in its step)."""
        slot = self.reserve(chain_hash)
        if slot is not None:
            self.copies.append((self.decode_row(state_slot), slot))

    def take_copies(self) -> tuple[tuple[int, int], ...]:
        copies, self.copies = tuple(self.copies), []
        return copies

    def lookup(self, chain_hashes: list[int]) -> tuple[int, int] | None:
        """The longest prefix with a snapshot: (number of blocks it covers, snapshot slot)."""
        for n in range(len(chain_hashes), 0, -1):
            slot = self.by_hash.get(chain_hashes[n - 1])
            if slot is not None:
                self.by_hash.move_to_end(chain_hashes[n - 1])
                return n, slot
        return None

    def reserve(self, chain_hash: int) -> int | None:
        """A snapshot slot to copy a state into for `chain_hash` (None: snapshots are off, or
        that prefix has one already)."""
        if not self.num_slots or chain_hash in self.by_hash:
            return None
        if self.free:
            slot = self.free.pop()
        else:
            _, slot = self.by_hash.popitem(last=False)  # evict the least recently used
        self.by_hash[chain_hash] = slot
        return slot

    def clear(self) -> None:
        """New weights: every snapshot is stale (as cached KV is)."""
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.by_hash.clear()
        self.copies = []  # queued ones would fill slots that are free again
