"""Row-wise RMSNorm, log_softmax and logsumexp in Triton for CUDA: one program per row, the row
read in BLOCK-wide pieces from its start, so a row's sums take one order whatever the row count.

Why not torch's own on CUDA: its reduction kernel (ATen's Reduce.cuh `setReduceConfig`) sizes
the block by both the reduced length and the number of outputs: one row gets up to 512 threads
along the reduced dim, 64 rows get 32 threads along it and 16 rows per block, so a row's partial
sums, and their rounding, follow the row count. (On the CPU, torch's reductions within a row
keep one order; see __init__.py.) Under TRITON_INTERPRET=1 these run on the CPU for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements of a row per step: fixed, never chosen by the shape


@triton.jit
def _rms_norm_kernel(
    x, weight, out, D, eps, stride_x, stride_o, BLOCK: tl.constexpr, WEIGHT_FIRST: tl.constexpr
):
    # HF's LlamaRMSNorm: statistics in float32, the normalised row cast back before the weight;
    # WEIGHT_FIRST: HF's GptOssRMSNorm, the float32 row times the weight, cast back once
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    squares = tl.zeros([BLOCK], tl.float32)
    for start in range(0, D, BLOCK):
        ok = start + cols < D
        h = tl.load(x + row * stride_x + start + cols, mask=ok, other=0.0).to(tl.float32)
        squares += h * h
    inv = 1.0 / tl.sqrt(tl.sum(squares, 0) / D + eps)
    for start in range(0, D, BLOCK):
        ok = start + cols < D
        h = tl.load(x + row * stride_x + start + cols, mask=ok, other=0.0).to(tl.float32)
        normed = h * inv
        if not WEIGHT_FIRST:
            # torch's bf16 product: both factors exact in float32, the product rounded once
            normed = normed.to(x.dtype.element_ty).to(tl.float32)
        w = tl.load(weight + start + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(
            out + row * stride_o + start + cols, (w * normed).to(out.dtype.element_ty), mask=ok
        )


@triton.jit
def _row_logsumexp(x, row, D, stride_x, BLOCK: tl.constexpr):
    # float32: the row's max, then max + log(sum of exp(x - max)), read in BLOCK pieces
    cols = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, D, BLOCK):
        ok = start + cols < D
        h = tl.load(x + row * stride_x + start + cols, mask=ok, other=float("-inf"))
        top = tl.maximum(top, h.to(tl.float32))
    m = tl.max(top, 0)
    sums = tl.zeros([BLOCK], tl.float32)
    for start in range(0, D, BLOCK):
        ok = start + cols < D
        h = tl.load(x + row * stride_x + start + cols, mask=ok, other=float("-inf"))
        sums += tl.where(ok, tl.exp(h.to(tl.float32) - m), 0.0)
    return m + tl.log(tl.sum(sums, 0))


@triton.jit
def _log_softmax_kernel(x, out, D, stride_x, stride_o, BLOCK: tl.constexpr):
    # float32 throughout: x - (max + log(sum of exp(x - max)))
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    shift = _row_logsumexp(x, row, D, stride_x, BLOCK)
    for start in range(0, D, BLOCK):
        ok = start + cols < D
        h = tl.load(x + row * stride_x + start + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + row * stride_o + start + cols, (h - shift).to(out.dtype.element_ty), mask=ok)


@triton.jit
def _logsumexp_kernel(x, out, D, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tl.store(out + row, _row_logsumexp(x, row, D, stride_x, BLOCK))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()  # [R, D], unit stride along D


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_first: bool = False
) -> torch.Tensor:
    """kernels/norm.py's `rms_norm` (x [..., D] -> [..., D] in weight and x's promoted dtype;
    with `weight_first` in x's dtype), each row reduced in one order."""
    rows = _rows(x)
    dtype = x.dtype if weight_first else torch.promote_types(x.dtype, weight.dtype)
    out = rows.new_empty(rows.shape, dtype=dtype)
    if rows.numel():
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.shape[1], eps, rows.stride(0), out.stride(0),
            BLOCK=BLOCK, WEIGHT_FIRST=weight_first,
        )  # fmt: skip
    return out.reshape(x.shape)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> float32 log_softmax over the last dim, each row reduced in one order."""
    rows = _rows(x)
    out = rows.new_empty(rows.shape, dtype=torch.float32)
    if rows.numel():
        _log_softmax_kernel[(rows.shape[0],)](
            rows, out, rows.shape[1], rows.stride(0), out.stride(0), BLOCK=BLOCK
        )
    return out.reshape(x.shape)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> float32 [...], log(sum(exp(x))) over the last dim, each row reduced in
    one order (the sampler's kept mass in the mode; a row needs one finite entry)."""
    rows = _rows(x)
    out = rows.new_empty(rows.shape[0], dtype=torch.float32)
    if rows.numel():
        _logsumexp_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK=BLOCK)
    return out.reshape(x.shape[:-1])


class InvariantLogSoftmax(torch.autograd.Function):
    """`log_softmax` forward (a trainer's `torch.log_softmax(logits.float(), -1)` inside
    `raylane.batch_invariant()`); the backward is log_softmax's, in torch ops."""

    @staticmethod
    def forward(ctx, x):
        out = log_softmax(x)
        ctx.save_for_backward(out)
        ctx.dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return (grad - out.exp() * grad.sum(-1, keepdim=True)).to(ctx.dtype)
