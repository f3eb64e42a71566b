"""Per-step attention metadata, built once per step by the input preparer and shared by layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a step: `num_new` tokens ending at context length `context_len`."""

    num_new: int
    context_len: int  # tokens in the KV cache after this step (cached + new)
    block_table: list[int]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, in the flat layout kernels read.

    Sequences are prefill chunks first (any number of new tokens, after any cached context),
    then decodes (one new token each). Query j of sequence i sits at position
    `seq_lens[i] - q_len_i + j` and attends positions 0 .. that one, read from the paged cache
    (the backend stores the step's K/V first). No masks: kernels derive them from the lengths,
    so decode metadata has the same shapes every step and can live in a captured graph.
    """

    slot_mapping: torch.Tensor  # [T] int64: the KV slot each new token is written to
    query_start_loc: torch.Tensor  # [B + 1] int32: sequence i's tokens are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, W] int32: blocks of each sequence, padded with 0
    num_prefills: int  # sequences [0, num_prefills) are prefill chunks, the rest decodes
    num_prefill_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int  # slots per KV block: slot = block * block_size + offset
    # the host-side facts behind the tensors, for backends that plan on the host (the torch
    # reference's prefill path); None for a decode batch replayed from a graph's buffers
    seqs: list[SeqSlice] | None = None
    # a backend's own per-step data (`AttentionBackend.plan`), shared by every layer
    plan: Any = None
    # linear-attention layers' state slots (kernels/linear_attention StateMetadata), if any
    linear: Any = None
    # KV cache groups (a model mixing sliding and full layers): group g's metadata, its own
    # block tables and slot mapping over the same rows; entry 0 is this object. A layer of
    # group g attends with `groups[g]`.
    groups: list[AttentionMetadata] | None = None

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills
