"""The engine against Hugging Face: greedy ids, raw logprobs, routed experts, cache paths."""

from __future__ import annotations

import random

import numpy as np
import pytest
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams

from tests.hf_reference import hf_greedy, hf_router_topk

MAX_NEW = 12


def prompts_for(vocab: int, seed: int = 0, count: int = 8) -> list[list[int]]:
    """`count` prompts of clearly different lengths, several 16-token blocks each."""
    rng = random.Random(seed)
    lengths = [17, 33, 40, 49, 58, 64, 71, 90][:count]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def greedy(max_new: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=1, **kw)


def engine_for(model_dir: str, **kw) -> LLMEngine:
    kw.setdefault("block_size", 16)
    return LLMEngine(EngineConfig(model=model_dir, **kw))


def assert_matches_hf(model_dir: str, prompts, outs, max_new: int = MAX_NEW, atol: float = 1e-4):
    for prompt, out in zip(prompts, outs):
        ref_ids, ref_lps = hf_greedy(model_dir, prompt, max_new)
        got = out.outputs[0]
        assert got.token_ids == ref_ids
        assert np.allclose(got.logprobs, ref_lps, atol=atol), (got.logprobs, ref_lps)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_moe_dir"])
def test_greedy_batch_matches_hf(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    engine = engine_for(model_dir, max_num_batched_tokens=128)
    prompts = prompts_for(engine.validator.vocab_size)
    outs = engine.generate(prompts, greedy(), use_tqdm=False)
    assert_matches_hf(model_dir, prompts, outs)


@pytest.mark.slow
def test_smollm2_chat_batch_matches_hf(smollm2_dir):
    engine = engine_for(smollm2_dir, max_num_batched_tokens=512)
    questions = [
        "What is 2+2?",
        "Name a color.",
        "Say hello in French.",
        "What is rain?",
        "Write a short greeting for a friend who just moved to a new city far away.",
        "List the planets.",
        "What is Python?",
        "Why is the sky blue? Answer briefly.",
    ]
    prompts = [engine.validator.render_chat([{"role": "user", "content": q}]) for q in questions]
    outs = engine.generate(prompts, greedy(16), use_tqdm=False)
    assert_matches_hf(smollm2_dir, prompts, outs, max_new=16, atol=1e-3)


def test_chunked_prefill_and_preemption_match_hf(tiny_llama_dir):
    # chunked: every prompt longer than the budget; preempted: room for ~2 sequences at a time
    engine = engine_for(
        tiny_llama_dir, max_num_batched_tokens=16, num_kv_blocks=14, enable_prefix_caching=False
    )
    prompts = prompts_for(engine.validator.vocab_size, seed=1)
    outs = engine.generate(prompts, greedy(20), use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    assert_matches_hf(tiny_llama_dir, prompts, outs, max_new=20)


def test_prefix_cache_reuse_is_identical_to_cold(tiny_moe_dir):
    warm = engine_for(tiny_moe_dir, enable_return_routed_experts=True)
    rng, vocab = random.Random(7), warm.validator.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(5 + 3 * i)] for i in range(6)]
    params = greedy(return_routed_experts=True)
    first = warm.generate(prompts, params, use_tqdm=False)
    second = warm.generate(prompts, params, use_tqdm=False)
    cold = engine_for(
        tiny_moe_dir, enable_return_routed_experts=True, enable_prefix_caching=False
    ).generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in second)
    assert all(o.num_cached_tokens == 0 for o in cold)
    for a, b in zip(second, cold):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        assert np.allclose(x.logprobs, y.logprobs, atol=1e-5)
        assert np.array_equal(x.routed_experts, y.routed_experts)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in cold]


def test_routed_experts_equal_hf_router_picks(tiny_moe_dir):
    engine = engine_for(tiny_moe_dir, enable_return_routed_experts=True)
    prompts = prompts_for(engine.validator.vocab_size, seed=3, count=3)
    outs = engine.generate(prompts, greedy(8, return_routed_experts=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        fed = prompt + got.token_ids[:-1]  # the last sampled token is never fed to the model
        ref = hf_router_topk(tiny_moe_dir, fed).numpy()
        assert got.routed_experts.dtype == np.int32
        assert got.routed_experts.shape == (
            len(fed),
            engine.runner_info.num_moe_layers,
            engine.runner_info.moe_top_k,
        )
        assert np.array_equal(np.sort(got.routed_experts, -1), np.sort(ref, -1))
