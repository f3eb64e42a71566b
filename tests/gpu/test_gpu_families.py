"""Every model family whose layers run kernels of their own, on CUDA against Hugging Face on
CUDA (float32): greedy ids and raw logprobs of a mixed-length batch in 16-token chunks, routed
experts against hooks on HF's routers, DSA's indexer picks against HF's indexers; with CUDA
graphs (the default on CUDA) and eager.

What each family runs there: MLA's latent cache on the Triton backend (DeepSeek-V2/V3,
GLM-4.5), DSA's indexer and sparse attention (DeepSeek-V3.2, GLM-5), the Triton gated delta
rule and causal conv1d beside Triton attention (Qwen3.5), windowed attention and sinks
(Gemma 3, gpt-oss), the grouped-matmul MoE (Qwen3-MoE, gpt-oss, the DeepSeek family)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests import tiny_models
from tests.gpu.device import DEVICE, needs_device
from tests.gpu.test_gpu_parity import assert_graphs_used, assert_matches_hf, engine_for
from tests.hf_reference import hf_indexer_topk, hf_router_topk

pytestmark = needs_device

# name -> (builder in tests/tiny_models.py, routes experts, the layers that run a DSA indexer
# of their own, or None without DSA: GLM-5's layers 1 and 3 reuse the picks of layers 0 and 2)
FAMILIES = {
    "deepseek_v2": ("make_deepseek_v2", True, None),
    "deepseek_v3": ("make_deepseek_v3", True, None),
    "glm4_moe": ("make_glm4_moe", True, None),
    "deepseek_v32": ("make_deepseek_v32", True, [0, 1, 2]),
    "glm5": ("make_glm_moe_dsa", True, [0, 2]),
    "qwen3_5": ("make_qwen3_5", False, None),
    "qwen3_5_moe": ("make_qwen3_5_moe", True, None),
    "qwen3_next": ("make_qwen3_next", True, None),
    "gemma3": ("make_gemma3", False, None),
    "gpt_oss": ("make_gpt_oss", True, None),
    "qwen3_moe": ("make_qwen3_moe", True, None),
}
MAX_NEW = 10


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, bool, list[int] | None]:
    builder, routes, indexes = FAMILIES[request.param]
    model_dir = getattr(tiny_models, builder)(tmp_path_factory.mktemp(request.param))
    return model_dir, routes, indexes


@pytest.mark.parametrize("enforce_eager", [None, True], ids=["graphs", "eager"])
def test_family_matches_hf(family, enforce_eager):
    model_dir, routes, indexer_layers = family
    indexes = indexer_layers is not None
    captures = {"enable_return_routed_experts": routes, "enable_return_indexer_topk": indexes}
    engine = engine_for(
        model_dir, enforce_eager, max_num_batched_tokens=16, max_num_seqs=8, **captures
    )
    rng, vocab = random.Random(7), engine.validator.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (9, 17, 33, 40, 58)]
    outs = assert_matches_hf(
        model_dir,
        engine,
        prompts,
        MAX_NEW,
        return_routed_experts=routes,
        return_indexer_topk=indexes,
    )
    assert_graphs_used(engine, enforce_eager)
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        fed = prompt + got.token_ids[:-1]  # the last sampled token is never fed to the model
        if routes:
            ref = hf_router_topk(model_dir, fed, device=DEVICE).numpy()
            assert got.routed_experts.shape == ref.shape
            assert np.array_equal(np.sort(got.routed_experts, -1), np.sort(ref, -1))
        if indexes:
            ref_picks = hf_indexer_topk(model_dir, fed, device=DEVICE)
            np.testing.assert_array_equal(got.indexer_topk[:, indexer_layers], ref_picks)
