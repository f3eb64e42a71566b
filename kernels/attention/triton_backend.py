"""The GPU attention backend: the Triton kernels of triton_kernels.py behind the backend API.

Everything is launched from the metadata's tensors and host ints, with no host sync, so a
decode step captures in a CUDA graph (the split count follows `meta.max_seq_len`, which a
graph's metadata fixes at the model's maximum).
"""

from __future__ import annotations

import raylane.kernels.attention.triton_kernels as tk
from raylane.kernels.attention.metadata import AttentionMetadata


class TritonAttention:
    name = "triton"

    def __init__(self, invariant: bool = False) -> None:
        # the batch-invariant mode: every query row as a one-split decode of its own
        # (kernels/batch_invariant/triton_attention.py)
        self.invariant = invariant

    def forward(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
        window: int | None = None, sinks=None,
    ):  # fmt: skip
        tk.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[2])  # [T, H, Dv]
        if self.invariant:
            self._rows_as_decodes(q, k_cache, v_cache, meta, scale, out, window, sinks)
            return out
        split, first = meta.num_prefill_tokens, meta.num_prefills
        if meta.num_prefills:
            tk.prefill_attention(
                q[:split], k_cache, v_cache, meta.block_tables[:first], meta.seq_lens[:first],
                meta.query_start_loc[: first + 1], meta.max_query_len, scale, meta.block_size,
                out[:split], window, sinks,
            )  # fmt: skip
        if meta.num_decodes:
            splits = tk.pick_num_splits(meta.num_decodes, k_cache.shape[1], meta.max_seq_len)
            tk.decode_attention(
                q[split:], k_cache, v_cache, meta.block_tables[first:], meta.seq_lens[first:],
                scale, meta.block_size, out[split:],
                num_splits=splits, window=window, sinks=sinks,
            )  # fmt: skip
        return out

    @staticmethod
    def _rows_as_decodes(q, k_cache, v_cache, meta, scale, out, window, sinks) -> None:
        """The batch-invariant mode: every query row (prefill, decode, verify) a one-split
        decode of its own, its keys summed from its window's start in fixed tiles."""
        from raylane.kernels.batch_invariant.triton_attention import rows_as_decodes

        tables, lens = rows_as_decodes(meta)
        tk.decode_attention(
            q, k_cache, v_cache, tables, lens, scale, meta.block_size, out,
            num_splits=1, window=window, sinks=sinks,
        )  # fmt: skip
