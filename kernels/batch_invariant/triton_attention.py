"""Batch-invariant paged attention on the Triton kernels: every query row (prefill, decode or
verify) runs as a decode row of its own, through `decode_attention` with one split.

The decode kernel gives one program per (row, KV head group) and reads the row's keys from its
window start (position 0 without a window) to its own position in BLOCK_N-key tiles, with no
split-K and no reduce step, and its query heads sit in fixed lanes of the tile. The order a
row's keys are summed in then depends only on the row's own position (and the layer's shapes),
never on the batch, on what else runs in the step, or on how a prompt was split into prefill
chunks: the Triton counterpart of the C kernel's `aligned` chunk starts. The prefill kernel is
not used: it packs several query tokens into one tile and starts its key loop at the first
token's window, so a row's order would follow the chunk it came in.
"""

from __future__ import annotations

import torch
from raylane.kernels.attention.metadata import AttentionMetadata


def rows_as_decodes(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_tables [T, W], seq_lens [T]) of the step's T query rows, each as a decode of its
    own: row t of sequence i sees positions 0 .. its own, so its length is that position + 1.
    Device ops only (no host sync), as a graph's capture needs."""
    starts = meta.query_start_loc.long()  # [B + 1]
    tokens = torch.arange(meta.num_tokens, device=starts.device)  # [T]
    seq = torch.searchsorted(starts[1:], tokens, right=True)  # [T] each row's sequence
    seq = seq.clamp(max=starts.shape[0] - 2)  # rows past the last sequence (a graph's padding)
    q_lens = starts[1:] - starts[:-1]  # [B]
    # row t's position is the sequence's cached context plus t's offset in its chunk
    position = meta.seq_lens.long()[seq] - q_lens[seq] + (tokens - starts[seq])
    lens = torch.where(tokens < starts[-1], position + 1, 0).clamp(min=0)  # padding: 0, zeros
    return meta.block_tables[seq], lens.to(torch.int32)
