"""Paged attention kernels in Triton: KV store, split-K decode and varlen causal prefill.

Each layer's cache is `[num_slots, num_kv_heads, head_dim]` for K and
`[num_slots, num_kv_heads, v_dim]` for V, v_dim <= head_dim (MLA's absorbed form passes the
latent part of its key cache as V, a view with the key rows' slot stride); slot
`block * block_size + offset` holds the token at `offset` of KV block `block`, and a sequence's
block table row lists its blocks in position order (entries past its last block are never read).
Query head h reads KV head `h // (num_heads // num_kv_heads)`.

Launchers read only shapes, strides and host ints, never device values (no `.item()`), so every
launch can be captured in a CUDA graph. This module imports triton: callers check
`importlib.util.find_spec("triton")` before importing it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)  # softmax runs in base 2: exp(x) == exp2(x * LOG2E)
_PREFILL_BLOCK_M = 64  # (query token, query head) rows per prefill program
# the query, key and value tiles of one program, by the estimate rows x padded row bytes: an
# sm_90 program may have 227 KiB, and Triton's staging takes up to ~1.5x the estimate in 16 bits
_SHARED_BYTES = 160 * 1024
_MIN_SPLIT_TOKENS = 256  # a decode split shorter than this costs more to reduce than it saves
_MAX_SPLITS = 16


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        # the interpreter (triton 3.9) multiplies bf16 bit patterns as integers; bf16 products
        # are exact in float32, so the upcast changes nothing but the summation order
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _slots(table_row, pos, pos_ok, BLOCK_SIZE: tl.constexpr):
    # [N] int64 cache slot of each context position; masked positions read no table entry
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    return block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def _load_rows(cache, slots, stride_slot, head_offset, d, ok):
    # [N, D_PAD] rows of one KV head; masked rows and padded dims read as 0 (never garbage)
    return tl.load(
        cache + slots[:, None] * stride_slot + head_offset + d[None, :], mask=ok, other=0.0
    )


@triton.jit
def _load_kv_tile(
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
    kv_off_k,
    kv_off_v,
    BLOCK_SIZE: tl.constexpr,
):
    # the K and V rows [BLOCK_N, D_PAD] of context positions `pos`, through the block table;
    # V's dims past v_dim read as 0, so the output's are 0 and never stored
    slots = _slots(table, pos, pos_ok, BLOCK_SIZE)
    k = _load_rows(k_cache, slots, stride_ks, kv_off_k, d, pos_ok[:, None] & d_ok[None, :])
    v = _load_rows(v_cache, slots, stride_vs, kv_off_v, d, pos_ok[:, None] & dv_ok[None, :])
    return k, v


@triton.jit
def _softmax_step(
    q, k, v, visible, m, total, acc, qk_scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr
):
    # online softmax over one key tile. q [M, D_PAD], k/v [N, D_PAD], visible [M, N] or [1, N];
    # m [M] running max of the base-2 scores, total [M] running sum of exp2(score - m),
    # acc [M, D_PAD] float32 running sum of weighted values.
    # A row that has seen no key yet (a window starts after this tile) keeps m = -inf and sums
    # nothing: its shift is 0, so exp2(-inf - 0) gives 0 weights, never nan.
    s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - shift[:, None])
    alpha = tl.exp2(m - shift)  # rescales what was summed under the old max
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, total * alpha + tl.sum(p, 1), acc


@triton.jit
def _sink_mass(sinks, heads, heads_ok, m, HAS_SINKS: tl.constexpr):
    # exp2 of each row's sink logit (base 2, under the running max m): a sink joins the
    # softmax's denominator and adds nothing to the sum; 0 without sinks
    if HAS_SINKS:
        sink = tl.load(sinks + heads, mask=heads_ok, other=float("-inf")).to(tl.float32)
        return tl.exp2(sink * 1.4426950408889634 - m)
    else:
        return tl.zeros_like(m)


@triton.jit
def _window_start(first_query_pos, window):
    # the first key position the earliest query sees (window 0: no window, position 0)
    return tl.where(window > 0, tl.maximum(first_query_pos - window + 1, 0), 0)


@triton.jit
def _store_kv_kernel(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t)
    if slot < 0:  # a padding token (e.g. in a captured CUDA graph) is not stored
        return
    h, d = tl.arange(0, H_PAD)[:, None], tl.arange(0, D_PAD)[None, :]
    ok = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    key = tl.load(k + t * stride_kt + h * stride_kh + d, mask=ok)
    tl.store(
        k_cache + slot * stride_kcs + h * stride_kch + d, key.to(k_cache.dtype.element_ty), mask=ok
    )
    v_ok = (h < NUM_KV_HEADS) & (d < V_DIM)
    value = tl.load(v + t * stride_vt + h * stride_vh + d, mask=v_ok)
    tl.store(
        v_cache + slot * stride_vcs + h * stride_vch + d,
        value.to(v_cache.dtype.element_ty),
        mask=v_ok,
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


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write row t of k and v to slot `slot_mapping[t]` of the caches; a negative slot is skipped.

    k [T, KVH, D], v [T, KVH, Dv <= D], any row and head strides (views of a fused qkv
    output); caches [num_slots, KVH, D] and [num_slots, KVH, Dv]; slot_mapping [T] int64.
    Values are cast to the cache dtype.
    """
    _require_unit_last_stride(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if not (
        k.shape[1:] == k_cache.shape[1:]
        and v.shape[1:] == v_cache.shape[1:]
        and v.shape[:2] == k.shape[:2]
        and v.shape[2] <= k.shape[2]
    ):
        raise ValueError(
            f"shapes disagree: k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        V_DIM=v.shape[2],
        H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
    )


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
    num_heads, num_kv_heads, head_dim, v_dim = _check_paged(q, k_cache, v_cache, out, block_size)
    batch = q.shape[0]
    if batch == 0:
        return
    if num_splits is None:
        num_splits = pick_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size)
    group, d_pad = num_heads // num_kv_heads, _padded_head_dim(head_dim)
    direct = num_splits == 1
    # float32 scratch: (max, sum) per head and split, then the unnormalised outputs
    ml_shape = (0,) if direct else (2, batch, num_heads, num_splits)
    acc_shape = (0,) if direct else (batch, num_heads, num_splits, head_dim)
    part_ml = q.new_empty(ml_shape, dtype=torch.float32)
    part_acc = q.new_empty(acc_shape, dtype=torch.float32)
    tiles = _tiles(d_pad, q)
    g_pad = _rows_per_program(max(16, triton.next_power_of_2(group)), tiles["BLOCK_N"], d_pad, q)
    heads = min(group, g_pad)  # query heads per program
    chunks = triton.cdiv(group, heads)
    _decode_kernel[(batch, num_kv_heads * chunks, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        part_ml,
        part_acc,
        q if sinks is None else sinks,  # any pointer when there are none
        scale * LOG2E,
        window or 0,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEADS=heads,
        NUM_CHUNKS=chunks,
        G_PAD=g_pad,
        HEAD_DIM=head_dim,
        V_DIM=v_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        DIRECT=direct,
        HAS_SINKS=sinks is not None,
        **tiles,
        **_dot_mode(q),
    )
    if not direct:
        _reduce_splits_kernel[(batch, num_heads)](
            part_ml,
            part_acc,
            out,
            q if sinks is None else sinks,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            V_DIM=v_dim,
            D_PAD=d_pad,
            S_PAD=triton.next_power_of_2(num_splits),
            HAS_SINKS=sinks is not None,
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
    num_heads, num_kv_heads, head_dim, v_dim = _check_paged(q, k_cache, v_cache, out, block_size)
    batch = seq_lens.shape[0]
    if batch == 0 or max_query_len == 0:
        return
    group, d_pad = num_heads // num_kv_heads, _padded_head_dim(head_dim)
    tiles = _tiles(d_pad, q)
    wanted = max(_PREFILL_BLOCK_M, triton.next_power_of_2(group))
    block_m = _rows_per_program(wanted, tiles["BLOCK_N"], d_pad, q)
    heads = min(group, block_m)  # query heads per program; a wider group splits in chunks
    chunks = triton.cdiv(group, heads)
    block_q = block_m // heads  # query tokens per program; the last heads * block_q rows idle
    _prefill_kernel[(batch, triton.cdiv(max_query_len, block_q), num_kv_heads * chunks)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        q if sinks is None else sinks,
        scale * LOG2E,
        window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        HEADS=heads,
        NUM_CHUNKS=chunks,
        HEAD_DIM=head_dim,
        V_DIM=v_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        HAS_SINKS=sinks is not None,
        **tiles,
        **_dot_mode(q),
    )


def _padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16 for 16-bit inputs


def _tiles(d_pad: int, q: torch.Tensor) -> dict[str, int]:
    # keys per loop step and warps per program. Every K/V element has its own int64 pointer (the
    # slots are gathered), so wide rows need fewer keys or more warps; these keep ptxas from
    # spilling on sm_90 (checked by compiling ahead of time, not timed on a GPU). MLA's latent
    # rows (576 wide, padded to 1024) take 16 keys a step
    row_bytes = d_pad * q.element_size()
    block_n = 64 if row_bytes <= 256 else 32 if row_bytes <= 1024 else 16
    return {"BLOCK_N": block_n, "num_warps": 4 if row_bytes < 128 else 8}


def _rows_per_program(wanted: int, block_n: int, d_pad: int, q: torch.Tensor) -> int:
    """Query rows (token x head) one program holds: `wanted`, halved while its query tile and
    the key and value tiles would overflow the shared-memory budget, never under 16 (tl.dot's
    least M). The first H100 run failed MLA's prefill here: 64 rows of 1024 float32 lanes asked
    for 520 KiB against the 227 KiB an sm_90 program may have."""
    rows, row_bytes = wanted, d_pad * q.element_size()
    while rows > 16 and (rows + 2 * block_n) * row_bytes > _SHARED_BYTES:
        rows //= 2
    return rows


def _dot_mode(q: torch.Tensor) -> dict[str, object]:
    # float32 inputs get exact products (tf32 would cost ~1e-3); 16-bit inputs ignore PRECISION.
    # CPU tensors mean the interpreter, whose bf16 tl.dot is broken (see _dot).
    return {
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "UPCAST": q.dtype == torch.bfloat16 and q.device.type == "cpu",
    }


def _check_paged(q, k_cache, v_cache, out, block_size: int) -> tuple[int, int, int, int]:
    """Shapes of a paged attention call -> (num_heads, num_kv_heads, head_dim, v_dim)."""
    _require_unit_last_stride(q=q, k_cache=k_cache, v_cache=v_cache, out=out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    v_dim = v_cache.shape[2]
    if (
        k_cache.shape[2] != head_dim
        or v_cache.shape[:2] != k_cache.shape[:2]
        or v_dim > head_dim
        or out.shape != (*q.shape[:2], v_dim)
    ):
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
            f"v_cache {tuple(v_cache.shape)}, out {tuple(out.shape)}"
        )
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"q, k_cache and v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    return num_heads, num_kv_heads, head_dim, v_dim


def _require_unit_last_stride(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dim() != 3 or (t.shape[2] > 1 and t.stride(2) != 1):
            raise ValueError(
                f"{name} must be [rows, heads, head_dim] with head_dim contiguous, "
                f"got shape {tuple(t.shape)} strides {t.stride()}"
            )
