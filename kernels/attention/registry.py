"""Attention backend registry: pick one implementation at start-up, never by scattered checks."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from raylane.kernels.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class BackendRequest:
    """What the runner knows of its model beyond the layer kinds, for backends with limits
    (flash_attn: fp16/bf16, head sizes, block size), and how the backend should reduce.

    `num_splits` reaches flash_attn's `num_splits`: 0 lets the kernel pick per shape, 1 keeps
    one reduction order whatever the batch (the batch-invariant mode); at 1 the C kernel aligns
    sliding windows' key chunks to absolute positions for the same reason."""

    dtype: torch.dtype | None = None  # None: not known, not checked
    head_sizes: tuple[int, ...] = ()
    block_size: int | None = None
    num_splits: int = 0


@dataclass(frozen=True)
class _Entry:
    # why the backend cannot run on the device (not installed, no GPU), or None
    missing: Callable[[torch.device], str | None]
    # why it cannot serve this model (kinds, dtype, shapes) where it runs, or None
    unfit: Callable[[torch.device, frozenset[str], BackendRequest], str | None]
    make: Callable[[torch.device, BackendRequest], AttentionBackend]


def _serves(kinds: frozenset[str]):
    def unfit(device, need: frozenset[str], request: BackendRequest) -> str | None:
        return None if need <= kinds else f"layer kinds {sorted(need - kinds)} not served"

    return unfit


def _unless(available: Callable[[torch.device], bool], needs: str):
    return lambda device: None if available(device) else needs


def _torch_backend(device, request) -> AttentionBackend:
    from raylane.kernels.attention.torch_ref import TorchAttention

    return TorchAttention()


def _triton_backend(device, request) -> AttentionBackend:
    from raylane.kernels.attention.triton_backend import TritonAttention

    return TritonAttention(invariant=request.num_splits == 1)  # one split: batch invariant


def _cpu_backend(device, request) -> AttentionBackend:
    from raylane.kernels.attention.cpu_backend import CpuPagedAttention

    return CpuPagedAttention(aligned=request.num_splits == 1)


def _has_cpu_kernel(device: torch.device) -> bool:
    if device.type != "cpu":
        return False
    import raylane.kernels.attention.cpu_kernel as cpu_kernel

    return cpu_kernel.is_available()  # built once per machine (about a second), then cached


# tests of the CUDA paths on a machine without a GPU: with TRITON_INTERPRET=1 and this set to
# 1, Triton's interpreter runs the Triton kernels on CPU tensors (slowly)
TRITON_ON_CPU = "RAYLANE_TRITON_ON_CPU"


def triton_on_cpu() -> bool:
    """The Triton kernels run on CPU tensors here, through the interpreter (tests only)."""
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get(TRITON_ON_CPU) == "1"


def has_triton(device: torch.device) -> bool:
    """Triton kernels run on CUDA devices where triton imports (and on the CPU under
    `triton_on_cpu`)."""
    if device.type != "cuda" and not (device.type == "cpu" and triton_on_cpu()):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _flash_missing(device: torch.device) -> str | None:
    from raylane.kernels.attention.flash_fork import FlashForkMissing, find_flash_fork

    try:
        find_flash_fork(device)
    except FlashForkMissing as e:
        return str(e)
    return None


def _flash_unfit(device, kinds: frozenset[str], request: BackendRequest) -> str | None:
    from raylane.kernels.attention.flash_backend import unfit
    from raylane.kernels.attention.flash_fork import find_flash_fork

    fork = find_flash_fork(device)
    return unfit(fork, kinds, request.dtype, request.head_sizes, request.block_size)


def _flash_backend(device, request: BackendRequest) -> AttentionBackend:
    from raylane.kernels.attention.flash_backend import FlashAttention
    from raylane.kernels.attention.flash_fork import find_flash_fork

    return FlashAttention(find_flash_fork(device), num_splits=request.num_splits)


# in order of preference for "auto"; "dsa" layers run their own torch ops
# (kernels/attention/sparse.py) and need no backend
_BACKENDS: dict[str, _Entry] = {
    "flash_attn": _Entry(_flash_missing, _flash_unfit, _flash_backend),
    "triton": _Entry(
        _unless(has_triton, "needs a CUDA device and the triton package"),
        _serves(frozenset({"full", "mla", "sliding", "sinks"})),
        _triton_backend,
    ),
    "cpu": _Entry(
        _unless(_has_cpu_kernel, "needs the CPU and its C kernel (built with the system cc)"),
        _serves(frozenset({"full", "mla", "sliding", "sinks"})),
        _cpu_backend,
    ),
    "torch": _Entry(
        lambda device: None,
        _serves(frozenset({"full", "mla", "dsa", "sliding", "sinks", "softcap"})),
        _torch_backend,
    ),
}
# vLLM's backend names (its --attention-backend / VLLM_ATTENTION_BACKEND) for ours
ALIASES = {
    "FLASH_ATTN": "flash_attn",
    "TRITON_ATTN": "triton",
    "CPU_ATTN": "cpu",
    "TORCH_SDPA": "torch",
}


def _why_not(name: str, device, kinds: frozenset[str], request: BackendRequest) -> str | None:
    entry = _BACKENDS[name]
    return entry.missing(device) or entry.unfit(device, kinds, request)


def available_backends(
    device: torch.device,
    kinds: Iterable[str] = ("full",),
    request: BackendRequest | None = None,
) -> list[str]:
    """Backends that run on `device` and serve every layer kind in `kinds`."""
    need, request = frozenset(kinds), request or BackendRequest()
    return [n for n in _BACKENDS if _why_not(n, device, need, request) is None]


def get_backend(
    name: str = "auto",
    device: torch.device | str = "cpu",
    kinds: Iterable[str] = ("full",),
    request: BackendRequest | None = None,
) -> AttentionBackend:
    """Return the named backend (ours, or vLLM's name such as "FLASH_ATTN"), or with "auto"
    the first that runs on `device` and serves every layer kind of the model (`kinds`)."""
    device, need = torch.device(device), frozenset(kinds)
    request = request or BackendRequest()
    name = ALIASES.get(name, name)
    if name == "auto":
        return _first_fit(device, need, request)
    if name not in _BACKENDS:
        known = sorted(_BACKENDS) + sorted(ALIASES)
        raise ValueError(f"attention_backend: unknown backend {name!r}; known: {known}")
    why = _why_not(name, device, need, request)
    if why is not None:
        raise ValueError(
            f"attention_backend: {name!r} is not available on {device} for layer kinds "
            f"{sorted(need)}: {why}; available: {available_backends(device, need, request)}"
        )
    return _BACKENDS[name].make(device, request)


def _first_fit(device: torch.device, need: frozenset[str], request: BackendRequest):
    for name, entry in _BACKENDS.items():
        if entry.missing(device) is not None:
            continue
        why = entry.unfit(device, need, request)
        if why is None:
            logger.info("attention backend: %s", name)
            return entry.make(device, request)
        # installed but not for this model (FA2 and sinks, float32, ...): say what it falls to
        logger.info("attention backend %s is installed but not used: %s", name, why)
    raise AssertionError("the torch reference serves every layer kind")
