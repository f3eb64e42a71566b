"""DeepSeek's multi-head latent attention (MLA), as one decoder's `self_attn`.

Per token the cache keeps only the compressed KV latent (`kv_lora_rank`, after its RMSNorm)
and the rotated rope key shared by every head (`qk_rope_head_dim`): see
`LatentAttention` in attention.py. `kv_b_proj` [H * (nope + v), L] is never run as a linear:
its per-head blocks W_UK [nope, L] and W_UV [v, L] are folded around the attention
(absorbed form), q_lat = q_nope @ W_UK, out = softmax(q_lat . c + q_rope . k_rope) c @ W_UV^T,
which equals HF's expanded keys (c @ W_UK^T) and values (c @ W_UV^T) up to float rounding.

The batch-invariant mode (`EngineConfig.batch_invariant`) runs HF's expanded form instead, op
for op as transformers' DeepseekV3Attention (`expanded_forward`), so that a trainer's forward
inside `raylane.batch_invariant()` equals the rollout bit for bit: each step re-expands every
sequence's cached latents through kv_b_proj (O(context) work a step, accepted in that mode).
On CUDA (`on_triton`) each query row then attends as a one-split decode on the Triton kernel
(kernels/batch_invariant/triton_mla.py) instead of the C kernel.

Tensor parallel: query heads (q_b_proj / q_proj, kv_b_proj rows, o_proj columns) split across
ranks; the latent projection, its norm and the cache rows are replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from raylane.actors.models.attention import LatentAttention
from raylane.actors.models.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
)
from raylane.kernels.attention.metadata import AttentionMetadata
from raylane.kernels.batch_invariant import padded_linear
from raylane.kernels.batch_invariant.backend import on_triton
from raylane.kernels.norm import RMSNorm
from raylane.kernels.rotary import apply_rotary, apply_rotary_interleaved, rope_parameters_of
from torch import nn

_LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with the default eps


@dataclass(frozen=True)
class MLASpec:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: one q_proj, no low-rank query
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    bias: bool  # attention_bias: on q_a_proj, kv_a_proj_with_mqa and o_proj
    rope_interleave: bool
    scale: float

    @classmethod
    def from_config(cls, config: Any) -> MLASpec:
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        scale = _softmax_scale(qk_head_dim, rope_parameters_of(config))
        return cls(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            bias=bool(getattr(config, "attention_bias", False)),
            rope_interleave=bool(getattr(config, "rope_interleave", True)),
            scale=scale,
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _softmax_scale(qk_head_dim: int, rope: dict[str, Any]) -> float:
    """qk_head_dim^-0.5, times mscale twice where YaRN's `mscale_all_dim` asks: HF's
    yarn_apply_mscale, in its order of float products (the batch-invariant mode matches
    transformers bit for bit)."""
    scale = qk_head_dim**-0.5
    mscale_all_dim = rope.get("mscale_all_dim", 0)
    factor = rope.get("factor", 1.0)
    if rope.get("rope_type", "default") == "default" or not mscale_all_dim or factor <= 1:
        return scale
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return scale * mscale * mscale


def per_head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H, in], weight [H, out, in] -> [T, H, out], head h through `padded_linear`: the
    batch-invariant mode's absorbed matmuls (a bmm over heads reduces in an order that follows
    T, so a row would round otherwise alone than in a batch)."""
    # contiguous weights: padded_linear's one order per row is measured on row-major weights
    heads = [padded_linear(x[:, h], weight[h].contiguous()) for h in range(weight.shape[0])]
    return torch.stack(heads, dim=1)


