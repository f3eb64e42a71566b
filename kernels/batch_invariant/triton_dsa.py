"""DeepSeek Sparse Attention's per-token matmuls on CUDA for the batch-invariant mode: a batched
matmul whose batch is the step's tokens (each token its own matrices: its indexer keys, its
chosen latent rows), with ONE tile config and no split-K, and a row-wise softmax.

On the CPU the mode runs each token's matmuls through `padded_linear` in a Python loop
(kernels/attention/sparse.py). On CUDA torch.bmm / einsum go to cuBLAS, which picks its tiling
by the shapes (the step's token count among them), and torch.softmax's reduction sizes its
blocks by the row count. Here an output element [t, m, n] is token t's dot product over K in
BLOCK_K steps from 0, whatever the other tokens, and a softmax row is reduced by
triton_rowwise's log_softmax, one program per row. No host sync: a decode step captures in a
CUDA graph. Under TRITON_INTERPRET=1 this runs on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from raylane.kernels.batch_invariant.triton_matmul import _interpreted_dot
from raylane.kernels.batch_invariant.triton_rowwise import log_softmax

# the one tile config: every call, every token count (M is a head count: 16 rows a tile)
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _token_matmul_kernel(
    a,
    b,
    out,
    M,
    N,
    K,
    stride_at,
    stride_am,
    stride_ak,
    stride_bt,
    stride_bn,
    stride_bk,
    stride_ot,
    stride_om,
    stride_on,
    INTERPRETED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program: token t's BLOCK_M x BLOCK_N output tile, K reduced in BLOCK_K steps from 0
    t = tl.program_id(0).to(tl.int64)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    a_at = a + t * stride_at + rm[:, None].to(tl.int64) * stride_am
    b_at = b + t * stride_bt + rn[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(a_at + (k0 + rk)[None, :] * stride_ak, m_ok[:, None] & k_ok[None, :], 0.0)
        y = tl.load(b_at + (k0 + rk)[:, None] * stride_bk, n_ok[None, :] & k_ok[:, None], 0.0)
        if INTERPRETED:  # the CPU's interpreter: see triton_matmul's `_interpreted_dot`
            acc += _interpreted_dot(x, y)
        else:
            acc += tl.dot(x, y, input_precision=PRECISION)
    o_at = out + t * stride_ot + rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on
    tl.store(o_at, acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    (tokens, m, k), n = a.shape, b.shape[1]
    out = a.new_empty(tokens, m, n)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    grid = (tokens, triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _token_matmul_kernel[grid](
        a, b, out, m, n, k, *a.stride(), *b.stride(), *out.stride(),
        INTERPRETED=a.device.type == "cpu",  # CPU tensors: TRITON_INTERPRET=1
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # 16-bit inputs ignore it
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


class _TokenMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _launch(a, b)

    @staticmethod
    def backward(ctx, grad):  # torch's bmm: gradients need not be batch-invariant
        a, b = ctx.saved_tensors
        grad_a = torch.bmm(grad.float(), b.float()).to(a.dtype)
        grad_b = torch.bmm(grad.float().transpose(1, 2), a.float()).to(b.dtype)
        return grad_a, grad_b


def token_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [T, M, K] @ b[t].T for each token t (b [T, N, K], any strides) -> [T, M, N] in a's
    dtype, float32 accumulation; token t's block is bit-identical whatever T and the other
    tokens hold. Autograd: the backward is torch's bmm."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]:
        raise ValueError(f"token_matmul: a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"token_matmul: a is {a.dtype}, b is {b.dtype}")
    return _TokenMatmul.apply(a, b)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        probs = log_softmax(x).exp()
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        return probs * (grad - (grad * probs).sum(-1, keepdim=True))


def softmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] -> float32 softmax over the last dim as exp(log_softmax), each row reduced
    in one order (triton_rowwise.py); -inf entries give 0."""
    return _Softmax.apply(x)
