"""The CPU attention backend: the C kernel of cpu_kernel.py reads K/V straight from the paged
cache through the block table, so no layer gathers a sequence's context into a copy.

It runs every row of a step, prefill chunks and decodes alike, from the metadata's tensors.
"""

from __future__ import annotations

import raylane.kernels.attention.cpu_kernel as cpu_kernel
from raylane.kernels.attention.metadata import AttentionMetadata
from raylane.kernels.attention.torch_ref import store_kv


class CpuPagedAttention:
    """`aligned` (the batch-invariant mode): sliding windows reduce over key chunks aligned to
    absolute positions, so a row's order does not follow the tile or prefill split it is in."""

    name = "cpu"

    def __init__(self, aligned: bool = False) -> None:
        self.aligned = aligned

    def forward(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
        window: int | None = None, sinks=None,
    ):  # fmt: skip
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[2])  # [T, H, Dv]
        return cpu_kernel.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            out,
            block_size=meta.block_size,
            window=window,
            sinks=sinks,
            aligned=self.aligned,
        )
