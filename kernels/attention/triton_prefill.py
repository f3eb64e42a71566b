"""Varlen causal paged prefill attention in Triton: each sequence's new chunk over its cached
context, (query token x query head) rows packed per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from raylane.kernels.attention.triton_common import (
    _PREFILL_BLOCK_M,
    LOG2E,
    _load_kv_tile,
    _PagedCall,
    _sink_mass,
    _softmax_step,
    _window_start,
)


@triton.jit
def _prefill_kernel(
    q,
    k_cache,
    v_cache,
    out,
    block_tables,
    seq_lens,
    query_start_loc,
    sinks,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # one program: sequence i, BLOCK_Q query tokens times HEADS of the GROUP heads of KV head
    # kvh (their chunk `part`: wide rows split a group across programs), packed as BLOCK_M rows
    # (token-major), so each key tile is loaded once for all of them
    i, tile, pid = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kvh, part = pid // NUM_CHUNKS, pid % NUM_CHUNKS
    q_start = tl.load(query_start_loc + i)
    q_len = tl.load(query_start_loc + i + 1) - q_start
    if tile * BLOCK_Q >= q_len:  # the grid is sized for the longest query in the batch
        return
    context = tl.load(seq_lens + i) - q_len  # positions cached before this chunk
    r, d = tl.arange(0, BLOCK_M), tl.arange(0, D_PAD)
    local = part * HEADS + r % HEADS  # the head's index within its group
    tok, heads, head_ok = tile * BLOCK_Q + r // HEADS, kvh * GROUP + local, local < GROUP
    d_ok, dv_ok = d < HEAD_DIM, d < V_DIM
    rows_ok = ((r < BLOCK_Q * HEADS) & (tok < q_len) & head_ok)[:, None]
    row_ok, out_ok = rows_ok & d_ok[None, :], rows_ok & dv_ok[None, :]
    q_pos = context + tok  # [BLOCK_M]; padded rows sit past the chunk and still see key 0
    row_offsets = (q_start + tok).to(tl.int64)[:, None]
    qv = tl.load(
        q + row_offsets * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok,
        other=0.0,
    )  # [BLOCK_M, D_PAD]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_end = context + tl.minimum((tile + 1) * BLOCK_Q, q_len)  # last query's position + 1
    table = block_tables + i.to(tl.int64) * stride_bt
    # with a window, keys before the first query's window are never read (freed blocks)
    for n in range(_window_start(context + tile * BLOCK_Q, window), kv_end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
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
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])  # causal
        recent = (pos[None, :] > q_pos[:, None] - window) | (window == 0)
        visible = visible & recent  # inside the window, if any
        m, total, acc = _softmax_step(qv, k, v, visible, m, total, acc, qk_scale, PRECISION, UPCAST)
    total += _sink_mass(sinks, heads, head_ok, m, HAS_SINKS)
    res = acc / tl.where(total > 0, total, 1.0)[:, None]  # padded rows may see no key
    tl.store(
        out + row_offsets * stride_ot + heads[:, None] * stride_oh + d[None, :],
        res.to(out.dtype.element_ty),
        mask=out_ok,
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    block_size: int,
    out: torch.Tensor,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Varlen causal attention of each sequence's new chunk over its paged context (a query
    sees its last `window` keys with a window; `sinks` as for `decode_attention`).

    q, out: [T, H, D] (any row and head strides), sequence i's rows are
    `q[query_start_loc[i]:query_start_loc[i + 1]]`; query_start_loc [B + 1] int32; seq_lens [B]
    int32 = cached context + chunk, whose K/V are already stored; block_tables [B, W] int32;
    max_query_len: host int >= the longest chunk (sizes the grid).
    """
    call = _PagedCall.checked(
        q, k_cache, v_cache, out, block_tables, seq_lens, sinks, block_size, _PREFILL_BLOCK_M
    )
    batch = seq_lens.shape[0]
    if batch == 0 or max_query_len == 0:
        return
    _attend_chunks(call, batch, query_start_loc, max_query_len, scale, window)


def _attend_chunks(
    call: _PagedCall,
    batch: int,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int | None,
) -> None:
    # one program per sequence, tile of its chunk's query tokens and chunk of a KV head's
    # query heads (a wider group than a program holds splits in chunks)
    # query tokens per program; its rows past heads * block_q idle
    block_q = call.rows // call.heads
    grid = (batch, triton.cdiv(max_query_len, block_q), call.num_kv_heads * call.chunks)
    _prefill_kernel[grid](
        *call.tensors,
        query_start_loc,
        call.sinks,
        scale * LOG2E,
        window or 0,
        *call.strides(),
        BLOCK_M=call.rows,
        BLOCK_Q=block_q,
        **call.constants,
    )
