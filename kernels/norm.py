"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_first: bool = False
) -> torch.Tensor:
    """x [..., D] -> [..., D], statistics in float32. The same ops as HF's LlamaRMSNorm (the
    normalised row cast to x's dtype, then times the weight), or with `weight_first` as HF's
    GptOssRMSNorm (times the weight in float32, then the cast: bfloat16 rounds once, not twice)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if weight_first:
        return (weight * h).to(input_dtype)
    return weight * h.to(input_dtype)


def add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    weight_first: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without `residual`: rms_norm(x). With it: (rms_norm(x + residual), x + residual)."""
    if residual is None:
        return rms_norm(x, weight, eps, weight_first)
    x = residual + x  # [T, D], in the model dtype like HF's residual add
    return rms_norm(x, weight, eps, weight_first), x


class RMSNorm(nn.Module):
    """`ops` (kernels/fused_ops.py) is the torch reference until the runner swaps in the
    implementation it chose at start-up for the device. `weight_first`: the weight applied
    before the cast back (gpt-oss), else after it (Llama and most families)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_first: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps, self.weight_first = eps, weight_first
        self.ops: Any = None  # a FusedOps; None: add_rms_norm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if self.ops is None:
            return add_rms_norm(x, self.weight, self.eps, residual, self.weight_first)
        return self.ops.rms_norm(x, self.weight, self.eps, residual, self.weight_first)

    def extra_repr(self) -> str:
        first = ", weight_first=True" if self.weight_first else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{first}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied in float32 before
    the cast back (`(x_hat * (1 + w)).to(dtype)`, as HF's Gemma3RMSNorm). `ops.offset_rms_norm`
    is torch's ops everywhere but in the batch-invariant mode on CUDA (kernels/fused_ops.py)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if self.ops is None:
            return add_offset_rms_norm(x, self.weight, self.eps, residual)
        return self.ops.offset_rms_norm(x, self.weight, self.eps, residual)


def add_offset_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """GemmaRMSNorm's torch ops: without `residual` norm(x), with it (norm(x + residual),
    x + residual)."""
    if residual is not None:
        x = residual + x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * (1.0 + weight.float())).to(x.dtype)
    return out if residual is None else (out, x)
