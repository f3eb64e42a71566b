"""Row-invariant matmuls: `F.linear` over a row count padded to a multiple of ROW_BLOCK."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# 16 rows: the smallest block at which both float32 and bfloat16 GEMMs keep one reduction
# order per row at every M (1, 2, 4 and 8 do not in float32; M = 1 is a GEMV in both)
ROW_BLOCK = 16

# the F.linear of torch itself: `raylane.batch_invariant()` replaces F.linear with
# `padded_linear`, which must still reach the original
_LINEAR = F.linear


def padded_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) with one reduction order per row: x [..., in] -> [..., out].
    The rows are padded with zeros to a multiple of ROW_BLOCK for the call and dropped after
    (autograd flows through). `packed`: the weight's oneDNN-blocked copy (bfloat16 only: there
    it rounds bit for bit as F.linear does and is ~1.3x faster; in float32 it rounds otherwise,
    so a trainer's F.linear could not follow)."""
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    pad = -rows.shape[0] % ROW_BLOCK
    if pad or rows.shape[0] == 0:
        pad = pad or ROW_BLOCK
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    if packed is not None and x.dtype == torch.bfloat16:
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    else:
        out = _LINEAR(rows, weight, bias)
    out = out[: rows.shape[0] - pad]  # [M, out]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def grouped_linear(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """a [S, in] with rows grouped by expert (group e ends at row ends[e], exclusive); w [E, out,
    in] -> [S, out], each group through `padded_linear` with its expert's weight, as a trainer's
    per-expert loop (HF's) does inside `raylane.batch_invariant()`."""
    out = a.new_empty(a.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):  # NOTE: a host sync; the CPU runs it anyway
        if end > start:
            out[start:end] = padded_linear(a[start:end], w[e])
        start = end
    return out
