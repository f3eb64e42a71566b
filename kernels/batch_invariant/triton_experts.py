"""The MoE experts' linear for the batch-invariant mode on CUDA: a [S, in] with rows grouped by
expert, each row times its own expert's weight, one program per (row, BLOCK_N outputs), K
summed in BLOCK_K steps from 0 as a sum of products (no tl.dot, whose tiles would mix rows of
different experts). A row's order then depends on nothing but the shapes. Unlike
linear.py's `grouped_linear` on the CPU it reads the grouping on the device (no `.tolist()`),
so a decode step with experts still captures in a CUDA graph. A GEMV per row: fine at decode
batch sizes, slow for long prefills (not timed on a GPU)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from raylane.kernels.batch_invariant.grads import linear_grads

BLOCK_N, BLOCK_K = 64, 64  # fixed, never chosen by the shape


@triton.jit
def _expert_rows_kernel(
    a, w, expert_of_row, out, N, K,
    stride_am, stride_we, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    expert = tl.load(expert_of_row + row).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + rk < K
        x = tl.load(a + row * stride_am + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
        wt = tl.load(
            w + expert * stride_we + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        acc += tl.sum(wt * x[None, :], axis=1)
    tl.store(out + row * stride_om + rn, acc.to(out.dtype.element_ty), mask=n_ok)


def expert_rows_linear(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """a [S, in] with rows grouped by expert (group e ends at row ends[e], exclusive); w [E, out,
    in] -> [S, out] in a's dtype, each row through its expert's weight in one order."""
    a, w = a.contiguous(), w.contiguous()
    rows = torch.arange(a.shape[0], device=a.device)
    expert_of_row = torch.searchsorted(ends.to(torch.int64), rows, right=True)  # [S]
    expert_of_row = expert_of_row.clamp(max=w.shape[0] - 1)  # rows past the groups: unused
    out = a.new_empty(a.shape[0], w.shape[1])
    if a.shape[0] == 0:
        return out
    grid = (a.shape[0], triton.cdiv(w.shape[1], BLOCK_N))
    _expert_rows_kernel[grid](
        a, w, expert_of_row, out, w.shape[1], w.shape[2],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


class ExpertLinear(torch.autograd.Function):
    """One expert's linear, rows [S, in] @ weight [out, in].T, through `expert_rows_linear`
    (the kernel the engine's mode runs experts on), for a trainer's expert loop inside
    `raylane.batch_invariant()` on CUDA; the backward is a linear's, in torch ops."""

    @staticmethod
    def forward(ctx, rows, weight):
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = False
        ends = torch.full((1,), rows.shape[0], dtype=torch.int32, device=rows.device)
        return expert_rows_linear(rows, weight[None], ends)

    @staticmethod
    def backward(ctx, grad):
        return linear_grads(ctx, grad)[:2]
