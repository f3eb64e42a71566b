"""The kernels a runner's networks run on, chosen once at start-up: one attention backend for
every attention layer (the target's and those of the networks features run beside it), and
the fused ops (RMSNorm, gated activations, RoPE). The batch-invariant mode takes the backend
with one reduction order (the C kernel on the CPU, the Triton kernels' one-split decode form on
CUDA) and the torch ops, which are a trainer's transformers ops (and reduce within a row; on
CUDA RMSNorm runs a row-wise Triton kernel), and switches the linears onto their invariant path
(padded oneDNN/torch matmuls on the CPU, the fixed-tile Triton matmul on CUDA). Every family
has its CUDA form: MLA's expanded attention as one-split Triton decodes (triton_mla.py), DSA's
per-token indexer and sparse attention on a per-token Triton matmul (triton_dsa.py), Gated
DeltaNet's recurrence in a Triton kernel (triton_gdn.py)."""

from __future__ import annotations

from typing import Any

import torch
from raylane.actors.models.layers import make_batch_invariant
from raylane.actors.runner.config import RunnerConfig
from raylane.kernels.attention import BackendRequest, get_backend
from raylane.kernels.batch_invariant import batch_invariant_backend
from raylane.kernels.fused_ops import attach_fused_ops, get_fused_ops


def attach_kernels(
    nets: list[Any], config: RunnerConfig, device: torch.device, dtype: torch.dtype
) -> None:
    layers = [layer for net in nets for layer in net.attention_layers()]
    backend = _backend(layers, config, device, dtype)
    for layer in layers:
        layer.backend = backend
    fused = get_fused_ops("batch_invariant" if config.batch_invariant else "auto", device)
    for net in nets:
        attach_fused_ops(net, fused)
        if config.batch_invariant:
            make_batch_invariant(net)


def _backend(layers: list, config: RunnerConfig, device: torch.device, dtype: torch.dtype):
    kinds = set().union(*(layer.backend_kinds() for layer in layers))
    if config.batch_invariant:  # DSA layers run their own ops (sparse.py), never a
        kinds.discard("dsa")  # backend: the C kernel need not list them to be the one
    request = BackendRequest(  # the shapes a backend with limits (flash_attn) checks
        dtype=dtype,
        head_sizes=tuple(sorted({layer.head_dim for layer in layers})),
        block_size=config.block_size,
        num_splits=1 if config.batch_invariant else 0,  # one reduction order
    )
    name = config.attention_backend
    if config.batch_invariant:
        name = batch_invariant_backend(name, device)
    return get_backend(name, device, kinds, request)
