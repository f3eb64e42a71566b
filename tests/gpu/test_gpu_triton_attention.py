"""The Triton attention backend against the torch reference on CUDA: same outputs, same cache
writes, for prefill chunks over cached context, decodes, and mixed steps."""

from __future__ import annotations

import random

import pytest
import torch
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams
from raylane.kernels.attention import SeqSlice, get_backend
from raylane.kernels.attention.builder import build_metadata

from tests.gpu.device import needs_cuda

pytestmark = needs_cuda

HEADS, KV_HEADS, BLOCK = 8, 2, 16
# (num_new, context_len) of the prefill chunks, then of the decodes
CASES = {
    "fresh_prefill": ([(7, 7), (40, 40)], []),
    "chunk_over_cached_context": ([(5, 21), (16, 80)], []),
    "decodes": ([], [(1, 1), (1, 9), (1, 16), (1, 33), (1, 300)]),
    "mixed": ([(7, 7), (5, 21), (2, 4)], [(1, 3), (1, 20), (1, 17), (1, 129)]),
}
TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}  # fp32: tl.dot may use tf32


def make_step(prefills, decodes, head_dim: int, dtype: torch.dtype, seed: int):
    """Random q/k/v of the step's new tokens, random caches (the cached context) and random,
    non-contiguous block tables."""
    rng = random.Random(seed)
    shapes = prefills + decodes
    need = [-(-ctx // BLOCK) for _, ctx in shapes]
    pool = list(range(sum(need) + 3))  # a few blocks nobody owns
    rng.shuffle(pool)
    slices = []
    for (num_new, ctx), n in zip(shapes, need):
        slices.append(SeqSlice(num_new, ctx, pool[:n]))
        pool = pool[n:]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens = sum(n for n, _ in shapes)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(dtype)  # noqa: E731
    num_slots = (sum(need) + 3) * BLOCK
    tensors = (
        rand(tokens, HEADS, head_dim),
        rand(tokens, KV_HEADS, head_dim),
        rand(tokens, KV_HEADS, head_dim),
        rand(num_slots, KV_HEADS, head_dim),
        rand(num_slots, KV_HEADS, head_dim),
    )
    return slices[: len(prefills)], slices[len(prefills) :], tensors


def run_backend(name: str, prefills, decodes, tensors, window=None, sinks=None):
    q, k, v, k_cache, v_cache = (t.clone() for t in tensors)
    # metadata per backend: a backend caches its own plan on it
    meta = build_metadata(prefills, decodes, BLOCK, device="cuda")
    scale = q.shape[-1] ** -0.5
    out = get_backend(name, "cuda").forward(q, k, v, k_cache, v_cache, meta, scale, window, sinks)
    torch.cuda.synchronize()
    return out, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_torch(case, head_dim, dtype):
    pytest.importorskip("triton")
    prefills, decodes, tensors = make_step(*CASES[case], head_dim, dtype, seed=len(case))
    ref, ref_k, ref_v = run_backend("torch", prefills, decodes, tensors)
    out, k_cache, v_cache = run_backend("triton", prefills, decodes, tensors)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 24])
def test_triton_matches_torch_with_window_and_sinks(window, dtype):
    # gpt-oss's shape: head_dim 64, learned sinks; sliding layers of window 24 (< the contexts)
    pytest.importorskip("triton")
    prefills, decodes, tensors = make_step(*CASES["mixed"], 64, dtype, seed=5)
    sinks = torch.randn(HEADS, device="cuda") * 2
    ref, ref_k, ref_v = run_backend("torch", prefills, decodes, tensors, window, sinks)
    out, k_cache, v_cache = run_backend("triton", prefills, decodes, tensors, window, sinks)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_engine_with_triton_matches_torch_greedy(tiny_llama_dir):
    pytest.importorskip("triton")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 17, 33, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(
            EngineConfig(
                model=tiny_llama_dir,
                device="cuda",
                dtype="float32",
                max_model_len=256,
                attention_backend=backend,
            )
        )
        try:
            tokens[backend] = [
                o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)
            ]
        finally:
            engine.shutdown()
    assert tokens["triton"] == tokens["torch"]
