"""Triton paged attention kernels (under the CPU interpreter) against naive causal attention."""

from __future__ import annotations

import os

# before triton is imported (tests/conftest.py sets it already, for the whole session)
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from raylane.kernels.attention.triton_kernels import (  # noqa: E402
    decode_attention,
    pick_num_splits,
    prefill_attention,
    store_kv,
)

SCALE = 0.37
GARBAGE_BLOCK = 10**6  # table entries past a sequence's blocks: out of range if ever read
# 16-bit inputs are rounded before the double reference sees them, so what remains is the
# kernel's own rounding: softmax weights cast to the input dtype for the PV product and the output
# rounded to it, each a relative 2^-9 (bf16) or 2^-12 (fp16) of values |out| <= ~3 (seen: at
# most 0.015 and 1e-3). float32 differs from double only in summation order (seen: 1.5e-6).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


class Paged:
    """Random per-sequence K/V written into a NaN-filled paged cache via random block tables."""

    def __init__(
        self,
        ctx_lens: list[int],
        kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        gen: torch.Generator,
        width: int | None = None,
    ):
        need = [-(-n // block_size) for n in ctx_lens]
        num_blocks = sum(need) + 3  # a few blocks nobody owns
        pool = torch.randperm(num_blocks, generator=gen).tolist()
        width = width or max(need) + 1  # every row has garbage past its blocks
        self.tables = torch.full((len(ctx_lens), width), GARBAGE_BLOCK, dtype=torch.int32)
        shape = (num_blocks * block_size, kv_heads, head_dim)
        # NaN where unwritten: any read of a slot outside the context poisons the output
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.k, self.v = [], []
        for i, n in enumerate(ctx_lens):
            table, pool = pool[: need[i]], pool[need[i] :]
            self.tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
            k, v = (torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
            for pos in range(n):
                slot = table[pos // block_size] * block_size + pos % block_size
                self.k_cache[slot], self.v_cache[slot] = k[pos], v[pos]
            self.k.append(k)
            self.v.append(v)
        self.seq_lens = torch.tensor(ctx_lens, dtype=torch.int32)
        self.spare = pool  # blocks nobody owns: NaN in every slot

    def forget_before(self, first_pos: list[int], block_size: int) -> None:
        """Point each row's blocks wholly before `first_pos[i]` at a NaN block, as a sliding
        window's freed blocks may be reused: a kernel that reads one poisons its output."""
        for i, first in enumerate(first_pos):
            self.tables[i, : max(0, first) // block_size] = self.spare[0]


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window=None, sinks=None
) -> torch.Tensor:
    """q [n, H, D] are the last n positions of a context with keys/values k, v [ctx, KVH, D].
    A window keeps each query's last `window` keys; a sink logit joins each denominator."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        pos = k.shape[0] - q.shape[0] + i
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(q.shape[1]):
            kv = h // group  # GQA: consecutive query heads share a KV head
            logits = k[lo : pos + 1, kv] @ q[i, h] * SCALE
            if sinks is not None:
                logits = torch.cat([logits, sinks[h : h + 1].double()])
            weights = torch.softmax(logits, dim=0)[: pos + 1 - lo]
            out[i, h] = weights @ v[lo : pos + 1, kv]
    return out


def strided_q(num_tokens: int, heads: int, head_dim: int, dtype, gen) -> torch.Tensor:
    """[T, H, D] queries as a view of a fused qkv output (row stride > H * D)."""
    fused = torch.randn(num_tokens, (heads + 3) * head_dim, generator=gen).to(dtype)
    return fused[:, head_dim : (heads + 1) * head_dim].view(num_tokens, heads, head_dim)


def run_decode(
    ctx_lens,
    heads,
    kv_heads,
    head_dim,
    block_size,
    dtype=torch.float32,
    num_splits=None,
    seed=0,
    width=None,
):
    gen = torch.Generator().manual_seed(seed)
    cache = Paged(ctx_lens, kv_heads, head_dim, block_size, dtype, gen, width)
    q = strided_q(len(ctx_lens), heads, head_dim, dtype, gen)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.tables,
        cache.seq_lens,
        SCALE,
        block_size,
        out,
        num_splits=num_splits,
    )
    want = torch.cat(
        [naive_attention(q[i : i + 1], cache.k[i], cache.v[i]) for i in range(len(ctx_lens))]
    )
    return out, want


def assert_matches(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


DECODE_CASES = {
    # name: (ctx_lens, heads, kv_heads, head_dim, block_size, num_splits)
    "one_token": ([1], 2, 2, 24, 4, None),
    "exactly_one_block": ([8, 8], 3, 1, 40, 8, None),
    "block_boundaries": ([3, 4, 5, 7, 8, 9], 4, 1, 24, 4, None),
    "gqa3_odd_dim": ([13, 6], 6, 2, 40, 4, None),
    "gqa4_multi_tile": ([70, 65, 64], 4, 1, 32, 8, 1),  # > 1 key tile per program
    "split_k": ([70, 33, 1, 9], 4, 2, 24, 4, 4),  # split 1..3 of the 1-token context are empty
    "split_k_uneven": ([67, 5], 3, 3, 40, 8, 3),
    "block_size_16": ([17, 31], 4, 2, 64, 16, 2),
    "block_larger_than_key_tile": ([70, 3], 2, 1, 24, 128, None),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_matches_naive_attention(case):
    ctx_lens, heads, kv_heads, head_dim, block_size, num_splits = DECODE_CASES[case]
    out, want = run_decode(
        ctx_lens, heads, kv_heads, head_dim, block_size, num_splits=num_splits, seed=len(case)
    )
    assert_matches(out, want, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_16_bit(dtype, num_splits):
    out, want = run_decode([9, 40, 1], 6, 2, 40, 8, dtype, num_splits, seed=7)
    assert_matches(out, want, dtype)


def test_decode_default_splits_follow_the_table_width():
    # 200 columns * block 4 = 800 possible keys -> pick_num_splits gives 4; the real contexts are
    # short, so most splits are empty and the garbage past each row's blocks is never read
    assert pick_num_splits(batch=2, num_kv_heads=1, max_seq_len=800) == 4
    out, want = run_decode([30, 2], 3, 1, 24, 4, seed=5, width=200)
    assert_matches(out, want, torch.float32)


def test_decode_split_count_does_not_change_the_result():
    outs = [run_decode([45, 12], 4, 2, 24, 4, num_splits=s, seed=3)[0] for s in (1, 2, 5)]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(outs[2], outs[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_of_an_empty_context_writes_zeros(num_splits):
    # CUDA graph padding rows carry seq_len 0: their output is ignored but must not be nan
    gen = torch.Generator().manual_seed(0)
    cache = Paged([5, 5], 1, 16, 4, torch.float32, gen)
    cache.seq_lens[1] = 0
    q = torch.randn(2, 2, 16, generator=gen)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.tables,
        cache.seq_lens,
        SCALE,
        4,
        out,
        num_splits=num_splits,
    )
    assert torch.equal(out[1], torch.zeros(2, 16))
    assert_matches(out[:1], naive_attention(q[:1], cache.k[0], cache.v[0]), torch.float32)


def test_pick_num_splits():
    assert pick_num_splits(batch=1, num_kv_heads=8, max_seq_len=100) == 1  # too short to split
    assert pick_num_splits(batch=1, num_kv_heads=8, max_seq_len=4096) == 16
    assert pick_num_splits(batch=4, num_kv_heads=8, max_seq_len=4096) == 9  # fills 2 * 132 SMs
    assert pick_num_splits(batch=64, num_kv_heads=8, max_seq_len=32768) == 1  # already full
    assert pick_num_splits(batch=1, num_kv_heads=1, max_seq_len=10**6) == 16  # capped


def run_prefill(
    chunks, heads, kv_heads, head_dim, block_size, dtype=torch.float32, seed=0, max_query_len=None
):
    """chunks: (q_len, ctx_len) per sequence; the chunk is the last q_len of ctx_len positions."""
    gen = torch.Generator().manual_seed(seed)
    cache = Paged([ctx for _, ctx in chunks], kv_heads, head_dim, block_size, dtype, gen)
    q_lens = [n for n, _ in chunks]
    q = strided_q(sum(q_lens), heads, head_dim, dtype, gen)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    out = torch.full_like(q, float("nan"))
    prefill_attention(
        q,
        cache.k_cache,
        cache.v_cache,
        cache.tables,
        cache.seq_lens,
        qsl,
        max_query_len or max(q_lens),
        SCALE,
        block_size,
        out,
    )
    want = torch.cat(
        [
            naive_attention(q[qsl[i] : qsl[i + 1]], cache.k[i], cache.v[i])
            for i in range(len(chunks))
        ]
    )
    return out, want


PREFILL_CASES = {
    # name: (chunks as (q_len, ctx_len), heads, kv_heads, head_dim, block_size)
    "fresh_prompt": ([(7, 7)], 2, 2, 24, 4),
    "one_token_prompt": ([(1, 1)], 2, 1, 24, 4),
    "chunk_after_cached_context": ([(5, 21)], 4, 1, 40, 4),
    "single_token_chunk": ([(1, 6)], 3, 1, 24, 8),
    "block_boundaries": ([(4, 4), (3, 8), (5, 9), (2, 7)], 4, 2, 24, 4),
    "varlen_gqa3": ([(7, 7), (5, 21), (2, 4), (11, 11)], 6, 2, 40, 8),
    # group 4 packs 16 tokens per program: 20 queries span two query tiles, 70 keys two key tiles
    "gqa4_multi_tile": ([(20, 70), (17, 17)], 4, 1, 32, 8),
    "long_fresh_prompt": ([(70, 70)], 2, 2, 24, 16),  # group 1: 64 tokens per query tile
    "block_larger_than_key_tile": ([(6, 70), (3, 3)], 2, 1, 24, 128),
}


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_matches_naive_causal_attention(case):
    chunks, heads, kv_heads, head_dim, block_size = PREFILL_CASES[case]
    out, want = run_prefill(chunks, heads, kv_heads, head_dim, block_size, seed=len(case))
    assert_matches(out, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_16_bit(dtype):
    out, want = run_prefill([(7, 7), (5, 21), (1, 9)], 6, 2, 40, 4, dtype, seed=11)
    assert_matches(out, want, dtype)


def test_prefill_grid_larger_than_the_longest_chunk():
    # a max_query_len from a padded bucket only adds programs that exit at once
    out, want = run_prefill([(3, 10), (2, 2)], 2, 1, 24, 4, seed=2, max_query_len=200)
    assert_matches(out, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_strided_rows_to_their_slots(dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, head_dim = 5, 3, 3, 40
    # [T, (H + 2 KVH) * D] fused projection; k and v are strided views into it
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    k = fused[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = fused[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    k_cache = torch.full((16, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.tensor([9, 2, -1, 15, 0])  # -1: a padding token, not stored
    store_kv(k, v, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot], k[t]) and torch.equal(v_cache[slot], v[t])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[[9, 2, 15, 0]] = False
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()


def test_bad_shapes_raise_value_errors():
    q = torch.zeros(2, 3, 16)
    cache = torch.zeros(8, 2, 16)
    tables, lens = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode_attention(q, cache, cache, tables, lens, SCALE, 4, torch.empty_like(q))
    q = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q, cache, cache, tables, lens, SCALE, 6, torch.empty_like(q))
    with pytest.raises(ValueError, match="dtypes differ"):
        decode_attention(q.bfloat16(), cache, cache, tables, lens, SCALE, 4, q.bfloat16())
    with pytest.raises(ValueError, match="head_dim contiguous"):
        decode_attention(
            q.transpose(1, 2).contiguous().transpose(1, 2),
            cache,
            cache,
            tables,
            lens,
            SCALE,
            4,
            torch.empty_like(q),
        )
    with pytest.raises(ValueError, match="shapes disagree"):
        store_kv(q, q, cache, cache, torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,sinks", [(None, False), (5, True)])
def test_backend_equals_the_torch_reference_on_a_mixed_step(dtype, window, sinks):
    """The backend API over one step's metadata (prefills, one after cached context, then
    decodes) against the torch reference backend: the same outputs and the same cache."""
    from raylane.kernels.attention.builder import SeqSlice, build_metadata
    from raylane.kernels.attention.torch_ref import TorchAttention
    from raylane.kernels.attention.triton_backend import TritonAttention

    gen = torch.Generator().manual_seed(11)
    block_size, heads, kv_heads, head_dim = 4, 6, 2, 24
    shapes = [(7, 7), (3, 13), (1, 9), (1, 4), (1, 17)]  # (new tokens, context after)
    pool = torch.randperm(40, generator=gen).tolist()
    seqs = []
    for num_new, ctx in shapes:
        used = -(-ctx // block_size)
        seqs.append(SeqSlice(num_new, ctx, pool[:used]))
        pool = pool[used:]
    meta = {name: build_metadata(seqs[:2], seqs[2:], block_size) for name in ("a", "b")}
    tokens = sum(s.num_new for s in seqs)
    # a fused qkv output: q, k, v are strided views, as the models pass them
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    cache = torch.randn(2, 40 * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    ref_k, ref_v = cache[0].clone(), cache[1].clone()
    got_k, got_v = cache[0].clone(), cache[1].clone()
    sink = _sinks(heads, 3) if sinks else None
    ref = TorchAttention().forward(q, k, v, ref_k, ref_v, meta["a"], SCALE, window, sink)
    got = TritonAttention().forward(q, k, v, got_k, got_v, meta["b"], SCALE, window, sink)
    torch.testing.assert_close(got_k, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(got_v, ref_v, atol=0, rtol=0)
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


# --- sliding window and sinks (gpt-oss, Gemma 3) ----------------------------------------------


def _sinks(heads: int, seed: int) -> torch.Tensor:
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2


WINDOWED_DECODE = {
    # name: (ctx_lens, heads, kv_heads, head_dim, block_size, num_splits, window, sinks)
    "window": ([20, 7, 1, 9], 4, 2, 24, 4, 1, 6, False),
    "window_split_k": ([70, 33, 3], 4, 1, 32, 8, 3, 40, False),
    "sinks": ([13, 1, 6], 6, 2, 40, 4, 1, None, True),
    "sinks_split_k": ([70, 9], 3, 3, 24, 4, 4, None, True),
    "window_and_sinks": ([70, 17, 4], 4, 2, 24, 4, 2, 8, True),
}


@pytest.mark.parametrize("case", list(WINDOWED_DECODE))
def test_decode_with_window_and_sinks_matches_naive(case):
    ctx_lens, heads, kv_heads, head_dim, block_size, splits, window, sinks = WINDOWED_DECODE[case]
    gen = torch.Generator().manual_seed(len(case))
    cache = Paged(ctx_lens, kv_heads, head_dim, block_size, torch.float32, gen)
    if window is not None:  # the query sits at n - 1 and sees from n - window on
        cache.forget_before([n - window for n in ctx_lens], block_size)
    q = strided_q(len(ctx_lens), heads, head_dim, torch.float32, gen)
    sink = _sinks(heads, len(case)) if sinks else None
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q, cache.k_cache, cache.v_cache, cache.tables, cache.seq_lens, SCALE, block_size, out,
        num_splits=splits, window=window, sinks=sink,
    )  # fmt: skip
    want = torch.cat(
        [
            naive_attention(q[i : i + 1], cache.k[i], cache.v[i], window, sink)
            for i in range(len(ctx_lens))
        ]
    )
    assert_matches(out, want, torch.float32)


WINDOWED_PREFILL = {
    # name: (chunks as (q_len, ctx_len), heads, kv_heads, head_dim, block_size, window, sinks)
    "window_over_cached_context": ([(5, 21), (7, 7), (2, 9)], 4, 2, 24, 4, 6, False),
    "sinks": ([(7, 7), (5, 21)], 6, 2, 40, 8, None, True),
    "window_and_sinks_gqa4": ([(20, 70), (17, 17)], 4, 1, 32, 8, 8, True),
    # 32-key tiles under 64-query tiles: later rows see no key in the first tile they scan
    "rows_with_an_empty_first_tile": ([(70, 75)], 2, 2, 128, 16, 3, True),
}


@pytest.mark.parametrize("case", list(WINDOWED_PREFILL))
def test_prefill_with_window_and_sinks_matches_naive(case):
    chunks, heads, kv_heads, head_dim, block_size, window, sinks = WINDOWED_PREFILL[case]
    gen = torch.Generator().manual_seed(len(case))
    cache = Paged([ctx for _, ctx in chunks], kv_heads, head_dim, block_size, torch.float32, gen)
    if window is not None:  # the chunk's first query sits at ctx - q_len
        cache.forget_before([ctx - n - window + 1 for n, ctx in chunks], block_size)
    q_lens = [n for n, _ in chunks]
    q = strided_q(sum(q_lens), heads, head_dim, torch.float32, gen)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    sink = _sinks(heads, len(case)) if sinks else None
    out = torch.full_like(q, float("nan"))
    prefill_attention(
        q, cache.k_cache, cache.v_cache, cache.tables, cache.seq_lens, qsl, max(q_lens), SCALE,
        block_size, out, window=window, sinks=sink,
    )  # fmt: skip
    want = torch.cat(
        [
            naive_attention(q[qsl[i] : qsl[i + 1]], cache.k[i], cache.v[i], window, sink)
            for i in range(len(chunks))
        ]
    )
    assert_matches(out, want, torch.float32)
