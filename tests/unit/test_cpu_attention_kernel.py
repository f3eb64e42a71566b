"""The C paged-attention kernel (kernels/attention/cpu_kernel.py) against naive attention.

The reference below never looks at the paged cache: it attends each query over its sequence's
own contiguous K/V in float64, head by head. The kernel reads the same K/V through random,
non-contiguous block tables from caches whose other slots hold NaN, so reading a slot it should
not (past a sequence's end, an unowned block) shows up as NaN in the output.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import pytest
import torch
from raylane.kernels import cpu_build
from raylane.kernels.attention import cpu_kernel

if not cpu_kernel.is_available():
    pytest.skip(
        "the CPU paged-attention kernel could not be built (no C compiler?)",
        allow_module_level=True,
    )

SCALE = 0.37
TABLE_PAD = 1 << 30  # block table entries past a sequence's blocks: never read, or it crashes


@dataclass
class Seq:
    q_len: int
    ctx: int  # context length after this step; the queries are its last q_len positions
    table: list[int]
    q: torch.Tensor  # [q_len, H, D]
    k: torch.Tensor  # [ctx, KVH, D] the whole context, in position order
    v: torch.Tensor


@dataclass
class Batch:
    seqs: list[Seq]
    q: torch.Tensor  # [T, H, D], a view into a wider fused-qkv-like tensor
    k_cache: torch.Tensor  # [num_blocks * block_size, KVH, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    block_size: int

    def run(self, num_threads: int | None = None, window=None, sinks=None) -> torch.Tensor:
        out = torch.full_like(self.q, float("nan"))
        return cpu_kernel.paged_attention(
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            SCALE,
            out,
            block_size=self.block_size,
            num_threads=num_threads,
            window=window,
            sinks=sinks,
        )

    def forget_before_windows(self, window: int) -> None:
        """Point every table entry of a block wholly before its sequence's first query's window
        at a block nobody owns (NaN): a sliding window's freed blocks may hold anything."""
        num_blocks = self.k_cache.shape[0] // self.block_size
        spare = min(set(range(num_blocks)) - {b for s in self.seqs for b in s.table})
        for i, s in enumerate(self.seqs):
            first = s.ctx - s.q_len - window + 1  # the first query's first visible key
            self.block_tables[i, : max(0, first) // self.block_size] = spare


def make_batch(
    shapes: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    key_growth: float = 0.0,
) -> Batch:
    """Random data for (q_len, ctx) pairs, rounded to `dtype` before anything else sees it.

    `key_growth` scales the key at position p by 1 + key_growth * p, so later scores dwarf
    earlier ones."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-ctx // block_size) for _, ctx in shapes]
    num_blocks = sum(need) + 3  # a few blocks nobody owns
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    slots = num_blocks * block_size
    k_cache = torch.full((slots, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full((slots, kv_heads, head_dim), float("nan"), dtype=dtype)
    width = max(need) + 2
    tables = torch.full((len(shapes), width), TABLE_PAD, dtype=torch.int32)
    seqs = []
    for i, ((q_len, ctx), n) in enumerate(zip(shapes, need)):
        table, pool = pool[:n], pool[n:]
        tables[i, :n] = torch.tensor(table, dtype=torch.int32)
        k, v = (torch.randn(ctx, kv_heads, head_dim, generator=gen) for _ in range(2))
        k = (k * (1 + key_growth * torch.arange(ctx)).view(-1, 1, 1)).to(dtype)
        v = v.to(dtype)
        q = torch.randn(q_len, heads, head_dim, generator=gen).to(dtype)
        for pos in range(ctx):  # the caller has stored every position, this step's included
            slot = table[pos // block_size] * block_size + pos % block_size
            k_cache[slot], v_cache[slot] = k[pos], v[pos]
        seqs.append(Seq(q_len, ctx, table, q, k, v))
    # q as a slice of a fused [T, (H + 2 KVH) * D] projection: rows are not H * D apart
    flat = torch.cat([s.q for s in seqs]).view(-1, heads * head_dim)
    fused = torch.cat([flat, torch.zeros(flat.shape[0], 2 * kv_heads * head_dim, dtype=dtype)], 1)
    q = fused[:, : heads * head_dim].view(-1, heads, head_dim)
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.q_len)
    return Batch(
        seqs,
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor([ctx for _, ctx in shapes], dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        block_size,
    )


def naive_attention(s: Seq, window=None, sinks=None) -> torch.Tensor:
    """softmax(q k^T * scale) v for each query over positions <= its own (its last `window`
    with a window; a sink logit per head joining the denominator), head by head."""
    q, k, v = (t.double() for t in (s.q, s.k, s.v))
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for i in range(s.q_len):
        pos = s.ctx - s.q_len + i
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(heads):
            kv = h // (heads // kv_heads)  # GQA: consecutive query heads share a KV head
            logits = k[lo : pos + 1, kv] @ q[i, h] * SCALE
            if sinks is not None:
                logits = torch.cat([logits, sinks[h : h + 1].double()])
            weights = torch.softmax(logits, dim=0)[: pos + 1 - lo]
            out[i, h] = weights @ v[lo : pos + 1, kv]
    return out


def assert_matches_naive(
    batch: Batch, out: torch.Tensor, atol: float, rtol: float, window=None, sinks=None
) -> None:
    start = 0
    for s in batch.seqs:
        want = naive_attention(s, window, sinks)
        torch.testing.assert_close(
            out[start : start + s.q_len].double(), want, atol=atol, rtol=rtol
        )
        start += s.q_len


CASES = {
    # contexts of 1 token, one block exactly, block boundaries +-1, a long one
    "decodes": [(1, 1), (1, 15), (1, 16), (1, 17), (1, 31), (1, 32), (1, 33), (1, 700)],
    "chunks_over_context": [(5, 21), (16, 48), (40, 100), (33, 700)],
    "fresh_prefill": [(37, 37)],
    # prefill chunks, decodes and sequences with no queries this step (q_len 0), interleaved
    "mixed": [(7, 7), (0, 9), (5, 21), (1, 3), (0, 1), (2, 4), (1, 20), (1, 17), (0, 40)],
}
GQA = [(4, 4), (9, 3), (8, 2)]  # (H, KVH): groups of 1, 3 and 4 query heads


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_float32_matches_naive(case, heads, kv_heads):
    batch = make_batch(CASES[case], heads, kv_heads, head_dim=64, block_size=16, seed=len(case))
    assert_matches_naive(batch, batch.run(), atol=1e-5, rtol=1e-5)


# sliding window (gpt-oss, Gemma 3): windows shorter than a chunk of keys, across chunks and
# blocks, longer than some contexts; rows of one prefill tile whose windows start in different
# chunks; sinks with and without a window, some large enough to take most of the mass
@pytest.mark.parametrize("case", ["decodes", "chunks_over_context", "mixed"])
@pytest.mark.parametrize("window,sinks", [(5, False), (40, False), (None, True), (19, True)])
def test_window_and_sinks_match_naive(case, window, sinks):
    heads, kv_heads = 8, 2
    batch = make_batch(CASES[case], heads, kv_heads, head_dim=64, block_size=16, seed=len(case))
    if window is not None:
        batch.forget_before_windows(window)
    sink = torch.linspace(-3.0, 12.0, heads) if sinks else None
    out = batch.run(window=window, sinks=sink)
    assert_matches_naive(batch, out, atol=1e-5, rtol=1e-5, window=window, sinks=sink)


def test_window_and_sinks_in_bfloat16():
    batch = make_batch(CASES["mixed"], 9, 3, 40, 16, torch.bfloat16, seed=4)
    batch.forget_before_windows(7)
    sink = torch.linspace(-1.0, 2.0, 9)
    out = batch.run(window=7, sinks=sink)
    assert_matches_naive(batch, out, atol=1e-5, rtol=2**-8, window=7, sinks=sink)


@pytest.mark.parametrize("head_dim", [24, 40, 80, 128])
@pytest.mark.parametrize("block_size", [16, 7])  # 7: chunks of keys straddle blocks
def test_head_dims_and_block_sizes(head_dim, block_size):
    batch = make_batch(CASES["mixed"] + [(1, 70), (9, 70)], 9, 3, head_dim, block_size, seed=1)
    assert_matches_naive(batch, batch.run(), atol=1e-5, rtol=1e-5)


# Half-precision inputs: the reference runs in float64 on the very same (rounded) values, and
# the kernel computes in float32, so the only sizeable error is rounding the output to the
# dtype: at most half an ulp, 2^-9 relative for bfloat16 (8 significant bits) and 2^-11 for
# float16 (11 bits). rtol is twice that; atol only covers float32 noise around zero.
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.bfloat16, 2**-8), (torch.float16, 2**-10)])
@pytest.mark.parametrize("case", ["decodes", "chunks_over_context", "mixed"])
def test_half_precision_matches_naive(dtype, rtol, case):
    batch = make_batch(CASES[case], 9, 3, head_dim=64, block_size=16, dtype=dtype, seed=7)
    out = batch.run()
    assert out.dtype == dtype
    assert_matches_naive(batch, out, atol=1e-5, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_that_keep_growing(dtype):
    # the running max keeps being beaten, by far (scores reach ~650): every rescale of the
    # accumulators is exercised, and nothing may overflow. Float32 itself carries a score of
    # 650 only to ~650 * 2^-24 * sqrt(D) ~ 3e-4, and that error lands in the weights: torch's
    # own float32 attention is 4e-5 off here, hence 2e-4 (bfloat16: output rounding, as above)
    batch = make_batch([(1, 300), (20, 300), (1, 40)], 8, 2, 64, 16, dtype, key_growth=0.2)
    tol = 2e-4 if dtype == torch.float32 else 2**-8
    assert_matches_naive(batch, batch.run(), atol=tol, rtol=tol)


def test_threads_do_not_change_the_result():
    # every query vector is computed whole by one thread, in a fixed order. With one thread the
    # decodes take both kv heads per work item; with 16 there are too few items for that and
    # each kv head is an item of its own: the same arithmetic either way, bit for bit
    batch = make_batch(CASES["mixed"] + CASES["chunks_over_context"], 8, 2, 64, 16, seed=3)
    torch.testing.assert_close(batch.run(num_threads=1), batch.run(num_threads=16), atol=0, rtol=0)


def test_rows_past_the_last_sequence_are_left_alone():
    # a batch padded to a fixed token count (as for a captured graph): rows past
    # query_start_loc[B] belong to nobody, and sequences with q_len 0 own no rows at all
    batch = make_batch([(0, 5), (2, 6), (0, 1)], 4, 2, 64, 16)
    q = torch.cat([batch.q, torch.randn(3, 4, 64)])
    out = torch.full_like(q, 7.0)
    cpu_kernel.paged_attention(
        q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        SCALE,
        out,
        block_size=16,
    )
    assert_matches_naive(batch, out[:2], atol=1e-5, rtol=1e-5)
    assert (out[2:] == 7.0).all()
    nobody = make_batch([(0, 3), (0, 20)], 4, 2, 64, 16)
    assert nobody.run().shape == (0, 4, 64)


def test_writes_into_a_strided_out():
    batch = make_batch(CASES["mixed"], 9, 3, 64, 16)
    wide = torch.zeros(batch.q.shape[0], 9, 2 * 64)
    out = wide[:, :, 64:]  # head stride 128, row stride 9 * 128
    cpu_kernel.paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        SCALE,
        out,
        block_size=16,
    )
    assert_matches_naive(batch, out, atol=1e-5, rtol=1e-5)
    assert not wide[:, :, :64].any()


@pytest.mark.parametrize(
    ("name", "bad", "match"),
    [
        ("block_tables", lambda b: b.block_tables.clone().fill_(10**6), "block_tables"),
        ("block_tables", lambda b: b.block_tables[:, :1], "block_tables"),  # too narrow
        ("seq_lens", lambda b: b.seq_lens.clone().fill_(1), "seq_lens"),  # fewer keys than queries
        ("query_start_loc", lambda b: b.query_start_loc.flip(0), "query_start_loc"),
        ("seq_lens", lambda b: b.seq_lens.long(), "int32"),
        ("out", lambda b: torch.empty_like(b.q, dtype=torch.float64), "dtype"),
        ("q", lambda b: b.q.transpose(1, 2), "contiguous D"),
        ("k_cache", lambda b: b.k_cache[::2], "contiguous"),
    ],
)
def test_bad_arguments_raise_value_error(name, bad, match):
    b = make_batch([(2, 20), (1, 40)], 4, 2, 64, 16)
    args = {
        "q": b.q,
        "k_cache": b.k_cache,
        "v_cache": b.v_cache,
        "block_tables": b.block_tables,
        "seq_lens": b.seq_lens,
        "query_start_loc": b.query_start_loc,
        "scale": SCALE,
        "out": torch.empty_like(b.q),
    }
    with pytest.raises(ValueError, match=match):
        cpu_kernel.paged_attention(**(args | {name: bad(b)}), block_size=16)


def test_builds_once_into_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLANE_KERNEL_CACHE", str(tmp_path))
    path = cpu_build._build(cpu_kernel._SOURCE)
    assert path.parent.parent == tmp_path and path.name == "paged_attention.so"
    built = path.stat().st_mtime_ns
    assert cpu_build._build(cpu_kernel._SOURCE) == path and path.stat().st_mtime_ns == built
    assert [p.name for p in path.parent.iterdir()] == ["paged_attention.so"]  # no temp left


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flag")
def test_the_8_lane_build_for_cpus_without_avx512(tmp_path, monkeypatch):
    # the kernel works on 16 keys at a time with AVX-512 and 8 without; this machine may only
    # ever build the first, so build the second explicitly
    monkeypatch.setenv("RAYLANE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_FLAGS", [*cpu_build._FLAGS, "-mno-avx512f"])
    cpu_kernel._library.cache_clear()
    try:
        assert cpu_kernel.is_available() and str(tmp_path) in cpu_kernel._library()._name
        for dtype, head_dim in [(torch.float32, 64), (torch.float32, 24), (torch.bfloat16, 40)]:
            batch = make_batch(CASES["mixed"] + [(3, 50)], 8, 2, head_dim, 16, dtype, seed=5)
            tol = 1e-5 if dtype == torch.float32 else 2**-8
            assert_matches_naive(batch, batch.run(), atol=1e-5, rtol=tol)
            batch.forget_before_windows(9)  # and with a window and sinks
            sink = torch.linspace(-2.0, 3.0, 8)
            out = batch.run(window=9, sinks=sink)
            assert_matches_naive(batch, out, atol=1e-5, rtol=tol, window=9, sinks=sink)
    finally:
        cpu_kernel._library.cache_clear()  # the next caller loads the native build again
