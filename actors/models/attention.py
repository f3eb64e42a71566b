"""The attention layer of every model: writes the step's K/V into the paged cache and attends."""

from __future__ import annotations

import torch
from raylane.kernels.attention import AttentionBackend, AttentionMetadata, get_backend
from torch import nn


class Attention(nn.Module):
    """Paged attention over this layer's slice of the KV cache.

    The runner attaches `k_cache` / `v_cache` ([num_slots, num_kv_heads, head_dim]) after it has
    sized the cache, and may swap `backend` for one chosen at start-up.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend: AttentionBackend = get_backend("torch")
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        # q [T, H, D], k/v [T, KVH, D] -> [T, H, D]
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("Attention.k_cache is not attached; the runner allocates it")
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, attn, self.scale)
