"""The window arithmetic of KV cache groups (layer_kinds.KVGroups), torch-free: which of a
group's blocks the next query still sees, and how many blocks a sequence can hold at most."""

from __future__ import annotations

from dataclasses import dataclass

from raylane.actors.engine.layer_kinds import first_live_block


@dataclass(frozen=True)
class GroupWindows:
    windows: tuple[int | None, ...] = (None,)  # each group's window (None: full attention)
    block_size: int = 16
    # blocks wholly outside a window are freed as a sequence runs (setup._frees_windows)
    frees: bool = True

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def reach(self, group: int) -> int | None:
        """The window a group's blocks are kept for: one position of slack, since a grammar
        skip recomputes the last position."""
        window = self.windows[group]
        return None if window is None else window + 1

    def first_kept(self, group: int, num_computed: int) -> int:
        """The group's first block the query at position `num_computed` can see."""
        return first_live_block(num_computed, self.reach(group), self.block_size)

    def blocks_to_hold(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks one sequence of `num_tokens` holds at once: every group's whole
        table, or, where blocks outside a window are freed, the window, one step's reach
        (`max_step_tokens`) and one more step's (a sliding group 0 keeps the blocks its hash
        chain has not reached, and async scheduling commits a step late), with a block of
        slack at each end and the chain's root."""
        total = -(-num_tokens // self.block_size)
        held = 0
        for group in range(self.num_groups):
            reach = self.reach(group)
            if reach is None or not self.frees:
                held += total
            else:
                held += min(total, -(-(reach + 2 * max_step_tokens) // self.block_size) + 3)
        return held

    def longest_hit(self, found: list[list[int | None]], keep: int) -> int:
        """The longest prefix, `keep` blocks at most, after which the next query finds every
        block it sees in each group after the first (`found[g - 1][i]`: group g's cached
        block i, None where it has none)."""
        last_miss = [_last_misses(block_ids) for block_ids in found]
        while keep and any(
            misses[keep] >= self.first_kept(g + 1, keep * self.block_size)
            for g, misses in enumerate(last_miss)
        ):
            keep -= 1
        return keep


def _last_misses(block_ids: list[int | None]) -> list[int]:
    """[k]: the last index below k whose block is missing (None), -1 when none is."""
    out = [-1]
    for i, block_id in enumerate(block_ids):
        out.append(i if block_id is None else out[-1])
    return out
