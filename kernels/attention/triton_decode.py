"""Split-K paged decode attention in Triton: one query per sequence over its paged context,
the keys split across programs and the partial softmaxes reduced after."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from raylane.kernels.attention.triton_common import (
    _MAX_SPLITS,
    _MIN_SPLIT_TOKENS,
    LOG2E,
    _load_kv_tile,
    _PagedCall,
    _sink_mass,
    _softmax_step,
    _window_start,
)


@triton.jit
def _decode_kernel(
    q,
    k_cache,
    v_cache,
    out,
    block_tables,
    seq_lens,
    part_ml,
    part_acc,
    sinks,
    qk_scale,
    window,
    num_splits,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # one program: sequence b, HEADS of the GROUP query heads of KV head kvh (their chunk
    # `part`: wide rows split a group across programs), one split of the keys it sees (the last
    # `window` of its context with a window; blocks before them are never read)
    b, pid, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    kvh, part = pid // NUM_CHUNKS, pid % NUM_CHUNKS
    seq_len = tl.load(seq_lens + b)
    lo = _window_start(seq_len - 1, window)
    chunk = tl.cdiv(seq_len - lo, num_splits)  # per sequence: short contexts leave splits empty
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    g, d = tl.arange(0, G_PAD), tl.arange(0, D_PAD)
    local = part * HEADS + g  # the head's index within its group
    heads, g_ok = kvh * GROUP + local, (g < HEADS) & (local < GROUP)
    d_ok, dv_ok = d < HEAD_DIM, d < V_DIM
    q_ok = g_ok[:, None] & d_ok[None, :]
    o_ok = g_ok[:, None] & dv_ok[None, :]
    qv = tl.load(
        q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_ok, other=0.0
    )  # [G_PAD, D_PAD]; padded heads are 0 rows whose output is dropped
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table = block_tables + b * stride_bt
    for n in range(start, end, BLOCK_N):  # every tile holds >= 1 visible key for all rows
        pos = n + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        k, v = _load_kv_tile(
            k_cache,
            v_cache,
            table,
            pos,
            pos_ok,
            d,
            d_ok,
            dv_ok,
            stride_ks,
            stride_vs,
            kvh * stride_kh,
            kvh * stride_vh,
            BLOCK_SIZE,
        )
        m, total, acc = _softmax_step(
            qv, k, v, pos_ok[None, :], m, total, acc, qk_scale, PRECISION, UPCAST
        )
    if DIRECT:  # one split: normalise here; seq_len 0 (graph padding) gives zeros, not nan
        total += _sink_mass(sinks, heads, g_ok, m, HAS_SINKS)
        res = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(
            out + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            res.to(out.dtype.element_ty),
            mask=o_ok,
        )
    else:  # partials [2, B, H, S] (m, total), [B, H, S, D] acc; an empty split: (-inf, 0, 0)
        row = (b * NUM_HEADS + heads) * num_splits + split  # [G_PAD]
        tl.store(part_ml + row, m, mask=g_ok)
        tl.store(part_ml + tl.num_programs(0) * NUM_HEADS * num_splits + row, total, mask=g_ok)
        tl.store(part_acc + row[:, None] * HEAD_DIM + d[None, :], acc, mask=q_ok)


@triton.jit
def _reduce_splits_kernel(
    part_ml,
    part_acc,
    out,
    sinks,
    num_splits,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    s, d = tl.arange(0, S_PAD), tl.arange(0, D_PAD)
    s_ok, d_ok = s < num_splits, d < HEAD_DIM
    row = (b * NUM_HEADS + h) * num_splits + s  # [S_PAD]
    m = tl.load(part_ml + row, mask=s_ok, other=float("-inf"))
    sums = tl.load(
        part_ml + tl.num_programs(0) * NUM_HEADS * num_splits + row, mask=s_ok, other=0.0
    )
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # seq_len 0: every split is empty
    w = tl.exp2(m - top)  # [S_PAD]; 0 for empty splits
    acc = tl.load(
        part_acc + row[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [S_PAD, D_PAD]
    total = tl.sum(w * sums, 0)
    if HAS_SINKS:  # the sink joins the denominator once, under the same max
        total += tl.exp2(tl.load(sinks + h).to(tl.float32) * 1.4426950408889634 - top)
    res = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    o_ok = d < V_DIM
    tl.store(out + b * stride_ob + h * stride_oh + d, res.to(out.dtype.element_ty), mask=o_ok)


def pick_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Split-K factor for decode: enough programs to fill `num_sms` twice, but no split shorter
    than `_MIN_SPLIT_TOKENS` keys; at most `_MAX_SPLITS`."""
    by_length = triton.cdiv(max_seq_len, _MIN_SPLIT_TOKENS)
    by_occupancy = triton.cdiv(2 * num_sms, max(batch * num_kv_heads, 1))
    return max(1, min(_MAX_SPLITS, by_length, by_occupancy))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_size: int,
    out: torch.Tensor,
    num_splits: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """One query per sequence over its paged context, split-K across `num_splits` programs.
    `window`: it sees only its last `window` keys (itself included); `sinks` [H]: per-head
    logits joining each softmax's denominator (gpt-oss).

    q, out: [B, H, D] (any row and head strides); caches [num_slots, KVH, D]; block_tables
    [B, W] int32; seq_lens [B] int32, the context including the current token (0 writes zeros).
    num_splits=None picks one for a context as long as the table is wide (W * block_size); pass
    `pick_num_splits(...)` for the real longest context, fixed per captured CUDA graph.
    """
    call = _PagedCall.checked(
        q, k_cache, v_cache, out, block_tables, seq_lens, sinks, block_size, least_rows=16
    )
    batch = q.shape[0]
    if batch == 0:
        return
    if num_splits is None:
        num_splits = pick_num_splits(batch, call.num_kv_heads, block_tables.shape[1] * block_size)
    part_ml, part_acc = _split_partials(call, num_splits)
    _attend_splits(call, part_ml, part_acc, scale, window, num_splits)
    if num_splits != 1:  # each split left a partial softmax: combine them
        _reduce_splits(call, part_ml, part_acc, num_splits)


