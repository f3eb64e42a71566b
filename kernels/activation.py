"""Gated activations on a fused [gate | up] projection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def act_and_mul(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """x [T, 2 * I] laid out [gate | up] -> act(gate) * up, [T, I]."""
    half = x.shape[-1] // 2
    return _ACTIVATIONS[act](x[..., :half]).mul_(x[..., half:])  # in place: one buffer less


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation, x [T, 2 * I] laid out [gate | up] -> [T, I]: gate clamped
    above at `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    half = x.shape[-1] // 2
    gate = x[..., :half].clamp(max=limit)
    up = x[..., half:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class SiluAndMul(nn.Module):
    """`act(gate) * up` for a gated MLP; `hidden_act` picks the activation (default silu).
    `ops` (kernels/fused_ops.py): as RMSNorm's, None runs act_and_mul."""

    def __init__(self, hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act: {hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}"
            )
        self.hidden_act = hidden_act
        self.ops: Any = None  # a FusedOps, set by the runner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is None:
            return act_and_mul(x, self.hidden_act)
        return self.ops.act_and_mul(x, self.hidden_act)
