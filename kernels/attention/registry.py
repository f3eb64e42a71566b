"""Attention backend registry: pick one implementation at start-up, never by scattered checks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from raylane.kernels.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Stores the step's K/V into the cache, then attends every query over its context.

    Value rows may be narrower than key rows (MLA's absorbed form: keys [latent | rope key],
    values the latent, a view of the key cache); the output takes the value width.
    """

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,  # a query sees its last `window` keys (itself included)
        sinks: torch.Tensor | None = None,  # [num_heads] logits joining each denominator
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def _torch_backend() -> AttentionBackend:
    from raylane.kernels.attention.torch_ref import TorchAttention

    return TorchAttention()


def _triton_backend() -> AttentionBackend:
    from raylane.kernels.attention.triton_backend import TritonAttention

    return TritonAttention()


def _cpu_backend() -> AttentionBackend:
    from raylane.kernels.attention.cpu_backend import CpuPagedAttention

    return CpuPagedAttention()


def _has_cpu_kernel(device: torch.device) -> bool:
    if device.type != "cpu":
        return False
    import raylane.kernels.attention.cpu_kernel as cpu_kernel

    return cpu_kernel.is_available()  # built once per machine (about a second), then cached


def has_triton(device: torch.device) -> bool:
    """Triton kernels run on CUDA devices where triton imports."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# name -> (is_available, factory), in order of preference for "auto"
_BACKENDS: dict[str, tuple[Callable[[torch.device], bool], Callable[[], AttentionBackend]]] = {
    "triton": (has_triton, _triton_backend),
    "cpu": (_has_cpu_kernel, _cpu_backend),
    "torch": (lambda device: True, _torch_backend),
}
# the cache layouts (attention layer kinds, see actors/models/attention.py) each one serves
_KINDS: dict[str, frozenset[str]] = {
    "triton": frozenset({"full", "mla", "sliding", "sinks"}),
    "cpu": frozenset({"full", "mla", "sliding", "sinks"}),
    # "dsa" layers run their own torch ops (kernels/attention/sparse.py) and need no backend
    "torch": frozenset({"full", "mla", "dsa", "sliding", "sinks"}),
}


def available_backends(device: torch.device, kinds: Iterable[str] = ("full",)) -> list[str]:
    """Backends that run on `device` and serve every layer kind in `kinds`."""
    need = set(kinds)
    return [n for n, (ok, _) in _BACKENDS.items() if need <= _KINDS[n] and ok(device)]


def get_backend(
    name: str = "auto", device: torch.device | str = "cpu", kinds: Iterable[str] = ("full",)
) -> AttentionBackend:
    """Return the named backend, or with "auto" the first available for `device` that serves
    every layer kind of the model (`kinds`)."""
    device, kinds = torch.device(device), tuple(kinds)
    names = available_backends(device, kinds)
    if name == "auto":
        return _BACKENDS[names[0]][1]()
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {name!r}; known: {sorted(_BACKENDS)}")
    if name not in names:
        raise ValueError(
            f"attention_backend: {name!r} is not available on {device} for layer kinds "
            f"{sorted(set(kinds))}; available: {names}"
        )
    return _BACKENDS[name][1]()
