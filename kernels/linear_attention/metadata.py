"""Per-step metadata of linear-attention layers, built once per step and shared by layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from raylane.kernels.linear_attention.verify import VerifyRows


@dataclass
class StateMetadata:
    """Where each sequence's recurrent and conv state lives, in the attention layout.

    Sequences are prefill chunks first, then decodes (one token each), as in
    `AttentionMetadata`. Sequence i reads and writes the slot `state_slots[i]` of every
    linear-attention layer's state pools; a new sequence's slot is zeroed (or filled from a
    cached snapshot) before its first chunk runs.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32
    state_slots: torch.Tensor  # [B] int64
    num_prefills: int
    num_prefill_tokens: int
    max_query_len: int  # the longest sequence's new tokens (1 for a decode batch)
    # the host-side copies the prefill path plans with; None for a graph-replayed decode batch
    query_start_loc_host: list[int] | None = None
    state_slots_host: list[int] | None = None
    # speculative decoding: the rows that verify drafts (verify.py), or None
    verify: VerifyRows | None = None

    @property
    def num_seqs(self) -> int:
        return self.state_slots.shape[0]
