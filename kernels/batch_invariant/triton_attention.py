"""Batch-invariant paged attention on the Triton kernels: every query row (prefill, decode or
verify) runs as a decode row of its own, through `decode_attention` with one split.

The decode kernel gives one program per (row, KV head group) and reads the row's keys from its
window start (position 0 without a window) to its own position in BLOCK_N-key tiles, with no
split-K and no reduce step, and its query heads sit in fixed lanes of the tile. The order a
row's keys are summed in then depends only on the row's own position (and the layer's shapes),
never on the batch, on what else runs in the step, or on how a prompt was split into prefill
chunks: the Triton counterpart of the C kernel's `aligned` chunk starts. The prefill kernel is
not used: it packs several query tokens into one tile and starts its key loop at the first
token's window, so a row's order would follow the chunk it came in. A trainer's forward inside
`raylane.batch_invariant()` on CUDA runs its rows the same way (`attend_as_decodes`).
"""

from __future__ import annotations

import torch
from raylane.kernels.attention.metadata import AttentionMetadata
from raylane.kernels.attention.triton_decode import decode_attention


def rows_as_decodes(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_tables [T, W], seq_lens [T]) of the step's T query rows, each as a decode of its
    own: row t of sequence i sees positions 0 .. its own, so its length is that position + 1.
    Device ops only (no host sync), as a graph's capture needs."""
    starts = meta.query_start_loc.long()  # [B + 1]
    tokens = torch.arange(meta.num_tokens, device=starts.device)  # [T]
    seq = _sequence_of_rows(starts, tokens)
    q_lens = starts[1:] - starts[:-1]  # [B]
    # row t's position is the sequence's cached context plus t's offset in its chunk
    position = meta.seq_lens.long()[seq] - q_lens[seq] + (tokens - starts[seq])
    lens = torch.where(tokens < starts[-1], position + 1, 0).clamp(min=0)  # padding: 0, zeros
    return meta.block_tables[seq], lens.to(torch.int32)


def attend_as_decodes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    block_size: int,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A trainer's teacher-forced attention inside `raylane.batch_invariant()` on CUDA, as the
    engine's mode runs it: q [N, H, D], sequence i's rows query_start_loc[i] .. [i + 1] at its
    positions 0, 1, ..., its keys in the paged caches through tables[i] (block_size slots a
    block) -> [N, H, Dv], each row a one-split decode over its own keys."""
    device = q.device
    starts = query_start_loc.to(device).long()  # [B + 1]
    tokens = torch.arange(q.shape[0], device=device)  # [N]
    seq = _sequence_of_rows(starts, tokens)
    lens = (tokens - starts[seq] + 1).to(torch.int32)  # a row sees itself and what precedes
    out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    decode_attention(
        q, k_cache, v_cache, tables.to(device)[seq], lens, scale, block_size, out,
        num_splits=1, window=window, sinks=sinks,
    )  # fmt: skip
    return out


def _sequence_of_rows(starts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[T]: each row's sequence, from the sequences' first rows `starts` [B + 1]; rows past the
    last sequence (a graph's padding) count as the last one's."""
    seq = torch.searchsorted(starts[1:], tokens, right=True)
    return seq.clamp(max=starts.shape[0] - 2)
