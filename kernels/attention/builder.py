"""Build `AttentionMetadata` from plain per-sequence facts (torch-free inputs, CPU tensors out)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention.metadata import AttentionMetadata, PaddedBatch


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a step: `num_new` tokens ending at context length `context_len`."""

    num_new: int
    context_len: int  # tokens in the KV cache after this step (cached + new)
    block_table: list[int]


def build_metadata(prefills: list[SeqSlice], decodes: list[SeqSlice], block_size: int,
                   device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> AttentionMetadata:
    slots = _slot_mapping(prefills + decodes, block_size)
    start = 0
    groups: list[PaddedBatch | None] = []
    for seqs in (prefills, decodes):
        groups.append(_padded(seqs, start, block_size, device, dtype) if seqs else None)
        start += sum(s.num_new for s in seqs)
    return AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=device), *groups)


def _slot_mapping(seqs: list[SeqSlice], block_size: int) -> list[int]:
    slots: list[int] = []
    for s in seqs:
        for pos in range(s.context_len - s.num_new, s.context_len):
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
    return slots


def _padded(seqs: list[SeqSlice], start: int, block_size: int, device,
            dtype: torch.dtype) -> PaddedBatch:
    batch = len(seqs)
    max_q = max(s.num_new for s in seqs)
    max_ctx = max(s.context_len for s in seqs)
    blocks = torch.zeros(batch, -(-max_ctx // block_size), dtype=torch.long)
    for i, s in enumerate(seqs):
        used = -(-s.context_len // block_size)
        blocks[i, :used] = torch.tensor(s.block_table[:used], dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    gather = (blocks.unsqueeze(-1) * block_size + offsets).view(batch, -1)[:, :max_ctx].contiguous()
    ctx = torch.tensor([s.context_len for s in seqs], dtype=torch.long)
    num_new = torch.tensor([s.num_new for s in seqs], dtype=torch.long)
    # query i of a sequence sits at position context_len - num_new + i and sees keys <= it
    q_pos = (ctx - num_new).unsqueeze(1) + torch.arange(max_q).unsqueeze(0)  # [batch, max_q]
    k_pos = torch.arange(max_ctx).view(1, 1, max_ctx)
    allowed = (k_pos <= q_pos.unsqueeze(-1)) & (k_pos < ctx.view(-1, 1, 1))
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    flat_index = None
    if max_q > 1:
        flat_index = torch.cat([torch.arange(s.num_new) + i * max_q for i, s in enumerate(seqs)])
        flat_index = flat_index.to(device)
    fresh = max_q > 1 and all(s.num_new == s.context_len for s in seqs)
    return PaddedBatch(start, int(num_new.sum()), max_q, flat_index, gather.to(device),
                       mask.unsqueeze(1).to(device), fresh)
