"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2, GLM-5): MLA whose queries attend only the
`index_topk` positions a lightning indexer picks (kernels/attention/sparse.py).

The indexer keeps its own paged key cache beside the latent cache: per token per layer one
`index_head_dim` key (LayerNorm(wk(hidden)), its leading `qk_rope_head_dim` dims rotated), so a
layer's cache is [num_slots, 1, kv_lora_rank + rope] latent rows plus [num_slots, 1,
index_head_dim] indexer keys (`SparseLatentAttention`, layer kind "dsa"). The indexer's weights
are replicated under tensor parallelism, so every rank picks the same positions; the latent
rows are replicated as for MLA. Each layer keeps the step's selection (`indexer_topk`,
[T, index_topk] positions, ascending, -1 padded) for routing replay.
"""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.models.attention import LatentAttention
from raylane.actors.models.layers import ReplicatedLinear
from raylane.actors.models.mla import MLASpec, MLAttention
from raylane.actors.models.tp_group import TPGroup
from raylane.kernels.attention.metadata import AttentionMetadata
from raylane.kernels.attention.sparse import select_topk, sparse_latent_attention
from raylane.kernels.rotary import apply_rotary, apply_rotary_interleaved
from torch import nn


class SparseLatentAttention(LatentAttention):
    """MLA's latent cache plus the indexer's key cache; attends the selected positions only."""

    kind = "dsa"
    # the batch-invariant mode (set by the runner: `make_batch_invariant`): sparse.py's ops per
    # token rather than over the batch
    invariant = False

    def __init__(
        self,
        num_heads: int,
        spec: MLASpec,
        index_head_dim: int,
        index_topk: int,
        has_indexer: bool = True,
    ) -> None:
        super().__init__(num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.scale)
        self.index_head_dim, self.index_topk = index_head_dim, index_topk
        self.has_indexer = has_indexer  # False: GLM-5's "shared" layers keep no indexer keys
        self.index_cache: torch.Tensor | None = None

    def cache_shapes(self) -> list[tuple[int, ...]]:
        keys = [(1, self.index_head_dim)] if self.has_indexer else []
        return [(1, self.head_dim), *keys]

    def attach_cache(self, tensors: list[torch.Tensor]) -> None:
        latent, *keys = tensors
        self.index_cache = keys[0] if keys else None
        super().attach_cache([latent])

    def forward(  # type: ignore[override]
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, L + R], latent [T, 1, L + R]; index = (indexer queries [T, nh, D], keys
        [T, 1, D], head weights [T, nh] float32) -> (out [T, H, L], chosen [T, topk])."""
        if self.index_cache is None:
            raise RuntimeError("SparseLatentAttention's indexer cache is not attached")
        index_q, index_k, weights = index
        self.index_cache.index_copy_(0, attn.slot_mapping, index_k)
        scale = self.index_head_dim**-0.5
        chosen = select_topk(
            index_q, weights, self.index_cache, attn, self.index_topk, scale, self.invariant
        )
        return self.attend_chosen(q, latent, chosen, attn), chosen

    def attend_chosen(
        self, q: torch.Tensor, latent: torch.Tensor, chosen: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        """Store the step's latent rows, then attend the `chosen` [T, topk] positions only."""
        if self.k_cache is None:
            raise RuntimeError("SparseLatentAttention's latent cache is not attached")
        self.k_cache.index_copy_(0, attn.slot_mapping, latent)
        cache, rank = self.k_cache, self.kv_lora_rank
        return sparse_latent_attention(q, cache, rank, chosen, attn, self.scale, self.invariant)


class Indexer(nn.Module):
    """The lightning indexer's projections (checkpoint names `indexer.*`)."""

    def __init__(self, config: Any, interleaved: bool, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim, self.interleaved = config.qk_rope_head_dim, interleaved
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.num_heads * self.head_dim, tp=tp)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim, tp=tp)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.num_heads, tp=tp)

    def forward(
        self, hidden: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (queries [T, nh, D], keys [T, 1, D], head weights [T, nh] float32)."""
        t = hidden.shape[0]
        q = self._rotate(self.wq_b(q_resid).view(t, self.num_heads, self.head_dim), cos, sin)
        k = self._rotate(self.k_norm(self.wk(hidden)).unsqueeze(1), cos, sin)
        weights = self.weights_proj(hidden).float() * self.num_heads**-0.5
        return q, k, weights

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # the leading rope dims are rotated (the MLA query's rope dims come last instead)
        rotate = apply_rotary_interleaved if self.interleaved else apply_rotary
        rope, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([rotate(rope, cos, sin), rest], dim=-1)


class DSAttention(MLAttention):
    """MLA with the indexer; `indexer_topk` holds the last step's selection [T, topk].

    `shared_from`: a GLM-5 "shared" layer has no indexer and attends the positions the given
    earlier layer picked in the same forward (layers run in order)."""

    def __init__(
        self,
        config: Any,
        index_interleaved: bool,
        tp: TPGroup | None = None,
        shared_from: DSAttention | None = None,
    ) -> None:
        if config.q_lora_rank is None:
            raise ValueError("q_lora_rank: DSA's indexer reads the low-rank query; it is None")
        spec = MLASpec.from_config(config)
        super().__init__(spec, tp)
        self.indexer: Indexer | None = (
            None if shared_from else Indexer(config, index_interleaved, tp)
        )
        self.shared_from = [shared_from] if shared_from else []  # a list: not a submodule
        self.attn = SparseLatentAttention(
            self.num_heads, spec, config.index_head_dim, config.index_topk, shared_from is None
        )
        self.indexer_topk: torch.Tensor | None = None

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        query, row, q_resid = self.project(hidden, cos, sin)
        assert q_resid is not None  # checked in __init__
        sparse = self.attn
        assert isinstance(sparse, SparseLatentAttention)  # set in __init__
        if self.indexer is None:
            chosen = self.shared_from[0].indexer_topk
            assert chosen is not None  # the source layer ran earlier in this forward
            self.indexer_topk = chosen
            return self.output(sparse.attend_chosen(query, row, chosen, attn))
        index = self.indexer(hidden, q_resid, cos, sin)
        out, self.indexer_topk = sparse(query, row, index, attn)
        return self.output(out)
