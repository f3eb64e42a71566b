"""The batch-invariant kernels, measured the way kernels/batch_invariant/__init__.py says: a row's
result alone equals that row's result among others (==), at any row count and position, and the
kernels still compute what they name (against a float64 reference, within float tolerance).

Activations are heavy-tailed on purpose: random normal rows have dot products that sum exactly
in float32, which hides a GEMV rounding otherwise than a GEMM.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from raylane.kernels.attention import cpu_kernel
from raylane.kernels.batch_invariant import batch_invariant_backend, grouped_linear, padded_linear
from raylane.kernels.batch_invariant.attention import invariant_attention, paged, reference
from raylane.kernels.batch_invariant.elementwise import silu as invariant_silu

DTYPES = [torch.float32, torch.bfloat16]


def _heavy(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.exp(1.5 * torch.randn(*shape, generator=gen))
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_linear_gives_a_row_the_same_bits_at_any_count_and_position(dtype):
    w = _heavy(384, 256, dtype=dtype, seed=1) / 16
    x = _heavy(80, 256, dtype=dtype)
    alone = padded_linear(x[:1], w)[0]
    for m, pos in ((2, 1), (5, 4), (16, 9), (17, 16), (33, 20), (80, 79)):
        rows = torch.cat([x[1 : pos + 1], x[:1], x[pos + 1 : m]])
        assert torch.equal(padded_linear(rows, w)[pos], alone), (m, pos)
    exact = x.double() @ w.double().t()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(padded_linear(x, w).double(), exact, rtol=tol, atol=tol * 10)


def test_plain_float32_linear_is_not_row_invariant():
    """What the padding is for: without it the same row rounds otherwise at another M."""
    w = _heavy(384, 256, dtype=torch.float32, seed=1) / 16
    x = _heavy(80, 256, dtype=torch.float32)
    alone = F.linear(x[:1], w)[0]
    assert any(not torch.equal(F.linear(x[:m], w)[0], alone) for m in (2, 5, 16, 33, 80))


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_linear_is_each_experts_linear(dtype):
    w = _heavy(4, 48, 32, dtype=dtype, seed=2) / 8  # [E, out, in]
    a = _heavy(21, 32, dtype=dtype)
    ends = torch.tensor([5, 5, 17, 21], dtype=torch.int32)  # expert 1 has no rows
    got = grouped_linear(a, w, ends)
    starts = [0, 5, 5, 17]
    for e, (s, t) in enumerate(zip(starts, ends.tolist())):
        for r in range(s, t):  # each row as if it were its expert's only row
            assert torch.equal(got[r], padded_linear(a[r : r + 1], w[e])[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_c_attention_kernel_reduces_a_row_alike_in_prefill_decode_chunk_and_batch(dtype):
    h, kvh, d, bs, n = 6, 2, 32, 16, 45
    k_cache = _heavy(8 * bs, kvh, d, dtype=dtype, seed=3)
    v_cache = _heavy(8 * bs, kvh, d, dtype=dtype, seed=4)
    q = _heavy(n, h, d, dtype=dtype, seed=5)
    own = torch.arange(0, 3, dtype=torch.int32)  # blocks 0-2 hold the sequence
    other = torch.arange(4, 7, dtype=torch.int32)

    def run(rows, starts, lens, tables):
        out = rows.new_empty(rows.shape[0], h, d)
        return cpu_kernel.paged_attention(
            rows, k_cache, v_cache, torch.stack(tables),
            torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
            d**-0.5, out, block_size=bs,
        )  # fmt: skip

    prefill = run(q, [0, n], [n], [own])
    assert torch.equal(run(q[n - 1 :], [0, 1], [n], [own])[0], prefill[n - 1])  # a decode row
    assert torch.equal(run(q[30:], [0, n - 30], [n], [own]), prefill[30:])  # a later chunk
    mixed = run(torch.cat([q[:7], q[40:]]), [0, 7, 12], [20, n], [other, own])
    assert torch.equal(mixed[7:], prefill[40:])  # beside another sequence's rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_aligned_windows_reduce_a_row_alike_at_any_split_and_never_read_freed_blocks(dtype):
    h, kvh, d, bs, n, window = 4, 2, 24, 4, 45, 13
    k_cache = _heavy(16 * bs, kvh, d, dtype=dtype, seed=3)
    v_cache = _heavy(16 * bs, kvh, d, dtype=dtype, seed=4)
    q = _heavy(n, h, d, dtype=dtype, seed=5)
    table = torch.arange(1, 13, dtype=torch.int32)  # positions 0..47 in blocks 1..12

    def run(lo: int, hi: int, aligned: bool = True) -> torch.Tensor:
        """Rows lo..hi - 1 as one chunk of a prefill with positions 0..lo - 1 cached, the blocks
        wholly before row lo's window freed (NaN: anything read from them spreads)."""
        keys, values = k_cache.clone(), v_cache.clone()
        freed = table[: max(0, lo - window + 1) // bs].long()
        for cache in (keys, values):
            cache.view(16, bs, kvh, d)[freed] = float("nan")
        out = q.new_empty(hi - lo, h, d)
        return cpu_kernel.paged_attention(
            q[lo:hi], keys, values, table[None], torch.tensor([hi], dtype=torch.int32),
            torch.tensor([0, hi - lo], dtype=torch.int32), d**-0.5, out, block_size=bs,
            window=window, aligned=aligned,
        )  # fmt: skip

    alone = run(0, n)
    for step in (5, 7, 13, 1):  # prefill splits, then decodes
        split = torch.cat([run(lo, min(lo + step, n)) for lo in range(0, n, step)])
        assert torch.equal(split, alone), step
    # what the alignment is for: chunks from a tile's first window follow the split (float32
    # shows it; bfloat16's output rounding happens to hide it on these rows)
    plain = run(0, n, aligned=False)
    splits = [torch.cat([run(lo, min(lo + s, n), False) for lo in range(0, n, s)]) for s in (5, 7)]
    assert dtype == torch.bfloat16 or any(not torch.equal(x, plain) for x in splits)
    rows = torch.arange(n)
    visible = (rows[None] <= rows[:, None]) & (rows[None] > rows[:, None] - window)
    keys, values = (
        c[bs : bs + n].double().repeat_interleave(h // kvh, 1) for c in (k_cache, v_cache)
    )
    scores = torch.einsum("thd,shd->hts", q.double(), keys) * d**-0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    exact = torch.einsum("hts,shd->thd", probs, values)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone.double(), exact, rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_trainers_paged_attention_is_attention(dtype, window):
    """The trainer's path (right padding) against the plain torch math and against SDPA."""
    b, h, kvh, t, d = 3, 4, 2, 21, 16
    q, k, v = (_heavy(b, n, t, d, dtype=dtype, seed=s) / 4 for s, n in ((6, h), (7, kvh), (8, kvh)))
    lengths = [21, 9, 14]
    got = paged(q, k, v, lengths, d**-0.5, window)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(
        got.float(), reference(q, k, v, lengths, d**-0.5, window).float(), rtol=tol, atol=tol
    )
    for i, n in enumerate(lengths):
        rows = torch.arange(n)
        mask = rows[None] <= rows[:, None]
        if window is not None:
            mask &= rows[None] > rows[:, None] - window
        sdpa = F.scaled_dot_product_attention(
            q[i : i + 1, :, :n].float(),
            k[i : i + 1, :, :n].float().repeat_interleave(h // kvh, 1),
            v[i : i + 1, :, :n].float().repeat_interleave(h // kvh, 1),
            attn_mask=mask,
        ).transpose(1, 2)[0]
        torch.testing.assert_close(got[i, :n].float(), sdpa, rtol=tol, atol=tol)
        assert not got[i, n:].any()  # padded rows are zero


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_trainers_attention_takes_sinks(dtype, window):
    """gpt-oss's per-head sinks (passed as `s_aux`, or read from the layer) join each softmax's
    denominator, as in float64 math; padded rows are zero."""
    b, h, kvh, t, d = 2, 4, 2, 11, 16
    q, k, v = (_heavy(b, n, t, d, dtype=dtype, seed=s) / 4 for s, n in ((6, h), (7, kvh), (8, kvh)))
    gpt_oss_layer = torch.nn.Module()
    gpt_oss_layer.sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0]).to(dtype))
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 7:] = 0
    rows = torch.arange(t)
    seen = rows[None] <= rows[:, None]
    if window is not None:
        seen &= rows[None] > rows[:, None] - window
    allowed = seen[None, None] & mask[:, None, None, :].bool()  # [B, 1, T, T]
    got, _ = invariant_attention(gpt_oss_layer, q, k, v, allowed, sliding_window=window)
    aux, _ = invariant_attention(
        torch.nn.Module(), q, k, v, allowed, sliding_window=window, s_aux=gpt_oss_layer.sinks
    )
    assert torch.equal(got, aux)
    keys, values = (x.double().repeat_interleave(h // kvh, 1) for x in (k, v))
    scores = (q.double() @ keys.transpose(-1, -2)) * d**-0.5  # [B, H, T, T]
    scores = scores.masked_fill(~seen, float("-inf"))
    sink = gpt_oss_layer.sinks.double()[None, :, None, None].expand(b, h, t, 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :t]
    exact = (probs @ values).transpose(1, 2)  # [B, T, H, D]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[0].double(), exact[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1, :7].double(), exact[1, :7], rtol=tol, atol=tol)
    assert not got[1, 7:].any()


def test_the_mode_names_what_to_change_where_it_cannot_run():
    cpu = torch.device("cpu")
    assert batch_invariant_backend("auto", cpu) == batch_invariant_backend("CPU_ATTN", cpu) == "cpu"
    with pytest.raises(ValueError, match="attention_backend.*not batch invariant"):
        batch_invariant_backend("torch", cpu)
    # CUDA takes the Triton kernels: tests/unit/test_batch_invariant_triton.py
    with pytest.raises(ValueError, match="not on mps"):
        batch_invariant_backend("auto", torch.device("mps"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_gives_a_row_the_same_bits_at_any_count(dtype):
    """A width that is no multiple of the vector: torch's own SiLU takes a scalar tail for a
    row alone and the vector path for it inside a bigger call; the mode's never varies."""
    x = _heavy(300, 1000, dtype=dtype)
    full = invariant_silu(x)
    assert all(torch.equal(invariant_silu(x[r : r + 1])[0], full[r]) for r in (0, 7, 151, 299))
    torch.testing.assert_close(full.float(), F.silu(x.float()), rtol=1e-2, atol=1e-2)
    if dtype == torch.float32:
        plain = F.silu(x)
        assert any(not torch.equal(F.silu(x[r : r + 1])[0], plain[r]) for r in range(300))
