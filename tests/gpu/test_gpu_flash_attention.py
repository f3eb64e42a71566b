"""The flash_attn backend (vLLM's flash-attention fork) on CUDA against the torch reference and
the Triton backend on mixed steps, and the engine's greedy tokens against Triton's. Skips,
saying so, where the fork is not importable (it comes with vLLM's wheel, never with raylane)."""

from __future__ import annotations

import random

import pytest
import torch
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams
from raylane.kernels.attention import BackendRequest, get_backend
from raylane.kernels.attention.builder import build_metadata
from raylane.kernels.attention.flash_fork import FlashForkMissing, find_flash_fork

from tests.gpu.device import needs_cuda
from tests.gpu.test_gpu_triton_attention import BLOCK, CASES, HEADS, make_step

pytestmark = needs_cuda

# verify rows (speculative decoding's 1 + k query tokens over a context) among the others
STEPS = {**CASES, "verify_rows": ([(4, 4), (3, 40), (3, 19)], [(1, 5), (1, 130)])}
TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}  # two kernels, each within the reference's


@pytest.fixture(scope="module")
def fork():
    try:
        return find_flash_fork(torch.device("cuda"))
    except FlashForkMissing as e:
        pytest.skip(f"vLLM's flash-attention fork is not importable: {e}")


def run(name: str, prefills, decodes, tensors, num_splits: int = 0, kinds=(), **kw):
    """`name`'s output and cache after one step; `kw`: window, sinks, softcap."""
    q, k, v, k_cache, v_cache = (t.clone() for t in tensors)
    meta = build_metadata(prefills, decodes, BLOCK, device="cuda")
    kinds = {"full", *kinds, *(["sliding"] if kw.get("window") else [])}
    kinds |= {"softcap"} if kw.get("softcap") else set()
    backend = get_backend(name, "cuda", kinds, BackendRequest(num_splits=num_splits))
    out = backend.forward(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5, **kw)
    torch.cuda.synchronize()
    return out, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", list(STEPS))
def test_flash_matches_torch_and_triton(fork, case, head_dim, dtype):
    prefills, decodes, tensors = make_step(*STEPS[case], head_dim, dtype, seed=len(case))
    ref, ref_k, ref_v = run("torch", prefills, decodes, tensors)
    tri, _, _ = run("triton", prefills, decodes, tensors)
    out, k_cache, v_cache = run("flash_attn", prefills, decodes, tensors)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.float(), tri.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("sinks", [False, True])
def test_flash_matches_torch_with_window_sinks_and_softcap(fork, window, sinks):
    if sinks and fork.fa_version != 3:
        pytest.skip(f"sinks need FA3; this GPU runs FA{fork.fa_version} (Triton serves them)")
    prefills, decodes, tensors = make_step(*STEPS["mixed"], 64, torch.bfloat16, seed=5)
    kw = {"window": window, "sinks": torch.randn(HEADS, device="cuda") * 2 if sinks else None}
    kinds = ["sinks"] if sinks else []
    ref, _, _ = run("torch", prefills, decodes, tensors, **kw)
    out, _, _ = run("flash_attn", prefills, decodes, tensors, kinds=kinds, **kw)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    ref, _, _ = run("torch", prefills, decodes, tensors, softcap=5.0, **kw)
    out, _, _ = run("flash_attn", prefills, decodes, tensors, kinds=kinds, softcap=5.0, **kw)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_one_split_keeps_a_decode_row_the_same_in_any_batch(fork):
    """num_splits=1 (the batch-invariant mode): a row's output does not depend on its batch."""
    if fork.fa_version != 3:
        pytest.skip(f"FA{fork.fa_version} picks its own split count for paged decode")
    decodes = [(1, 300), (1, 9), (1, 64), (1, 1000)]
    _, alone, tensors = make_step([], decodes[:1], 128, torch.bfloat16, seed=2)
    one, _, _ = run("flash_attn", [], alone, tensors, num_splits=1)
    _, batch, tensors_b = make_step([], decodes, 128, torch.bfloat16, seed=2)
    # the same row: copy the lone step's query and its context into the batch's first row
    q, k, v, k_cache, v_cache = tensors_b
    q[0], k[0], v[0] = tensors[0][0], tensors[1][0], tensors[2][0]
    for a, b in zip(alone[0].block_table, batch[0].block_table):
        rows = slice(b * BLOCK, (b + 1) * BLOCK)
        k_cache[rows] = tensors[3][a * BLOCK : (a + 1) * BLOCK]
        v_cache[rows] = tensors[4][a * BLOCK : (a + 1) * BLOCK]
    many, _, _ = run("flash_attn", [], batch, (q, k, v, k_cache, v_cache), num_splits=1)
    assert torch.equal(many[0], one[0])


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_engine_with_flash_attn_matches_triton_greedy(fork, tiny_qwen3_dir, enforce_eager):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 17, 33, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for backend, eager in (("TRITON_ATTN", True), ("FLASH_ATTN", enforce_eager)):
        config = EngineConfig(
            model=tiny_qwen3_dir, device="cuda", dtype="float16", max_model_len=256,
            attention_backend=backend, enforce_eager=eager, cudagraph_capture_sizes=(1, 2, 4),
        )  # fmt: skip
        engine = LLMEngine(config)
        try:
            outs = engine.generate(prompts, params, use_tqdm=False)
            tokens[backend] = [o.outputs[0].token_ids for o in outs]
            if not eager:
                assert engine.stats.graph_replays > 0
        finally:
            engine.shutdown()
    assert tokens["FLASH_ATTN"] == tokens["TRITON_ATTN"]
