"""Which kernels serve the batch-invariant mode on a device, or why none do: the C attention
kernel and padded matmuls on the CPU, the Triton kernels on CUDA (`on_triton`)."""

from __future__ import annotations

import torch
from raylane.kernels.attention.registry import ALIASES, has_triton, triton_on_cpu

# per device type: the backend the mode runs and the names a user may ask for
_BACKENDS = {"cpu": ("cpu", ("auto", "cpu")), "cuda": ("triton", ("auto", "triton"))}


def on_triton(device: torch.device) -> bool:
    """The mode's tensors on `device` take its CUDA path (the Triton matmul, RMSNorm,
    log_softmax, experts and attention): on CUDA, and on the CPU under the registry's
    `triton_on_cpu` (TRITON_INTERPRET=1 and RAYLANE_TRITON_ON_CPU=1), which is how tests run
    the CUDA path on a machine without a GPU. The engine and `raylane.batch_invariant()`
    both ask this, so the two take one path."""
    return device.type == "cuda" or (device.type == "cpu" and triton_on_cpu())


def batch_invariant_backend(name: str, device: torch.device) -> str:
    """The attention backend for the batch-invariant mode: the C paged kernel on the CPU, the
    Triton kernels in their invariant form on CUDA (every row a one-split decode), whose order
    of work per query row is fixed whatever else runs. ValueError saying what to change where
    no backend keeps that."""
    if device.type not in _BACKENDS:
        raise ValueError(
            f"EngineConfig.batch_invariant: not on {device.type}; the mode runs on the CPU (the "
            "C attention kernel, padded matmuls) or on CUDA with triton installed. Run on one "
            "of those, or turn the mode off"
        )
    backend, allowed = _BACKENDS["cuda" if on_triton(device) else device.type]
    if ALIASES.get(name, name) not in allowed:
        raise ValueError(
            f"EngineConfig.attention_backend: {name!r} is not batch invariant; the "
            f"batch-invariant mode on {device.type} runs {backend!r} (or leave it 'auto')"
        )
    if backend == "triton" and not has_triton(device):
        raise ValueError(
            "EngineConfig.batch_invariant: on CUDA the mode needs triton (its matmul, RMSNorm "
            "and attention kernels), which does not import here; install triton, or turn the "
            "mode off"
        )
    if backend == "cpu":
        import raylane.kernels.attention.cpu_kernel as cpu_kernel

        if not cpu_kernel.is_available():
            raise ValueError(
                "EngineConfig.batch_invariant: the C attention kernel did not build on this "
                "machine (see the log); install a C compiler (gcc or clang) and start again"
            )
    return backend
