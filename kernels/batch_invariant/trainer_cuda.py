"""The CUDA half of `raylane.batch_invariant()` (cluster/on_policy.py): the torch ops of a
trainer's transformers model that the engine's mode runs on Triton kernels on CUDA.

- RMSNorm: transformers' Llama-style norm modules (and gpt-oss's, the weight applied before
  the cast) compute in torch ops, whose CUDA reduction follows the row count; their forward
  runs triton_rowwise.py's kernel, as the engine's RMSNorm does on CUDA (kernels/fused_ops.py's
  InvariantOps).
- log_softmax: a trainer's `torch.log_softmax(logits.float(), -1)` (or the method, or
  F.log_softmax) runs the sampler's Triton kernel (row_reductions.py).

Every replacement asks `on_triton` at each call and runs what it replaced elsewhere (the CPU
path is torch's own there, which the engine's mode on the CPU runs too).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from raylane.kernels.batch_invariant.backend import on_triton
from raylane.kernels.batch_invariant.grads import recomputed_grads
from raylane.kernels.norm import rms_norm as torch_rms_norm

# transformers' RMSNorm classes whose forward is LlamaRMSNorm's (float32 statistics, the
# normalised row cast back, then the weight): the engine's RMSNorm numerics
LLAMA_NORMS = {
    "llama": "LlamaRMSNorm",
    "mistral": "MistralRMSNorm",
    "mixtral": "MixtralRMSNorm",
    "qwen2": "Qwen2RMSNorm",
    "qwen3": "Qwen3RMSNorm",
    "qwen3_moe": "Qwen3MoeRMSNorm",
    "glm4_moe": "Glm4MoeRMSNorm",
    "deepseek_v2": "DeepseekV2RMSNorm",
    "deepseek_v3": "DeepseekV3RMSNorm",
    "deepseek_v32": "DeepseekV32RMSNorm",
    "glm_moe_dsa": "GlmMoeDsaRMSNorm",
}
# transformers' RMSNorm classes that apply the weight in float32 before the cast back (the
# engine's RMSNorm with `weight_first`). Gemma 3's and the hybrids' (1 + w) and gated norms:
# triton_gdn_norms.py, swapped by cluster/on_policy.py
WEIGHT_FIRST_NORMS = {"gpt_oss": "GptOssRMSNorm"}
Swap = tuple[Any, str, Any]  # (owner, attribute, replacement)


def modeling(family: str) -> Any:
    """transformers' modeling file for `family`, or None where this transformers lacks it."""
    try:
        return importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        return None


def norm_swaps() -> list[Swap]:
    """The RMSNorm classes' forwards: on the Triton kernel on CUDA (in their own order of the
    weight and the cast), torch's own on the CPU."""
    swaps: list[Swap] = []
    kinds = [(LLAMA_NORMS, False), (WEIGHT_FIRST_NORMS, True)]
    for names, weight_first in kinds:
        for family, name in names.items():
            if (module := modeling(family)) is not None:
                cls = getattr(module, name)
                swaps.append((cls, "forward", _triton_norm(cls.forward, weight_first)))
    return swaps


def _triton_norm(forward: Callable, weight_first: bool) -> Callable:
    @functools.wraps(forward)
    def rms_norm(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        if not on_triton(hidden_states.device):
            return forward(self, hidden_states)
        eps = self.variance_epsilon
        return InvariantRMSNorm.apply(hidden_states, self.weight, eps, weight_first)

    return rms_norm


class InvariantRMSNorm(torch.autograd.Function):
    """triton_rowwise.py's `rms_norm` forward; the backward differentiates the torch-op
    RMSNorm (kernels/norm.py's; not row-invariant)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, weight_first: bool = False):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.weight_first = eps, weight_first
        from raylane.kernels.batch_invariant.triton_rowwise import rms_norm

        return rms_norm(x, weight, eps, weight_first)

    @staticmethod
    def backward(ctx, grad):
        def norm(x, weight):
            return torch_rms_norm(x, weight, ctx.eps, ctx.weight_first)

        return (*recomputed_grads(norm, ctx.saved_tensors, [grad]), None, None)


def log_softmax_swaps() -> list[Swap]:
    """torch.log_softmax, Tensor.log_softmax and F.log_softmax: a float32 result over the last
    dim takes the Triton kernel on CUDA; every other call runs torch's."""
    owners: list[tuple[Any, Callable]] = [(torch, torch.log_softmax), (F, F.log_softmax)]
    owners.append((torch.Tensor, torch.Tensor.log_softmax))
    return [(owner, "log_softmax", _triton_log_softmax(fn)) for owner, fn in owners]


def _triton_log_softmax(original: Callable) -> Callable:
    def log_softmax(x: torch.Tensor, dim: int | None = None, *args: Any, **kwargs: Any):
        dtype = kwargs.get("dtype") or x.dtype
        last = dim is not None and dim in (-1, x.dim() - 1)
        if on_triton(x.device) and last and not args and dtype == torch.float32:
            from raylane.kernels.batch_invariant.triton_rowwise import InvariantLogSoftmax

            return InvariantLogSoftmax.apply(x)
        return original(x, dim, *args, **kwargs)

    return log_softmax
