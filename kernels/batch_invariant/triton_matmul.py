"""A row-invariant matmul in Triton for CUDA: x [M, K] @ w.T (w [N, K]) + bias, with ONE tile
config and no split-K, so an output element's dot product runs over K in the same BLOCK_K
steps, in the same order, with the same instructions, whatever M is and whatever rows share its
tile. cuBLAS picks its tiling and split-K by M, which is why torch.matmul on CUDA is not batch
invariant (Thinking Machines, "Defeating Nondeterminism in LLM Inference").

The tile sizes are fixed, not tuned per shape (tuning by shape is what breaks invariance); they
have not been timed on a GPU. Under TRITON_INTERPRET=1 it runs on the CPU (slow: tests keep
sizes tiny). This module imports triton: callers check that it imports first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from raylane.kernels.batch_invariant.grads import linear_grads

# the one tile config: every call, every M
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit
def _interpreted_dot(a, b):
    # a [BM, BK] @ b [BK, BN] in float32 as a sum of products over BK. The interpreter's tl.dot
    # is numpy's matmul, i.e. BLAS, whose micro-kernel rounds a row by its position in the
    # tile (measured: a row alone and the same row 10th in a tile differ), and it multiplies
    # bf16 bit patterns as integers (attention/triton_common.py's _dot). On a GPU every
    # element of an mma tile takes the same instructions, so tl.dot keeps rows apart there.
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _matmul_kernel(
    x,
    w,
    bias,
    out,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program: a BLOCK_M x BLOCK_N tile of the output, K reduced in BLOCK_K steps from 0
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(
            x + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]; rows past M and columns past K read as 0
        b = tl.load(
            w + rn[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None] * stride_wk,
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if INTERPRETED:  # the CPU's interpreter: see `_interpreted_dot`
            acc += _interpreted_dot(a, b)
        else:
            acc += tl.dot(a, b, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out + rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on,
        acc.to(out.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def invariant_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias [N]) -> [M, N] in x's dtype, float32 accumulation; row i
    is bit-identical whatever M and whatever the other rows hold."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"invariant_matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"invariant_matmul: weight is {weight.dtype}, x is {x.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    out = x.new_empty(m, n)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,  # never read without HAS_BIAS
        out,
        m,
        n,
        k,
        *x.stride(),
        *weight.stride(),
        *out.stride(),
        HAS_BIAS=bias is not None,
        INTERPRETED=x.device.type == "cpu",  # CPU tensors: TRITON_INTERPRET=1
        # float32: exact products, not tf32; 16-bit inputs ignore it (as attention's _dot_mode)
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out


class InvariantLinear(torch.autograd.Function):
    """`invariant_matmul` forward; the backward is a linear's in torch (not row-invariant,
    as linear.py's `_PackedLinear`: only the forward is compared with the engine's)."""

    @staticmethod
    def forward(ctx, rows, weight, bias):
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return invariant_matmul(rows, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        return linear_grads(ctx, grad)
