"""Per-step attention metadata, built once per step by the input preparer and shared by layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PaddedBatch:
    """A group of sequences laid out padded, so one batched attention call covers them all.

    The step's flat tokens `[start, start + num_tokens)` belong to this group, sequence after
    sequence; `flat_index` scatters them into the padded `[batch, max_q]` query grid.
    """

    start: int  # first flat token of the group
    num_tokens: int
    max_q: int  # longest query (1 for decode)
    flat_index: torch.Tensor | None  # [num_tokens] int64 into batch * max_q; None when max_q == 1
    gather_slots: torch.Tensor  # [batch, max_ctx] int64 KV slots of every context position (0 pad)
    # [batch, 1, max_q, max_ctx] additive, in the model's dtype: 0 where a query may attend,
    # -inf elsewhere (a float mask saves every layer a bool -> float conversion)
    mask: torch.Tensor
    # every sequence starts at position 0 (no cached context): plain causal attention over the
    # step's own K/V, with no mask and no gather from the cache
    fresh: bool = False

    @property
    def batch(self) -> int:
        return self.gather_slots.shape[0]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; tokens are flat, prefill chunks before decodes."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: the KV slot each new token is written to
    # consecutive runs of the flat tokens, each attended in one padded call: the prefills, then
    # the decodes (split by context length so short contexts are not padded to the longest)
    groups: list[PaddedBatch]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
