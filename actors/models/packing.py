"""Pre-packed linear weights for CPU float32 and bfloat16 inference.

oneDNN matmuls on weights reordered once into its blocked layout run about 2x faster than
`F.linear` at the small batch sizes of decoding (measured on the 2-core dev machine: 83 -> 175
GFLOP/s at 32 tokens), because the weight is not re-laid out on every call. The packed copy
sits next to the parameter (which stays the source of truth for loading and state_dict), so it
costs the linear weights' memory once more and must be refreshed when weights change:
`load_weights` does that. In bfloat16 the packed matmul is again ~1.3-2x `F.linear` (and ~2x
packed float32) at 1-128 tokens, on this CPU's avx512_bf16.
"""

from __future__ import annotations

import functools

import torch
from raylane.actors.models.layers import LinearBase, ParallelLMHead, linear
from raylane.kernels.batch_invariant.linear import PACK_HINT
from torch import nn

# the layout oneDNN picks for this batch size serves 1..512 tokens well; the batch-invariant
# mode's padded linears (and a trainer's, inside raylane.batch_invariant()) use the same
BATCH_HINT = PACK_HINT
# packed vs F.linear on the same inputs: both accumulate in float32, bfloat16 rounds the output
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in _TOLERANCE
        and reorder_supported(weight.dtype)
    )


@functools.cache
def reorder_supported(dtype: torch.dtype) -> bool:
    """oneDNN can pack `dtype` weights on this CPU (its bf16 path needs avx512bw/vl/dq or
    avx_ne_convert: on a CPU without them the reorder raises)."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), BATCH_HINT)
    except RuntimeError:
        return False
    return True


def _packable(model: nn.Module) -> list[LinearBase | ParallelLMHead]:
    return [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]


def _agrees(module: LinearBase | ParallelLMHead, packed: torch.Tensor) -> bool:
    """Guard against an internal op misbehaving on an unusual CPU: compare with F.linear once."""
    weight = module.weight.detach()
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
    x = x.to(weight.dtype)
    ref = linear(x, weight, None, None).float()
    tol = _TOLERANCE[weight.dtype]
    return torch.allclose(linear(x, weight, None, packed).float(), ref, atol=tol, rtol=tol)


def pack_linear_weights(model: nn.Module) -> int:
    """Give every linear and the LM head a oneDNN-packed weight; returns how many were packed
    (0 when the weights are not CPU float32 / bfloat16 or oneDNN is unavailable)."""
    modules = _packable(model)
    if not modules or not can_pack(modules[0].weight):
        return 0
    with torch.no_grad():
        packed = [
            torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), BATCH_HINT) for m in modules
        ]
        if not _agrees(modules[0], packed[0]):
            return 0
    for module, weight in zip(modules, packed):
        module.packed = weight
    return len(modules)


def unpack_linear_weights(model: nn.Module) -> None:
    for module in _packable(model):
        module.packed = None


def repack_changed(model: nn.Module, param_names: set[str]) -> int:
    """Re-pack the packed modules whose weight is among `param_names` (parameters a bucket of
    a weight update just loaded), so the rest of the model keeps its packs; returns how many.
    Matched by identity, so a tied LM head is re-packed with the embedding it shares."""
    modules = drop_packs(model, param_names)
    pack_modules(modules)
    return len(modules)


def drop_packs(model: nn.Module, param_names: set[str]) -> list[LinearBase | ParallelLMHead]:
    """Drop the packs of the modules whose weight is among `param_names` (they run F.linear,
    the same values, until `pack_modules`); returns those modules."""
    changed = {id(p) for name, p in model.named_parameters() if name in param_names}
    modules = [m for m in _packable(model) if m.packed is not None and id(m.weight) in changed]
    for module in modules:
        module.packed = None  # its memory is reused for the new pack (no page faults)
    return modules


def pack_modules(modules: list[LinearBase | ParallelLMHead]) -> None:
    """Pack each module's current weight (modules `drop_packs` returned)."""
    with torch.no_grad():
        for module in modules:
            module.packed = torch.ops.mkldnn._reorder_linear_weight(
                module.weight.detach(), BATCH_HINT
            )


def refresh_packed_weights(model: nn.Module) -> None:
    """Re-pack after the weights changed, if the model was packed."""
    if any(m.packed is not None for m in _packable(model)):
        unpack_linear_weights(model)
        pack_linear_weights(model)
