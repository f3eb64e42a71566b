"""Build `AttentionMetadata` from plain per-sequence facts (torch-free inputs, tensors out)."""

from __future__ import annotations

import numpy as np
import torch
from raylane.kernels.attention.metadata import AttentionMetadata, SeqSlice

__all__ = ["SeqSlice", "block_tables", "build_metadata", "slot_mapping"]


def build_metadata(
    prefills: list[SeqSlice],
    decodes: list[SeqSlice],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for a step whose flat tokens are `prefills` then `decodes`, in that order."""
    seqs = prefills + decodes
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.num_new)
    as_tensor = lambda x, dtype: torch.tensor(x, dtype=dtype).to(device)  # noqa: E731
    return AttentionMetadata(
        slot_mapping=as_tensor(slot_mapping(seqs, block_size), torch.long),
        query_start_loc=as_tensor(starts, torch.int32),
        seq_lens=as_tensor([s.context_len for s in seqs], torch.int32),
        block_tables=block_tables(seqs, block_size).to(device),
        num_prefills=len(prefills),
        num_prefill_tokens=sum(s.num_new for s in prefills),
        max_query_len=max((s.num_new for s in seqs), default=0),
        max_seq_len=max((s.context_len for s in seqs), default=0),
        block_size=block_size,
        seqs=seqs,
    )


def block_tables(seqs: list[SeqSlice], block_size: int) -> torch.Tensor:
    """[B, W] int32: each sequence's blocks up to its context, padded with 0 (built in numpy:
    a tensor copy per row, or torch.tensor on nested lists, costs several times more)."""
    used = [-(-s.context_len // block_size) for s in seqs]
    width = max(used, default=1)
    rows = [list(s.block_table[:n]) + [0] * (width - n) for s, n in zip(seqs, used)]
    return torch.from_numpy(np.array(rows, dtype=np.int32).reshape(len(seqs), width))


def slot_mapping(seqs: list[SeqSlice], block_size: int) -> list[int]:
    slots: list[int] = []
    for s in seqs:
        for pos in range(s.context_len - s.num_new, s.context_len):
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
    return slots
