"""The Triton kernels of the newer layer kinds on CUDA, at the shapes real checkpoints use,
against the torch references on CUDA: MLA's latent attention (DeepSeek-V3: 16 heads over
512 + 64 dims, values a 512-wide view of the keys) and the gated delta rule and causal conv1d
of Qwen3.5's linear attention (16 key heads, 32 value heads, 128 dims, a 4-wide conv), over
prefill chunks that carry state and decodes, in NaN-poisoned pools."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from raylane.kernels.attention import SeqSlice, get_backend
from raylane.kernels.attention.builder import build_metadata

from tests.gpu.device import needs_cuda

pytestmark = [needs_cuda, pytest.mark.filterwarnings("ignore")]

MLA_HEADS, LATENT, ROPE, BLOCK = 16, 512, 64, 16
MLA_SHAPES = [(37, 37), (20, 100), (1, 1), (1, 300), (1, 1000)]  # (new, context)
TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}  # fp32: tl.dot may use tf32


def mla_step(dtype: torch.dtype, seed: int = 0):
    rng = random.Random(seed)
    need = [-(-ctx // BLOCK) for _, ctx in MLA_SHAPES]
    pool = list(range(sum(need) + 3))
    rng.shuffle(pool)
    seqs = []
    for (new, ctx), n in zip(MLA_SHAPES, need):
        seqs.append(SeqSlice(new, ctx, pool[:n]))
        pool = pool[n:]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(dtype)  # noqa: E731
    tokens = sum(new for new, _ in MLA_SHAPES)
    q = rand(tokens, MLA_HEADS, LATENT + ROPE)
    step = rand(tokens, 1, LATENT + ROPE)
    cache = rand((sum(need) + 3) * BLOCK, 1, LATENT + ROPE)
    return seqs, q, step, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mla_triton_matches_torch_at_deepseek_shape(dtype):
    seqs, q, step, cache = mla_step(dtype)
    outs = {}
    for name in ("torch", "triton"):
        c = cache.clone()
        meta = build_metadata(seqs[:2], seqs[2:], BLOCK, device="cuda")
        backend = get_backend(name, "cuda", ["mla"])
        out = backend.forward(q, step, step[..., :LATENT], c, c[..., :LATENT], meta, 0.07)
        torch.cuda.synchronize()
        outs[name] = (out, c)
    (ref, ref_cache), (out, got_cache) = outs["torch"], outs["triton"]
    assert out.shape == (q.shape[0], MLA_HEADS, LATENT)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(got_cache, ref_cache)


HK, HV, DK, DV, W = 16, 32, 128, 128, 4
CONV = 2 * HK * DK + HV * DV
LENS = [300, 64, 3, 1, 1, 1]  # three prefill chunks (one shorter than the conv), three decodes
SLOTS = [7, 0, 3, 5, 1, 9]


def state_meta():
    from raylane.kernels.linear_attention.metadata import StateMetadata

    qsl = [0]
    for n in LENS:
        qsl.append(qsl[-1] + n)
    return StateMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        state_slots=torch.tensor(SLOTS, device="cuda"),
        num_prefills=3,
        num_prefill_tokens=qsl[3],
        max_query_len=max(LENS),
        query_start_loc_host=qsl,
        state_slots_host=SLOTS,
    )


def pools(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    pool = torch.full((12, *shape), float("nan"), device="cuda")
    pool[SLOTS] = torch.randn(len(SLOTS), *shape, generator=gen, device="cuda")
    return pool


def linear_backends():
    from raylane.kernels.linear_attention.registry import get_linear_backend

    return get_linear_backend("torch", "cuda"), get_linear_backend("triton", "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_delta_rule_triton_matches_torch_at_qwen3_5_shape(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = sum(LENS)
    rand = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q, k = rand(t, HK, DK).to(dtype), rand(t, HK, DK).to(dtype)
    v = rand(t, HV, DV).to(dtype)
    g = -F.softplus(rand(t, HV)).to(dtype)
    beta = rand(t, HV).sigmoid().to(dtype)
    state = pools((HV, DK, DV), gen) * 0.1
    want_state = state.clone()
    ref, tri = linear_backends()
    want = ref.delta_rule(q, k, v, g, beta, want_state, state_meta())
    got = tri.delta_rule(q, k, v, g, beta, state, state_meta())
    torch.cuda.synchronize()
    tol = 2e-2 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(state, want_state, atol=tol, rtol=tol, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv_triton_matches_torch_at_qwen3_5_shape(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(sum(LENS), CONV, generator=gen, device="cuda").to(dtype)
    weight = torch.randn(CONV, W, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(CONV, generator=gen, device="cuda").to(dtype)
    conv_state = pools((CONV, W - 1), gen).to(dtype)
    want_state = conv_state.clone()
    ref, tri = linear_backends()
    want = ref.conv(x, weight, bias, want_state, state_meta())
    got = tri.conv(x, weight, bias, conv_state, state_meta())
    torch.cuda.synchronize()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(conv_state, want_state, atol=tol, rtol=tol, equal_nan=True)
