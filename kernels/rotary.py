"""Rotary position embedding (RoPE, the rotate-half / NeoX layout Hugging Face uses).

The inverse frequencies follow transformers' `ROPE_INIT_FUNCTIONS` for the rope types listed in
`ROPE_TYPES`, and the cos/sin cache is computed with the same float32 ops as HF, so a position's
cos/sin is bit-identical to what `LlamaRotaryEmbedding` produces.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    # [dim // 2] float32, exactly as HF: int64 arange cast to float
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    return 1.0 / (theta**exponent)


def _llama3(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    dim: int, theta: float, params: Mapping[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    old_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / old_len
    attn_factor = params.get("attention_factor")
    if attn_factor is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attn_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attn_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extrapolation = 1 - ramp
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    return inv_freq, float(attn_factor)


def compute_inv_freq(
    head_dim: int, rope_parameters: Mapping[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim // 2] float32, attention scaling of cos/sin).

    `rope_parameters` is transformers 5's `config.rope_parameters` (or a v4 `rope_scaling` dict
    with `rope_theta` added): `rope_type` (or legacy `type`), `rope_theta`, and per-type fields.
    """
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_parameters.rope_type: {rope_type!r} is not supported; "
            f"supported: {list(ROPE_TYPES)}"
        )
    if rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rope_parameters.partial_rotary_factor: only 1.0 is supported")
    theta = float(rope_parameters.get("rope_theta", 10000.0))
    if rope_type == "yarn":
        return _yarn(head_dim, theta, rope_parameters, max_position_embeddings)
    inv_freq = _base_inv_freq(head_dim, theta)
    if rope_type == "linear":
        inv_freq = inv_freq / rope_parameters["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, rope_parameters)
    return inv_freq, 1.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, R] of each token's position; R < D (partial rotary,
    e.g. GLM-4.5) rotates the leading R dims of each head and passes the rest through."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary], cos, sin)
        return torch.cat([rotated, x[..., rotary:]], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
    return x * cos + rotate_half(x) * sin


class Rotary(nn.Module):
    """`apply_rotary` as a module, so the runner can hand it the fused ops it chose for the
    device at start-up (kernels/fused_ops.py); until then (`ops` None), the torch ops."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Any = None  # a FusedOps

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.ops is None:
            return apply_rotary(x, cos, sin)
        return self.ops.rotary(x, cos, sin)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: x [T, H, D] rotated in pairs (x0, x1), (x2, x3), ...; the result is
    laid out [evens' rotation | odds' rotation], as HF's `apply_rotary_pos_emb_interleave`.
    cos/sin [T, D] are the rotate-half tables; their first half holds each pair's angle."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, :half].unsqueeze(1), sin[:, :half].unsqueeze(1)  # [T, 1, D/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


class RotaryEmbedding(nn.Module):
    """The cos/sin cache for positions [0, max_positions), like HF's `LlamaRotaryEmbedding`."""

    cos_cache: torch.Tensor  # buffers, [P, D]
    sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        rope_parameters: Mapping[str, Any],
        max_position_embeddings: int,
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
    ) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(head_dim, rope_parameters, max_position_embeddings)
        positions = torch.arange(max_positions or max_position_embeddings, dtype=torch.int64)
        freqs = positions[:, None].float() * inv_freq  # [P, D/2], elementwise like HF
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos_cache", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, D]; look up once per step, apply in every layer."""
        return self.cos_cache.index_select(0, positions), self.sin_cache.index_select(0, positions)


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """The rope dict of an HF config: transformers 5 `rope_parameters`, or 4 `rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return dict(params)
