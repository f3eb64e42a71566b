"""Layer kinds as data: what state each layer of a model keeps, and what it costs in memory.

A model declares one `LayerKind` per layer; the engine reads those, never an architecture name:
- "full": paged K/V for every token (MLA is "full" with a smaller row);
- "sliding": paged K/V, but a query sees only the last `window` tokens (itself included), so
  blocks wholly before the window are freed and the layer's memory stays O(window);
- "linear": no paged K/V; a fixed-size recurrent + conv state per sequence (a state slot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

KINDS = ("full", "sliding", "linear")


@dataclass(frozen=True)
class LayerKind:
    kind: str
    kv_bytes_per_token: int = 0  # paged kinds: K and V of one token in this layer
    window: int | None = None  # sliding: keys a query sees, itself included
    state_bytes: int = 0  # linear: conv + recurrent state of one sequence

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layer kind: unknown {self.kind!r}; known: {KINDS}")
        if (self.kind == "sliding") != (self.window is not None):
            raise ValueError("layer kind: a window is given exactly for sliding layers")
        if self.window is not None and self.window < 1:
            raise ValueError(f"layer kind: window must be at least 1, got {self.window}")

    def tokens_held(self, num_tokens: int, block_size: int) -> int:
        """Paged tokens (whole blocks) this layer holds for a sequence of `num_tokens`."""
        if self.kind == "linear":
            return 0
        end = -(-num_tokens // block_size)
        return (end - first_live_block(num_tokens, self.window, block_size)) * block_size

    def bytes_per_sequence(self, num_tokens: int, block_size: int) -> int:
        return self.tokens_held(num_tokens, block_size) * self.kv_bytes_per_token + self.state_bytes


def first_live_block(num_computed: int, window: int | None, block_size: int) -> int:
    """The first block the next query (position `num_computed`) can still see; every block
    before it is wholly outside the window. 0 without a window."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


@dataclass(frozen=True)
class ModelLayout:
    """Every layer's kind, in order."""

    layers: tuple[LayerKind, ...]

    @cached_property
    def kinds(self) -> frozenset[str]:
        return frozenset(layer.kind for layer in self.layers)

    @cached_property
    def state_bytes(self) -> int:
        """One state slot: every linear layer's state for one sequence."""
        return sum(layer.state_bytes for layer in self.layers)

    @cached_property
    def window(self) -> int | None:
        """The window shared by every paged layer when all of them slide (blocks can then be
        freed from one shared table); None when any layer attends in full."""
        paged = [layer for layer in self.layers if layer.kind != "linear"]
        windows = {layer.window for layer in paged}
        return windows.pop() if len(windows) == 1 and None not in windows else None

    def bytes_per_sequence(self, num_tokens: int, block_size: int, snapshots: int = 0) -> int:
        """KV blocks held at `num_tokens`, one state slot, and `snapshots` state snapshots."""
        kv = sum(layer.bytes_per_sequence(num_tokens, block_size) for layer in self.layers)
        return kv + snapshots * self.state_bytes

    def max_sequences(self, kv_bytes: int, num_state_slots: int, num_tokens: int,
                      block_size: int) -> int:  # fmt: skip
        """How many sequences of `num_tokens` fit at once: the paged budget and the state slots
        each bound it (for the start-up log)."""
        paged = self.bytes_per_sequence(num_tokens, block_size) - self.state_bytes
        by_kv = kv_bytes // paged if paged else None
        by_state = num_state_slots if self.state_bytes else None
        bounds = [b for b in (by_kv, by_state) if b is not None]
        return min(bounds) if bounds else 0


@dataclass(frozen=True)
class KVGroups:
    """The paged layers split into KV cache groups, one kind of window per group (vLLM's
    hybrid allocator): a model that mixes sliding and full layers gives each kind its own
    block tables, so its sliding layers free what falls out of their window while its full
    layers keep every block.

    Every group has `group_size` layers (the last of a kind may have fewer) and layer `j` of
    every group shares one set of cache tensors: a block id belongs to one group at a time, so
    a block costs `group_size` layers' K/V, not every layer's. Group 0 is a full group when
    the model has one; its chain is what prefix caching hashes.
    """

    windows: tuple[int | None, ...]  # each group's window (None: full attention)
    layer_groups: tuple[tuple[int, int], ...]  # per paged layer: (group, index in its group)
    group_size: int  # cache tensor sets: layers of one group

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_groups(windows: list[int | None]) -> KVGroups:
    """Group paged layers by window, full first, in groups of `group_size_for` layers."""
    by_window: dict[int | None, list[int]] = {}
    for i, window in enumerate(windows):
        by_window.setdefault(window, []).append(i)
    size = group_size_for([len(layers) for layers in by_window.values()])
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    if len(order) <= 1:  # one kind: one group of every layer
        return KVGroups((order[0] if order else None,), tuple((0, i) for i in range(len(windows))),
                        len(windows))  # fmt: skip
    group_windows: list[int | None] = []
    placed: dict[int, tuple[int, int]] = {}
    for window in order:
        layers = by_window[window]
        for start in range(0, len(layers), size):
            for j, layer in enumerate(layers[start : start + size]):
                placed[layer] = (len(group_windows), j)
            group_windows.append(window)
    return KVGroups(tuple(group_windows), tuple(placed[i] for i in range(len(windows))), size)


def group_size_for(counts: list[int]) -> int:
    """Layers per KV cache group, given each kind's layer count. A block costs `size` layers'
    K/V in every group, so a kind whose count `size` does not divide pads its last group (Gemma
    3's 22 sliding + 4 full in groups of 4: 28 layers' rows for 26). Groups of the counts' gcd
    waste nothing, but each group costs host time every step (its own metadata, table and slot
    mapping: ~10 us at batch 1): the gcd, unless it more than doubles the groups that the
    rarest kind's count makes (then that count, padded)."""
    if not counts:
        return 0
    rarest, exact = min(counts), math.gcd(*counts)
    num_groups = lambda size: sum(-(-count // size) for count in counts)  # noqa: E731
    return exact if num_groups(exact) <= 2 * num_groups(rarest) else rarest
