"""The attention layers of every model: each writes the step's keys into its paged cache and
attends. A layer declares its cache layout (`kind`, `cache_shapes`); the runner sizes and
attaches the tensors, and picks a backend that serves every kind the model has.

- `Attention` ("full"): per-head K and V, [num_slots, num_kv_heads, head_dim] each.
- `LatentAttention` ("mla", DeepSeek's multi-head latent attention): one row per slot holding
  the compressed `kv_lora_rank` latent then the rope key, [num_slots, 1, kv_lora_rank + rope].
  Attention runs in the absorbed form: the query arrives already multiplied into the latent
  space (W_UK folded in by the model), the keys are the rows, the values their latent part
  (a view of the same cache), and the model applies W_UV to the [T, H, kv_lora_rank] output.
  That is multi-query attention with key dim L + R and value dim L, which backends serve.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from raylane.kernels.attention import AttentionBackend, AttentionMetadata, get_backend
from raylane.kernels.batch_invariant.attention import attend, repage
from torch import nn


class Attention(nn.Module):
    """Paged attention over this layer's slice of the KV cache.

    The runner attaches `k_cache` / `v_cache` ([num_slots, num_kv_heads, head_dim]) after it has
    sized the cache, and may swap `backend` for one chosen at start-up.
    """

    kind = "full"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        window: int | None = None,
        sinks: bool = False,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # a sliding layer: each query sees its last `window` keys (itself included)
        self.window = window
        if window is not None:
            self.kind = "sliding"
        # learned per-head logits joining each softmax's denominator (gpt-oss), [num_heads]
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self.backend: AttentionBackend = get_backend("torch")
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # the KV cache group whose block tables this layer reads (runner/kv_cache.py)
        self.kv_group = 0

    def backend_kinds(self) -> set[str]:
        """What the attention backend must serve for this layer."""
        return {self.kind} | ({"sinks"} if self.sinks is not None else set())

    def cache_shapes(self) -> list[tuple[int, ...]]:
        """The per-slot shape of each cache tensor this layer keeps."""
        return [(self.num_kv_heads, self.head_dim)] * 2

    def attach_cache(self, tensors: list[torch.Tensor]) -> None:
        """Take the runner's tensors, [num_slots, *shape] for each of `cache_shapes()`."""
        self.k_cache, self.v_cache = tensors

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        # q [T, H, D], k/v [T, KVH, D] -> [T, H, D]
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("Attention.k_cache is not attached; the runner allocates it")
        if attn.groups is not None:
            attn = attn.groups[self.kv_group]
        if self.window is None and self.sinks is None:
            return self.backend.forward(q, k, v, self.k_cache, self.v_cache, attn, self.scale)
        return self.backend.forward(
            q, k, v, self.k_cache, self.v_cache, attn, self.scale, self.window, self.sinks
        )


class LatentAttention(Attention):
    """MLA over a latent paged cache: one [kv_lora_rank + rope_dim] row per token."""

    kind = "mla"

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float):
        super().__init__(num_heads, 1, kv_lora_rank + rope_dim, scale)
        self.kv_lora_rank = kv_lora_rank

    def cache_shapes(self) -> list[tuple[int, ...]]:
        return [(1, self.head_dim)]

    def attach_cache(self, tensors: list[torch.Tensor]) -> None:
        (latent,) = tensors
        self.k_cache, self.v_cache = latent, latent[..., : self.kv_lora_rank]  # v: a view

    def forward(  # type: ignore[override]
        self, q: torch.Tensor, latent: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, L + R] (absorbed query), latent [T, 1, L + R] (this step's rows)
        -> [T, H, L], the attention output in the latent space."""
        return super().forward(q, latent, latent[..., : self.kv_lora_rank], attn)

    def expanded(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        attn: AttentionMetadata,
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """The batch-invariant mode's MLA, transformers' expanded form: q [T, H, nope + R]
        (unabsorbed), latent [T, 1, L + R] (this step's rows, stored first); `expand` turns
        cache rows [N, 1, L + R] into keys [N, H, nope + R] and values [N, H, v] -> [T, H, v].

        Every step re-expands each sequence's whole context (gathered from the latent cache
        into a temporary cache of its own) and attends on the C kernel, as a trainer's
        attention does inside `raylane.batch_invariant()`: O(context) kv_b_proj work per
        step, the price of bitwise equality (the mode runs only on the CPU, so no backend
        choice is bypassed)."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("LatentAttention.k_cache is not attached; the runner allocates it")
        if attn.groups is not None:
            attn = attn.groups[self.kv_group]
        self.k_cache.index_copy_(0, attn.slot_mapping, latent)  # v_cache is a view of it
        rows, tables = repage(
            self.k_cache, attn.block_tables, attn.seq_lens.tolist(), attn.block_size
        )
        keys, values = expand(rows)
        return attend(q, keys, values, tables, attn.seq_lens, attn.query_start_loc, self.scale)