class MLAttention(nn.Module):
    def __init__(self, spec: MLASpec, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.spec, tp = spec, tp or TPGroup()
        heads, qk = spec.num_heads, spec.qk_head_dim
        if spec.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(spec.hidden_size, heads * qk, False, tp)
        else:
            self.q_a_proj = ReplicatedLinear(spec.hidden_size, spec.q_lora_rank, spec.bias, tp)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(spec.q_lora_rank, heads * qk, False, tp)
        latent = spec.kv_lora_rank + spec.qk_rope_head_dim
        self.kv_a_proj_with_mqa = ReplicatedLinear(spec.hidden_size, latent, spec.bias, tp)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, _LATENT_NORM_EPS)
        per_head = spec.qk_nope_head_dim + spec.v_head_dim
        self.kv_b_proj = ColumnParallelLinear(spec.kv_lora_rank, heads * per_head, False, tp)
        self.o_proj = RowParallelLinear(heads * spec.v_head_dim, spec.hidden_size, spec.bias, tp)
        self.num_heads = self.kv_b_proj.weight.shape[0] // per_head  # this rank's heads
        self.attn = LatentAttention(
            self.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.scale
        )

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotate = apply_rotary_interleaved if self.spec.rope_interleave else apply_rotary
        return rotate(x, cos, sin)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        if self.kv_b_proj.invariant:
            return self.expanded_forward(hidden, cos, sin, attn)
        query, row, _ = self.project(hidden, cos, sin)
        return self.output(self.attn(query, row, attn))

    def project(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """hidden [T, D] -> (absorbed query [T, H, L + R], cache row [T, 1, L + R], the
        low-rank query q_a_layernorm(q_a_proj(hidden)) [T, q_lora_rank] or None)."""
        q_nope, q_rope, q_resid = self._query(hidden, cos, sin)
        w_uk = self._kv_b()[:, : self.spec.qk_nope_head_dim]  # [H, nope, L]
        if self.kv_b_proj.invariant:
            q_latent = per_head_linear(q_nope, w_uk.transpose(1, 2))  # [T, H, L]
        else:
            q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        query = torch.cat([q_latent, q_rope], dim=-1)  # [T, H, L + R]
        return query, self._cache_row(hidden, cos, sin), q_resid

    def expanded_forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        """The batch-invariant mode: transformers' expanded form, op for op as its
        DeepseekV3Attention, so a trainer's forward inside `raylane.batch_invariant()` equals
        this bit for bit. Query cat(q_nope, q_rope) [T, H, nope + R] against each context
        token's kv_b_proj(latent) keys cat(k_nope, k_rope) and values, then o_proj."""
        s, t = self.spec, hidden.shape[0]
        q_nope, q_rope, _ = self._query(hidden, cos, sin)
        query = torch.cat([q_nope, q_rope], dim=-1)  # [T, H, nope + R]
        row = self._cache_row(hidden, cos, sin)
        if on_triton(hidden.device):
            out = self._expanded_on_triton(query, row, attn)
        else:
            out = self.attn.expanded(query, row, attn, self.expand)
        return self.o_proj(out.reshape(t, self.num_heads * s.v_head_dim))  # out [T, H, v]

    def _expanded_on_triton(
        self, query: torch.Tensor, row: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        """The expanded form on CUDA: the step's latent rows stored, then each query row a
        one-split decode over its context's expanded keys (triton_mla.py) -> [T, H, v]."""
        from raylane.kernels.batch_invariant.triton_mla import expanded_attention

        cache = self.attn.k_cache
        if cache is None:
            raise RuntimeError("LatentAttention.k_cache is not attached; the runner allocates it")
        if attn.groups is not None:
            attn = attn.groups[self.attn.kv_group]
        cache.index_copy_(0, attn.slot_mapping, row)
        return expanded_attention(query, cache, attn, self.expand, self.spec.scale)

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows [N, 1, L + R] -> (keys [N, H, nope + R], values [N, H, v]), contiguous:
        transformers' expand_kv (kv_b_proj over each row, row-invariant in the mode; the
        shared rope key copied beside every head's k_nope)."""
        s, n, h = self.spec, rows.shape[0], self.num_heads
        latent, k_rope = rows[:, 0].split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(n, h, s.qk_nope_head_dim + s.v_head_dim)
        k_nope, value = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
        key = torch.cat([k_nope, k_rope.unsqueeze(1).expand(n, h, s.qk_rope_head_dim)], dim=-1)
        return key, value.contiguous()

    def _query(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """hidden [T, D] -> (q_nope [T, H, nope], rotated q_rope [T, H, R], the low-rank query
        [T, q_lora_rank] or None)."""
        s, t, h = self.spec, hidden.shape[0], self.num_heads
        if s.q_lora_rank is None:
            q_resid, q = None, self.q_proj(hidden)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_resid)
        q_nope, q_rope = q.view(t, h, s.qk_head_dim).split(
            [s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1
        )
        return q_nope, self._rotate(q_rope, cos, sin), q_resid

    def _cache_row(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T, D] -> the cache row [T, 1, L + R]: the normed latent, the rotated rope key."""
        s = self.spec
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split(
            [s.kv_lora_rank, s.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent)  # [T, L]
        k_rope = self._rotate(k_rope.unsqueeze(1), cos, sin)  # [T, 1, R]
        return torch.cat([latent.unsqueeze(1), k_rope], dim=-1)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The attention output in the latent space [T, H, L] -> W_UV, o_proj -> [T, D]."""
        s, t, h = self.spec, out.shape[0], self.num_heads
        w_uv = self._kv_b()[:, s.qk_nope_head_dim :]  # [H, v, L]
        if self.kv_b_proj.invariant:
            out = per_head_linear(out, w_uv)  # [T, H, v]
        else:
            out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(out.reshape(t, h * s.v_head_dim))

    def _kv_b(self) -> torch.Tensor:
        s = self.spec
        return self.kv_b_proj.weight.view(
            self.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank
        )
