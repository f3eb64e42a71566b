"""Triton kernels for linear-attention layers: the gated delta rule and causal conv1d over packed
varlen steps, each sequence's state read from and written back to its slot.

The delta rule runs token by token inside one program per (sequence, value head, value block),
the state tile [Dk, BV] held in registers: decodes and prefill chunks share the kernel, and the
launch depends only on device tensors and the step's longest query, so a decode batch replays
from a graph. Checked against the torch reference under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from raylane.kernels.linear_attention.gated_delta import L2_EPS


@triton.jit
def _gated_delta_kernel(
    q, k, v, g, beta, state, out, qsl, slots, scale,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    seq, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = hv // (HV // HK)  # grouped heads: consecutive value heads share a key head
    start = tl.load(qsl + seq)
    end = tl.load(qsl + seq + 1)
    slot = tl.load(slots + seq).to(tl.int64)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mk, mv = ok < DK, ov < DV
    s_ptr = state + ((slot * HV + hv) * DK + ok[:, None]) * DV + ov[None, :]
    s = tl.load(s_ptr, mask=mk[:, None] & mv[None, :], other=0.0)  # [BK, BV] float32
    for t in range(start, end):
        qt = tl.load(q + (t * HK + hk) * DK + ok, mask=mk, other=0.0).to(tl.float32)
        kt = tl.load(k + (t * HK + hk) * DK + ok, mask=mk, other=0.0).to(tl.float32)
        if L2NORM:
            qt = qt * tl.rsqrt(tl.sum(qt * qt) + EPS)
            kt = kt * tl.rsqrt(tl.sum(kt * kt) + EPS)
        vt = tl.load(v + (t * HV + hv) * DV + ov, mask=mv, other=0.0).to(tl.float32)
        gt = tl.load(g + t * HV + hv).to(tl.float32)
        bt = tl.load(beta + t * HV + hv).to(tl.float32)
        s = s * tl.exp(gt)
        delta = (vt - tl.sum(s * kt[:, None], axis=0)) * bt  # [BV] what S mispredicts
        s = s + kt[:, None] * delta[None, :]
        o = tl.sum(s * (qt * scale)[:, None], axis=0)
        tl.store(out + (t * HV + hv) * DV + ov, o.to(out.dtype.element_ty), mask=mv)
    tl.store(s_ptr, s, mask=mk[:, None] & mv[None, :])


def gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv]
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [num_slots, Hv, Dk, Dv] float32, updated in place
    query_start_loc: torch.Tensor,  # [B + 1] int32
    state_slots: torch.Tensor,  # [B] int64
    l2norm: bool = True,
) -> torch.Tensor:  # [T, Hv, Dv]
    (_, hk, dk), (_, hv, dv) = q.shape, v.shape
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty_like(v)
    bv = min(triton.next_power_of_2(dv), 64)
    grid = (state_slots.shape[0], hv, triton.cdiv(dv, bv))
    _gated_delta_kernel[grid](
        q, k, v, g, beta, state, out, query_start_loc, state_slots, dk**-0.5,
        HK=hk, HV=hv, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv, L2NORM=l2norm,
        EPS=L2_EPS,
    )  # fmt: skip
    return out


@triton.jit
def _conv_kernel(
    x, weight, bias, conv_state, out, qsl, slots,
    C: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    seq, tb, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(qsl + seq)
    length = tl.load(qsl + seq + 1) - start
    slot = tl.load(slots + seq).to(tl.int64)
    ot = tb * BT + tl.arange(0, BT)  # positions in this step's chunk
    oc = cb * BC + tl.arange(0, BC)
    mt, mc = ot < length, oc < C
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + oc, mask=mc, other=0.0).to(tl.float32)[None, :]
    for w in tl.static_range(W):
        p = ot - (W - 1) + w  # the input this tap reads: < 0 comes from the carried state
        from_x = tl.load(
            x + (start + p)[:, None] * C + oc[None, :],
            mask=(mt & (p >= 0))[:, None] & mc[None, :], other=0.0,
        )  # fmt: skip
        from_state = tl.load(
            conv_state + (slot * C + oc[None, :]) * (W - 1) + (W - 1 + p)[:, None],
            mask=(mt & (p < 0))[:, None] & mc[None, :], other=0.0,
        )  # fmt: skip
        tap = tl.load(weight + oc * W + w, mask=mc, other=0.0).to(tl.float32)
        acc += (from_x.to(tl.float32) + from_state.to(tl.float32)) * tap[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out + (start + ot)[:, None] * C + oc[None, :], acc.to(out.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])  # fmt: skip


@triton.jit
def _conv_state_kernel(
    x, conv_state, qsl, slots, C: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
    BC: tl.constexpr,
):  # fmt: skip
    seq, cb = tl.program_id(0), tl.program_id(1)
    start = tl.load(qsl + seq)
    length = tl.load(qsl + seq + 1) - start
    slot = tl.load(slots + seq).to(tl.int64)
    j = tl.arange(0, BW)  # the new state's columns: inputs length - (W - 1) + j
    oc = cb * BC + tl.arange(0, BC)
    mj, mc = j < W - 1, oc < C
    p = length - (W - 1) + j
    row = conv_state + (slot * C + oc[:, None]) * (W - 1)
    from_x = tl.load(x + (start + p)[None, :] * C + oc[:, None],
                     mask=(mj & (p >= 0))[None, :] & mc[:, None], other=0.0)  # fmt: skip
    old = tl.load(row + (W - 1 + p)[None, :], mask=(mj & (p < 0))[None, :] & mc[:, None], other=0.0)
    new = from_x.to(conv_state.dtype.element_ty) + old  # both loaded before the store
    tl.store(row + j[None, :], new, mask=mj[None, :] & mc[:, None])


def causal_conv1d(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, W]
    bias: torch.Tensor | None,  # [C]
    conv_state: torch.Tensor,  # [num_slots, C, W - 1] updated in place
    query_start_loc: torch.Tensor,  # [B + 1] int32
    state_slots: torch.Tensor,  # [B] int64
    max_query_len: int,
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, C]
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal conv1d: unknown activation {activation!r}; known: silu, swish")
    (_, c), w = x.shape, weight.shape[1]
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    bt, bc, batch = min(triton.next_power_of_2(max_query_len), 32), 64, state_slots.shape[0]
    _conv_kernel[(batch, triton.cdiv(max_query_len, bt), triton.cdiv(c, bc))](
        x, weight, bias if bias is not None else weight, conv_state, out, query_start_loc,
        state_slots, C=c, W=w, HAS_BIAS=bias is not None, SILU=activation is not None, BT=bt,
        BC=bc,
    )  # fmt: skip
    # the state moves on only once every output read the old one (a second launch)
    _conv_state_kernel[(batch, triton.cdiv(c, bc))](
        x, conv_state, query_start_loc, state_slots, C=c, W=w,
        BW=triton.next_power_of_2(max(w - 1, 1)), BC=bc,
    )  # fmt: skip
    return out
