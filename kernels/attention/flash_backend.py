"""The GPU attention backend on vLLM's flash-attention fork (flash_fork.py): FA2 on SM80+, FA3
on SM90, behind the backend API.

One `flash_attn_varlen_func` call per layer serves every row of a step (prefill chunks, verify
rows and decodes), reading K/V through the block table from the paged cache viewed as
[num_blocks, block_size, H_kv, D]: the call vLLM's FlashAttentionImpl makes. It launches from
the metadata's tensors and host ints with no host sync, so decode and verify steps capture in
CUDA graphs. MLA, DSA and linear attention keep their own paths (see `unfit`).
"""

from __future__ import annotations

import torch
from raylane.kernels.attention.flash_fork import FlashFork
from raylane.kernels.attention.metadata import AttentionMetadata
from raylane.kernels.attention.torch_ref import store_kv

# the layer kinds the fork serves; "sinks" (s_aux) only on FA3, FA2 rejects it
KINDS = frozenset({"full", "sliding", "softcap"})
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_SIZE = 256


def unfit(
    fork: FlashFork,
    kinds: frozenset[str],
    dtype: torch.dtype | None,
    head_sizes: tuple[int, ...],
    block_size: int | None,
) -> str | None:
    """Why `fork` cannot serve a model with these layer kinds and shapes, or None (vLLM's
    FlashAttentionBackend limits: fp16/bf16, head sizes a multiple of 8 up to 256, blocks a
    multiple of 16)."""
    serves = KINDS | ({"sinks"} if fork.fa_version == 3 else set())
    if "sinks" in kinds - serves:
        return f"FA{fork.fa_version} has no attention sinks (s_aux needs FA3, an SM90 GPU)"
    if kinds - serves:
        return f"layer kinds {sorted(kinds - serves)} keep their own paths"
    if dtype is not None and dtype not in DTYPES:
        return f"dtype {dtype} is not float16 or bfloat16"
    bad = [d for d in head_sizes if d % 8 or d > MAX_HEAD_SIZE]
    if bad:
        return f"head sizes {bad} are not multiples of 8 up to {MAX_HEAD_SIZE}"
    if block_size is not None and block_size % 16:
        return f"block_size {block_size} is not a multiple of 16"
    return None


class FlashAttention:
    name = "flash_attn"

    def __init__(self, fork: FlashFork, num_splits: int = 0):
        self.fork = fork
        # 0: the kernel picks its split-K count per shape; 1: one reduction order whatever the
        # batch (the batch-invariant mode). FA2 takes no count above 1.
        self.num_splits = num_splits

    def forward(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
        window: int | None = None, sinks: torch.Tensor | None = None, softcap: float = 0.0,
    ):  # fmt: skip
        """As `AttentionBackend.forward`; `softcap` > 0 caps each logit at cap * tanh(s / cap)
        (Gemma 2's attention soft-capping, the layer kind "softcap")."""
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[2])  # [T, H, Dv]
        paged = (-1, meta.block_size, k_cache.shape[1])  # [num_blocks, block_size, H_kv, D]
        self.fork.varlen(
            q=q,
            k=k_cache.view(*paged, k_cache.shape[2]),
            v=v_cache.view(*paged, v_cache.shape[2]),
            max_seqlen_q=meta.max_query_len,
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_k=meta.max_seq_len,
            seqused_k=meta.seq_lens,  # required with a block table (no cu_seqlens_k)
            softmax_scale=scale,
            causal=True,  # bottom-right aligned: query j sits at seq_len - q_len + j
            # a query sees `window` keys, itself included: window - 1 to its left
            window_size=(-1, -1) if window is None else (window - 1, 0),
            softcap=softcap,
            block_table=meta.block_tables,
            out=out,
            num_splits=self.num_splits,
            fa_version=self.fork.fa_version,
            # NOTE: the kernel reads the sinks in the query's dtype
            s_aux=None if sinks is None else sinks.to(q.dtype),
        )
        return out
