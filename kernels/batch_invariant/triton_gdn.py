"""The batch-invariant mode's gated delta rule on CUDA (Gated DeltaNet: Qwen3.5, Qwen3-Next): a
fused recurrent Triton kernel that steps each sequence token by token, prefill and decode alike.

One program per (sequence, value head, block of BLOCK_V value dims) keeps its [Dk, BLOCK_V]
slice of the float32 state in registers and, per token, L2-normalises q and k (a sum over Dk),
decays the state, predicts v (a sum over Dk per value dim), writes the delta and reads the
output (another sum over Dk). Every sum runs over Dk in one tile whose shape the layer fixes, so
a token's bits depend on its sequence alone: not on what else runs in the step, nor on how a
prompt is cut into chunks (the state between chunks is the float32 one the kernel held). On
the CPU the mode runs the same recurrence in torch ops (linear_attention/invariant.py's
`step`); torch's CUDA reductions size their blocks by the number of outputs, so there it would
follow the batch. Under TRITON_INTERPRET=1 this runs on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from raylane.kernels.linear_attention.gated_delta import L2_EPS

BLOCK_V_MAX = 64  # value dims per program: fixed by the layer's Dv, never by the batch


@triton.jit
def _recurrent_kernel(
    q,
    k,
    v,
    g,
    beta,
    state,
    out,
    starts,
    slots,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_ss,
    stride_sh,
    stride_ot,
    stride_oh,
    scale,
    eps,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    DK_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
):
    seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(starts + seq).to(tl.int64)
    end = tl.load(starts + seq + 1).to(tl.int64)
    dk, dv = tl.arange(0, DK_PAD), vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = dk < DK, dv < DV
    s_at = state + tl.load(slots + seq).to(tl.int64) * stride_ss + h * stride_sh
    s_at = s_at + dk[:, None] * DV + dv[None, :]  # the slot's [Dk, Dv] rows, Dv contiguous
    s_ok = k_ok[:, None] & v_ok[None, :]
    s = tl.load(s_at, mask=s_ok, other=0.0)  # [DK_PAD, BLOCK_V] float32
    hk = h // GROUP  # value head h reads key head h // (Hv // Hk)
    for t in range(start, end):  # int64 token indices: the bounds are loaded as int64
        qv = tl.load(q + t * stride_qt + hk * stride_qh + dk, mask=k_ok, other=0.0).to(tl.float32)
        kv = tl.load(k + t * stride_kt + hk * stride_kh + dk, mask=k_ok, other=0.0).to(tl.float32)
        if L2NORM:
            qv = qv * (1.0 / tl.sqrt(tl.sum(qv * qv, 0) + eps))
            kv = kv * (1.0 / tl.sqrt(tl.sum(kv * kv, 0) + eps))
        qv = qv * scale
        x = tl.load(v + t * stride_vt + h * stride_vh + dv, mask=v_ok, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g + t * stride_gt + h).to(tl.float32))
        strength = tl.load(beta + t * stride_bt + h).to(tl.float32)
        s = s * decay
        predicted = tl.sum(kv[:, None] * s, 0)  # [BLOCK_V]
        delta = (x - predicted) * strength
        s = s + kv[:, None] * delta[None, :]
        o = tl.sum(qv[:, None] * s, 0)
        tl.store(out + t * stride_ot + h * stride_oh + dv, o, mask=v_ok)
    tl.store(s_at, s, mask=s_ok)


def recurrent_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] log decay
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, updated in place
    starts: torch.Tensor,  # [B + 1] each sequence's first token; tokens past starts[-1] skip
    slots: torch.Tensor,  # [B] each sequence's state slot
    l2norm: bool = True,
) -> torch.Tensor:  # [T, Hv, Dv] float32
    """The gated delta rule over packed sequences (linear_attention/gated_delta.py's math: q and
    k L2-normalised if asked, q scaled by Dk^-0.5), each sequence from its slot's state, the
    state after its last token written back. Device tensors only: no host sync."""
    (tokens, hk, dk), (hv, dv) = q.shape, v.shape[1:]
    if state.shape[1:] != (hv, dk, dv) or state.dtype != torch.float32:
        raise ValueError(f"recurrent_delta_rule: state {tuple(state.shape)} {state.dtype}")
    if not state[0].is_contiguous():
        raise ValueError("recurrent_delta_rule: a slot's state must be contiguous")
    out = torch.zeros(tokens, hv, dv, dtype=torch.float32, device=v.device)
    batch = slots.shape[0]
    if tokens == 0 or batch == 0:
        return out
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    block_v = min(triton.next_power_of_2(dv), BLOCK_V_MAX)
    _recurrent_kernel[(batch, hv, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, state, out, starts, slots,
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], g.stride(0), beta.stride(0),
        *state.stride()[:2], *out.stride()[:2], dk**-0.5, L2_EPS,
        GROUP=hv // hk, DK=dk, DV=dv, DK_PAD=triton.next_power_of_2(dk), BLOCK_V=block_v,
        L2NORM=l2norm,
    )  # fmt: skip
    return out
