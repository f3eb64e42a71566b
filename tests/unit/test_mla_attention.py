"""MLA's absorbed-form attention (one latent row per slot; values = the rows' latent part, a
view of the key cache) on every backend that serves the `mla` layer kind, against a naive
float64 computation over each sequence's own contiguous rows."""

from __future__ import annotations

import os

import pytest
import torch
from raylane.kernels.attention import available_backends, get_backend
from raylane.kernels.attention.builder import SeqSlice, build_metadata

HEADS, LATENT, ROPE, BLOCK = 4, 32, 8, 4
SCALE = 0.3


def _naive(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """q [n, H, L + R] = the last n positions of a sequence whose rows are [ctx, L + R]."""
    n, ctx = q.shape[0], rows.shape[0]
    scores = torch.einsum("nhd,cd->nhc", q.double(), rows.double()) * SCALE
    pos = torch.arange(ctx - n, ctx).view(n, 1, 1)
    scores = scores.masked_fill(torch.arange(ctx).view(1, 1, ctx) > pos, float("-inf"))
    return torch.einsum("nhc,cl->nhl", scores.softmax(-1), rows[:, :LATENT].double())


def _case(backend: str, dtype: torch.dtype, seed: int = 0):
    """Two prefill chunks (one fresh, one after 9 cached rows) then three decodes, on
    scattered blocks. Unused slots hold NaN for the C kernel, which must never read them; the
    torch reference reads whole blocks and masks, like the runner's zeroed cache. Returns
    (out, naive reference, the case's pieces for a direct kernel call)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(11, 11), (6, 15), (1, 9), (1, 17), (1, 4)]  # (new, context)
    tables, free = [], list(torch.randperm(40, generator=gen).tolist())
    for _, ctx in shapes:
        tables.append([free.pop() for _ in range(-(-ctx // BLOCK))])
    fill = 0.0 if backend == "torch" else float("nan")
    cache = torch.full((41 * BLOCK, 1, LATENT + ROPE), fill, dtype=dtype)
    rows = [torch.randn(ctx, LATENT + ROPE, generator=gen).to(dtype) for _, ctx in shapes]
    for (new, ctx), table, r in zip(shapes, tables, rows):
        for pos in range(ctx - new):  # the cached part
            cache[table[pos // BLOCK] * BLOCK + pos % BLOCK, 0] = r[pos]
    seqs = [SeqSlice(new, ctx, table) for (new, ctx), table in zip(shapes, tables)]
    meta = build_metadata(seqs[:2], seqs[2:], BLOCK)
    q = torch.randn(meta.num_tokens, HEADS, LATENT + ROPE, generator=gen).to(dtype)
    step = torch.cat([r[ctx - new :] for (new, ctx), r in zip(shapes, rows)]).unsqueeze(1)
    out = _backend(backend).forward(
        q, step, step[..., :LATENT], cache, cache[..., :LATENT], meta, SCALE
    )
    ref, start = [], 0
    for (new, _), r in zip(shapes, rows):
        ref.append(_naive(q[start : start + new], r))
        start += new
    return out, torch.cat(ref)


def _backend(name: str):
    if name == "triton":  # a GPU backend: run its kernels under the interpreter
        os.environ["TRITON_INTERPRET"] = "1"
        pytest.importorskip("triton")
        from raylane.kernels.attention.triton_backend import TritonAttention

        return TritonAttention()
    if name not in available_backends(torch.device("cpu"), ["mla"]):
        pytest.skip(f"{name} is not available here")
    return get_backend(name, "cpu", ["mla"])


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_attention_equals_naive(backend, dtype):
    out, ref = _case(backend, dtype)
    assert out.shape == (ref.shape[0], HEADS, LATENT) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_triton_split_decode_over_latent_rows():
    """The split-K decode (partials, then the reduce kernel) with a value view narrower than
    the keys, against the naive computation."""
    _backend("triton")
    from raylane.kernels.attention.triton_kernels import decode_attention

    gen = torch.Generator().manual_seed(3)
    ctx = [37, 5, 64]
    tables = [list(range(i * 16, i * 16 + -(-n // BLOCK))) for i, n in enumerate(ctx)]
    cache = torch.full((48 * BLOCK, 1, LATENT + ROPE), float("nan"))
    rows = [torch.randn(n, LATENT + ROPE, generator=gen) for n in ctx]
    for table, r in zip(tables, rows):
        for pos in range(r.shape[0]):
            cache[table[pos // BLOCK] * BLOCK + pos % BLOCK, 0] = r[pos]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(ctx), HEADS, LATENT + ROPE, generator=gen)
    out = q.new_empty(len(ctx), HEADS, LATENT)
    seq_lens = torch.tensor(ctx, dtype=torch.int32)
    cache_v = cache[..., :LATENT]
    decode_attention(q, cache, cache_v, block_tables, seq_lens, SCALE, BLOCK, out, num_splits=3)
    ref = torch.cat([_naive(q[i : i + 1], r) for i, r in enumerate(rows)])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_triton_splits_a_wide_group_across_programs(kind):
    """DeepSeek's real widths (512 latent + 64 rope lanes, padded to 1024) with 32 query heads
    on the one latent row: float32 rows that wide fit 16 (token x head) rows per program in
    sm_90's shared memory, so the group runs as two chunks of 16 heads. Against naive attention
    over each sequence's rows."""
    _backend("triton")
    from raylane.kernels.attention import triton_kernels as tk
    from raylane.kernels.attention.triton_common import _rows_per_program

    heads, latent, rope = 32, 512, 64
    gen = torch.Generator().manual_seed(4)
    shapes = [(3, 3), (2, 7)] if kind == "prefill" else [(1, 5), (1, 18)]  # (new, context)
    cache = torch.full((8 * BLOCK, 1, latent + rope), float("nan"))
    tables = [[4, 1], [0, 3, 5, 2, 6][: -(-shapes[1][1] // BLOCK)]]
    rows = [torch.randn(ctx, latent + rope, generator=gen) for _, ctx in shapes]
    for table, r in zip(tables, rows):
        for pos in range(r.shape[0]):
            cache[table[pos // BLOCK] * BLOCK + pos % BLOCK, 0] = r[pos]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor([ctx for _, ctx in shapes], dtype=torch.int32)
    q = torch.randn(sum(n for n, _ in shapes), heads, latent + rope, generator=gen)
    out = q.new_full((q.shape[0], heads, latent), float("nan"))
    assert _rows_per_program(64, 16, 1024, q) == 16  # so two chunks of 16 heads
    args = (q, cache, cache[..., :latent], block_tables, seq_lens)
    if kind == "prefill":
        qsl = torch.tensor([0, shapes[0][0], q.shape[0]], dtype=torch.int32)
        tk.prefill_attention(*args, qsl, 3, SCALE, BLOCK, out)
    else:
        tk.decode_attention(*args, SCALE, BLOCK, out, num_splits=1)
    want, start = [], 0
    for (new, ctx), r in zip(shapes, rows):
        scores = torch.einsum("nhd,cd->nhc", q[start : start + new].double(), r.double()) * SCALE
        pos = torch.arange(ctx - new, ctx).view(new, 1, 1)
        scores = scores.masked_fill(torch.arange(ctx).view(1, 1, ctx) > pos, float("-inf"))
        want.append(torch.einsum("nhc,cl->nhl", scores.softmax(-1), r[:, :latent].double()))
        start += new
    torch.testing.assert_close(out.double(), torch.cat(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                         "original_max_position_embeddings": 4096}])  # fmt: skip
def test_softmax_scale_is_transformers_own(rope):
    """The same float, products in transformers' order: the batch-invariant mode's MLA must
    scale its scores exactly as DeepseekV3Attention does."""
    from raylane.actors.models.mla import MLASpec
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    extra = {} if rope is None else {"rope_parameters": {"rope_theta": 10000.0, **rope}}
    config = DeepseekV3Config(
        hidden_size=32, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, **extra,
    )  # fmt: skip
    assert MLASpec.from_config(config).scale == DeepseekV3Attention(config, 0).scaling
