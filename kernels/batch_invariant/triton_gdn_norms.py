"""The RMSNorms of the Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on the batch-
invariant mode's CUDA path: the (1 + w) norm every layer and the full attention's q / k take
(the engine's GemmaRMSNorm, which Gemma 3 shares) and the gated norm after the recurrence.

torch's CUDA mean sizes its blocks by the row count, so on CUDA both run triton_rowwise.py's
kernel (one order per row) in their own numerics: the (1 + w) norm in float32 with the weight
1 + w, cast back after; the gated one Llama-style (the normalised row cast back before the
weight), times SiLU(gate) in float32. The engine's modules (kernels/norm.py, qwen3_5.py) call
these, and `offset_norm` / `gated_norm` wrap transformers' norm classes' forwards with them
(OFFSET_NORMS, GATED_NORMS) for a trainer inside `raylane.batch_invariant()`, so the two are
bitwise equal. Autograd: the backward differentiates the torch-op RMSNorm (trainer_cuda.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from raylane.kernels.batch_invariant.backend import on_triton
from raylane.kernels.batch_invariant.elementwise import silu
from raylane.kernels.batch_invariant.trainer_cuda import InvariantRMSNorm

# transformers' norm classes (modeling file -> class) of each kind
OFFSET_NORMS = {
    "qwen3_5": "Qwen3_5RMSNorm",
    "qwen3_5_moe": "Qwen3_5MoeRMSNorm",
    "qwen3_next": "Qwen3NextRMSNorm",
    "gemma3": "Gemma3RMSNorm",
}
GATED_NORMS = {
    "qwen3_5": "Qwen3_5RMSNormGated",
    "qwen3_5_moe": "Qwen3_5MoeRMSNormGated",
    "qwen3_next": "Qwen3NextRMSNormGated",
}


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(x_hat * (1 + weight)).to(x.dtype), statistics and product in float32: x [..., D]."""
    return InvariantRMSNorm.apply(x.float(), 1.0 + weight.float(), eps).to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """weight * x_hat (cast to x's dtype first) * SiLU(gate) in float32, cast back: x, gate
    [..., D] (Qwen3_5RMSNormGated's numerics)."""
    normed = InvariantRMSNorm.apply(x, weight, eps).float()
    return (normed * silu(gate.float())).to(x.dtype)


def offset_norm(forward: Callable) -> Callable:
    """A (1 + w) norm class's forward, `offset_rms_norm` on the mode's CUDA path."""

    @functools.wraps(forward)
    def norm(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        if not on_triton(hidden_states.device):
            return forward(self, hidden_states)
        return offset_rms_norm(hidden_states, self.weight, self.eps)

    return norm


def gated_norm(forward: Callable) -> Callable:
    """A gated norm class's forward, `gated_rms_norm` on the mode's CUDA path."""

    @functools.wraps(forward)
    def norm(self: Any, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if not on_triton(hidden_states.device):
            return forward(self, hidden_states, gate)
        return gated_rms_norm(hidden_states, gate, self.weight, self.variance_epsilon)

    return norm
