"""Linear-attention backend registry: one implementation picked at start-up."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from raylane.kernels.attention.registry import has_triton
from raylane.kernels.linear_attention.metadata import StateMetadata


class LinearAttentionBackend(Protocol):
    """Causal conv1d and the gated delta rule over a packed step, each sequence's conv and
    recurrent state carried in its slot of the layer's state pools (updated in place)."""

    name: str

    def conv(
        self,
        x: torch.Tensor,  # [T, C]
        weight: torch.Tensor,  # [C, W]
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,  # [num_slots, C, W - 1]
        meta: StateMetadata,
        activation: str | None = "silu",
    ) -> torch.Tensor:  # [T, C]
        ...

    def delta_rule(
        self,
        q: torch.Tensor,  # [T, Hk, Dk]
        k: torch.Tensor,  # [T, Hk, Dk]
        v: torch.Tensor,  # [T, Hv, Dv]
        g: torch.Tensor,  # [T, Hv] log decay
        beta: torch.Tensor,  # [T, Hv]
        state: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32
        meta: StateMetadata,
        l2norm: bool = True,
    ) -> torch.Tensor:  # [T, Hv, Dv]
        ...


def _torch_backend() -> LinearAttentionBackend:
    from raylane.kernels.linear_attention.torch_ref import TorchLinearAttention

    return TorchLinearAttention()


def _triton_backend() -> LinearAttentionBackend:
    from raylane.kernels.linear_attention.triton_backend import TritonLinearAttention

    return TritonLinearAttention()


def _invariant_backend() -> LinearAttentionBackend:
    from raylane.kernels.linear_attention.invariant import InvariantLinearAttention

    return InvariantLinearAttention()


# name -> (is_available, factory), in order of preference for "auto"
_BACKENDS: dict[
    str, tuple[Callable[[torch.device], bool], Callable[[], LinearAttentionBackend]]
] = {
    "triton": (has_triton, _triton_backend),
    "torch": (lambda device: True, _torch_backend),
    # the batch-invariant mode's (invariant.py); never "auto"'s: torch comes first
    "batch_invariant": (lambda device: True, _invariant_backend),
}


def get_linear_backend(
    name: str = "auto", device: torch.device | str = "cpu"
) -> LinearAttentionBackend:
    """The named backend, or with "auto" the first available on `device`."""
    device = torch.device(device)
    names = [n for n, (ok, _) in _BACKENDS.items() if ok(device)]
    if name == "auto":
        return _BACKENDS[names[0]][1]()
    if name not in names:
        raise ValueError(
            f"linear_attention_backend: {name!r} is not available on {device}; available: {names}"
        )
    return _BACKENDS[name][1]()
