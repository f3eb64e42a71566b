"""MLA's expanded form (the batch-invariant mode's, actors/models/mla.py) on CUDA: each sequence's
cached latents expanded into per-head keys and values, then every query row attended as a
one-split decode of its own on the Triton decode kernel (triton_attention.py's form).

On the CPU the mode re-pages each sequence's context (a host sync) and attends on the C kernel.
Here the context rows are gathered through the block tables on the device, in place: the
expanded keys of sequence b's block w sit in block b * W + w of a temporary cache (W the
tables' width), so no host sync is needed and a decode step captures in a CUDA graph. The cost
is O(B * W * block_size) kv_b_proj rows a step (W the widest table, under a graph the model's
longest), the price of equality with a trainer's expanded attention. `expand` runs kv_b_proj
through the invariant matmul, so a position's keys are the same bits whatever else is
expanded beside them, and the decode kernel's order per row depends on the row's position
alone. Under TRITON_INTERPRET=1 this runs on CPU tensors (tests).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from raylane.kernels.attention.metadata import AttentionMetadata
from raylane.kernels.attention.triton_decode import decode_attention
from raylane.kernels.batch_invariant.triton_attention import rows_as_decodes


def context_rows(
    cache: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of every block the tables name, cache [slots, ...] -> (rows [B * W *
    block_size, ...], tables [B, W] int32 over them: block w of sequence b is b * W + w)."""
    batch, width = block_tables.shape
    offsets = torch.arange(block_size, device=cache.device)
    slots = block_tables.long().clamp(min=0)[..., None] * block_size + offsets  # [B, W, bs]
    tables = torch.arange(batch * width, device=cache.device, dtype=torch.int32)
    return cache.index_select(0, slots.flatten()), tables.view(batch, width)


def expanded_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttentionMetadata,
    expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> torch.Tensor:
    """q [T, H, nope + R] (unabsorbed) over the latent cache [slots, 1, L + R] (the step's rows
    already stored); `expand`: rows [N, 1, L + R] -> (keys [N, H, nope + R], values [N, H, v])
    -> [T, H, v], each row as a one-split decode of its own."""
    rows, tables = context_rows(latent_cache, meta.block_tables, meta.block_size)
    keys, values = expand(rows)
    row_tables, lens = rows_as_decodes(dataclasses.replace(meta, block_tables=tables))
    out = q.new_empty(q.shape[0], q.shape[1], values.shape[-1])
    decode_attention(
        q.contiguous(), keys, values, row_tables, lens, scale, meta.block_size, out,
        num_splits=1,
    )  # fmt: skip
    return out
