"""DeepSeek-V3 (and GLM-4.5's MoE) through the engine against Hugging Face (float32): greedy
ids and raw logprobs of a mixed-length batch, routed experts against hooks on HF's gates, and
the latent cache under the prefix cache, chunked prefill and preemption."""

from __future__ import annotations

import random

import numpy as np
import pytest
from raylane.actors.models.attention import LatentAttention

from tests.hf_reference import hf_router_topk
from tests.unit.test_engine_parity import assert_matches_hf, engine_for, greedy, prompts_for


@pytest.mark.parametrize("model", ["tiny_deepseek_dir", "tiny_glm4_moe_dir"])
def test_greedy_batch_and_routed_experts_match_hf(model, request):
    model_dir = request.getfixturevalue(model)
    engine = engine_for(model_dir, max_num_batched_tokens=128, enable_return_routed_experts=True)
    prompts = prompts_for(engine.validator.vocab_size, count=6)
    outs = engine.generate(prompts, greedy(return_routed_experts=True), use_tqdm=False)
    assert_matches_hf(model_dir, prompts, outs)
    info = engine.runner_info
    assert (info.num_moe_layers, info.moe_top_k) == (2, 2)  # layer 0 is dense
    for prompt, out in zip(prompts[:3], outs):
        got = out.outputs[0]
        fed = prompt + got.token_ids[:-1]
        ref = hf_router_topk(model_dir, fed).numpy()
        assert got.routed_experts.shape == (len(fed), 2, 2)
        assert np.array_equal(np.sort(got.routed_experts, -1), np.sort(ref, -1))


def test_latent_cache_prefix_reuse_and_preemption_match_cold(tiny_deepseek_dir):
    rng = random.Random(5)
    warm = engine_for(tiny_deepseek_dir, enable_return_routed_experts=True)
    vocab = warm.validator.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(5 + 3 * i)] for i in range(4)]
    params = greedy(return_routed_experts=True)
    warm.generate(prompts, params, use_tqdm=False)
    second = warm.generate(prompts, params, use_tqdm=False)
    # chunked and preempted: a 16-token budget and room for about two sequences
    tight = engine_for(
        tiny_deepseek_dir,
        enable_return_routed_experts=True,
        enable_prefix_caching=False,
        max_num_batched_tokens=16,
        num_kv_blocks=10,
    )
    cold = tight.generate(prompts, params, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    assert all(o.num_cached_tokens > 0 for o in second)
    for a, b in zip(second, cold):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        assert np.allclose(x.logprobs, y.logprobs, atol=1e-5)
        assert np.array_equal(x.routed_experts, y.routed_experts)
    assert_matches_hf(tiny_deepseek_dir, prompts, cold)


def test_cache_holds_one_latent_row_per_token(tiny_deepseek_dir):
    engine = engine_for(tiny_deepseek_dir, num_kv_blocks=8)
    runner = engine.executor.runner
    layers = runner.model.attention_layers()
    assert all(isinstance(layer, LatentAttention) for layer in layers)
    # kv_lora_rank 32 + rope 8 floats per token per layer, against 2 * 4 heads * (16 + 8) / 16
    assert [tuple(layer.k_cache.shape) for layer in layers] == [(9 * 16, 1, 40)] * 3
    assert all(layer.v_cache.data_ptr() == layer.k_cache.data_ptr() for layer in layers)
    # float32: 3 layers x (32 + 8) x 4 bytes, against 3 x 4 heads x (24 + 16) x 4 expanded
    assert engine.runner_info.kv_bytes_per_token == 480
    assert engine.stats_snapshot()["gauges"]["kv_cache_bytes_per_token"] == 480
