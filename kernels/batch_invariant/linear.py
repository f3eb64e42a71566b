"""Row-invariant matmuls: a linear over a row count padded to a multiple of ROW_BLOCK.

float32 runs oneDNN's packed linear (the engine's packs, or a pack made for the call): padded,
it is as row-invariant as F.linear and ~2x faster at decode sizes, but it rounds otherwise than
F.linear, so the engine and a trainer inside `raylane.batch_invariant()` must both take it.
bfloat16 takes the engine's packs where they exist and F.linear elsewhere: there the two round
bit for bit alike. Where oneDNN's packing is missing, everything runs F.linear.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from raylane.kernels.batch_invariant.backend import on_triton
from raylane.kernels.batch_invariant.grads import linear_grads

# 16 rows: the smallest block at which both float32 and bfloat16 GEMMs keep one reduction
# order per row at every M (1, 2, 4 and 8 do not in float32; M = 1 is a GEMV in both)
ROW_BLOCK = 16
# the batch size oneDNN lays a packed weight out for; the layout decides the rounding, so the
# engine's packs (actors/models/packing.py) and a trainer's packs use this one
PACK_HINT = 32

# the F.linear of torch itself: `raylane.batch_invariant()` replaces F.linear with
# `padded_linear`, which must still reach the original
_LINEAR = F.linear


@functools.cache
def packs_available() -> bool:
    """oneDNN's packed linear is here (a CPU build with mkldnn)."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16), PACK_HINT)
    except RuntimeError:
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in]'s oneDNN-blocked copy, laid out for PACK_HINT rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_HINT)


def padded_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """A linear with one reduction order per row: x [..., in] -> [..., out]. The rows are
    padded with zeros to a multiple of ROW_BLOCK for the call and dropped after (autograd flows
    through). `packed`: `weight`'s oneDNN copy, if the caller keeps one. On CUDA (`on_triton`):
    the Triton matmul of triton_matmul.py (one tile config; no padding needed)."""
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    if on_triton(x.device):
        from raylane.kernels.batch_invariant.triton_matmul import InvariantLinear

        out = InvariantLinear.apply(rows, weight, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    pad = -rows.shape[0] % ROW_BLOCK
    if pad or rows.shape[0] == 0:
        pad = pad or ROW_BLOCK
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    if x.device.type == "cpu" and packs_available() and x.dtype == torch.float32:
        out = _PackedLinear.apply(
            rows, weight, bias, packed if packed is not None else pack(weight)
        )
    elif packed is not None and x.dtype == torch.bfloat16:
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    else:
        out = _LINEAR(rows, weight, bias)
    out = out[: rows.shape[0] - pad]  # [M, out]
    return out.reshape(*x.shape[:-1], weight.shape[0])


class _PackedLinear(torch.autograd.Function):
    """oneDNN's packed linear forward; the backward is a linear's (not row-invariant)."""

    @staticmethod
    def forward(ctx, rows, weight, bias, packed):
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad):
        return (*linear_grads(ctx, grad), None)


def grouped_linear(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """a [S, in] with rows grouped by expert (group e ends at row ends[e], exclusive); w [E, out,
    in] -> [S, out], each group through `padded_linear` with its expert's weight, as a trainer's
    per-expert loop (HF's) does inside `raylane.batch_invariant()`. On CUDA: triton_experts.py's
    kernel, which reads the grouping on the device (a CUDA graph captures it)."""
    if on_triton(a.device):
        from raylane.kernels.batch_invariant.triton_experts import expert_rows_linear

        return expert_rows_linear(a, w, ends)
    out = a.new_empty(a.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):  # NOTE: a host sync; the CPU runs it anyway
        if end > start:
            out[start:end] = padded_linear(a[start:end], w[e])
        start = end
    return out