def _split_partials(call: _PagedCall, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    # float32 scratch: (max, sum) per head and split, then the unnormalised outputs; empty
    # for one split, which normalises in place
    q = call.q
    batch, num_heads, head_dim = q.shape[0], call.num_heads, q.shape[2]
    direct = num_splits == 1
    ml_shape = (0,) if direct else (2, batch, num_heads, num_splits)
    acc_shape = (0,) if direct else (batch, num_heads, num_splits, head_dim)
    return (
        q.new_empty(ml_shape, dtype=torch.float32),
        q.new_empty(acc_shape, dtype=torch.float32),
    )


def _attend_splits(
    call: _PagedCall,
    part_ml: torch.Tensor,
    part_acc: torch.Tensor,
    scale: float,
    window: int | None,
    num_splits: int,
) -> None:
    # one program per sequence, chunk of a KV head's query heads and split of its keys
    grid = (call.q.shape[0], call.num_kv_heads * call.chunks, num_splits)
    _decode_kernel[grid](
        *call.tensors,
        part_ml,
        part_acc,
        call.sinks,
        scale * LOG2E,
        window or 0,
        num_splits,
        *call.strides(),
        NUM_HEADS=call.num_heads,
        G_PAD=call.rows,
        DIRECT=num_splits == 1,
        **call.constants,
    )


def _reduce_splits(
    call: _PagedCall, part_ml: torch.Tensor, part_acc: torch.Tensor, num_splits: int
) -> None:
    # one program per (sequence, query head): the splits' partial softmaxes into out
    out, constants = call.out, call.constants
    _reduce_splits_kernel[(call.q.shape[0], call.num_heads)](
        part_ml,
        part_acc,
        out,
        call.sinks,
        num_splits,
        *out.stride()[:2],
        NUM_HEADS=call.num_heads,
        S_PAD=triton.next_power_of_2(num_splits),
        **{name: constants[name] for name in ("HEAD_DIM", "V_DIM", "D_PAD", "HAS_SINKS")},
    )
