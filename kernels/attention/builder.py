"""Build `AttentionMetadata` from plain per-sequence facts (torch-free inputs, CPU tensors out)."""

from __future__ import annotations

import itertools
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
    """Metadata for a step whose flat tokens are `prefills` then `decodes`, in that order.

    Callers that sort `decodes` by context length let them split into less padded groups.
    """
    slots = _slot_mapping(prefills + decodes, block_size)
    start, groups = 0, []
    for seqs in ([prefills] if prefills else []) + split_by_length(decodes):
        groups.append(_padded(seqs, start, block_size, device, dtype))
        start += sum(s.num_new for s in seqs)
    return AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=device), groups)


def split_by_length(seqs: list[SeqSlice], min_group: int = 8) -> list[list[SeqSlice]]:
    """Cut a run of sequences where that saves the most padded context positions.

    One cut at most, and only when each side keeps `min_group` sequences and the padded total
    shrinks by a quarter: every extra group costs a kernel call per layer.
    """
    if len(seqs) < 2 * min_group:
        return [seqs] if seqs else []
    lens = [s.context_len for s in seqs]
    head = list(itertools.accumulate(lens, max))  # head[i]: longest of seqs[:i + 1]
    tail = list(itertools.accumulate(reversed(lens), max))[::-1]  # tail[i]: of seqs[i:]
    cost = len(seqs) * head[-1]
    best, cut = cost, None
    for i in range(min_group, len(seqs) - min_group + 1):
        split = i * head[i - 1] + (len(seqs) - i) * tail[i]
        if split < best:
            best, cut = split, i
    if cut is None or best > 0.75 * cost:
        return [seqs]
    return [seqs[:cut], seqs[cut:]]


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
