"""Which attention backend serves the batch-invariant mode on a device, or why none does."""

from __future__ import annotations

import torch
from raylane.kernels.attention.registry import ALIASES


def batch_invariant_backend(name: str, device: torch.device) -> str:
    """The attention backend for the batch-invariant mode: the C paged kernel on the CPU,
    whose order of work per query row is fixed whatever else runs. ValueError saying what to
    change where no backend keeps that."""
    if device.type != "cpu":
        raise ValueError(
            "EngineConfig.batch_invariant: only on the CPU for now (the C attention kernel and "
            f"padded matmuls); on {device.type} the Triton kernels have no batch-invariant "
            "variant yet. Run on the CPU, or turn the mode off"
        )
    if ALIASES.get(name, name) not in ("auto", "cpu"):
        raise ValueError(
            f"EngineConfig.attention_backend: {name!r} is not batch invariant; the "
            "batch-invariant mode runs the C kernel ('cpu', or leave it 'auto')"
        )
    import raylane.kernels.attention.cpu_kernel as cpu_kernel

    if not cpu_kernel.is_available():
        raise ValueError(
            "EngineConfig.batch_invariant: the C attention kernel did not build on this "
            "machine (see the log); install a C compiler (gcc or clang) and start again"
        )
    return "cpu"
