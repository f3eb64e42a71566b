"""DeepSeek-V3.2 (DSA) through the engine against transformers' eager path (float32): greedy
ids and logprobs with index_topk (12) below the prompt lengths, indexer top-k capture against
hooks on HF's indexers, and the capture identical from the prefix cache and under chunking and
preemption."""

from __future__ import annotations

import random

import numpy as np
import pytest
from raylane.actors.engine import SamplingParams

from tests.hf_reference import hf_indexer_topk
from tests.unit.test_engine_parity import assert_matches_hf, engine_for, greedy, prompts_for


def capture(max_new: int = 8) -> SamplingParams:
    return greedy(max_new, return_indexer_topk=True, return_routed_experts=True)


def test_greedy_and_indexer_topk_match_hf(tiny_dsa_dir):
    engine = engine_for(
        tiny_dsa_dir,
        max_num_batched_tokens=128,
        enable_return_indexer_topk=True,
        enable_return_routed_experts=True,
    )
    prompts = prompts_for(engine.validator.vocab_size, seed=4, count=4)
    outs = engine.generate(prompts, capture(), use_tqdm=False)
    assert_matches_hf(tiny_dsa_dir, prompts, outs, max_new=8)
    info = engine.runner_info
    assert (info.num_dsa_layers, info.index_topk) == (3, 12)
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        fed = prompt + got.token_ids[:-1]
        assert got.indexer_topk.dtype == np.int32
        assert got.indexer_topk.shape == (len(fed), 3, 12)
        np.testing.assert_array_equal(got.indexer_topk, hf_indexer_topk(tiny_dsa_dir, fed))
    # early positions see fewer than 12 tokens: all of them, then -1
    first = outs[0].outputs[0].indexer_topk
    assert first[3, 0].tolist() == [0, 1, 2, 3] + [-1] * 8


def test_indexer_topk_from_the_prefix_cache_and_preemption_equal_cold(tiny_dsa_dir):
    rng = random.Random(8)
    kw = {"enable_return_indexer_topk": True, "enable_return_routed_experts": True}
    warm = engine_for(tiny_dsa_dir, **kw)
    vocab = warm.validator.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(4 + 5 * i)] for i in range(3)]
    warm.generate(prompts, capture(), use_tqdm=False)
    second = warm.generate(prompts, capture(), use_tqdm=False)
    tight = engine_for(
        tiny_dsa_dir,
        enable_prefix_caching=False,
        max_num_batched_tokens=16,
        num_kv_blocks=9,
        **kw,
    )
    cold = tight.generate(prompts, capture(), use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    assert all(o.num_cached_tokens > 0 for o in second)
    for a, b in zip(second, cold):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        np.testing.assert_array_equal(x.indexer_topk, y.indexer_topk)
        np.testing.assert_array_equal(x.routed_experts, y.routed_experts)


def test_indexer_topk_needs_the_engine_flag_and_a_dsa_model(tiny_dsa_dir, tiny_deepseek_dir):
    engine = engine_for(tiny_dsa_dir, num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_return_indexer_topk"):
        engine.generate([[5, 6, 7]], greedy(2, return_indexer_topk=True), use_tqdm=False)
    mla = engine_for(tiny_deepseek_dir, num_kv_blocks=16, enable_return_indexer_topk=True)
    with pytest.raises(ValueError, match="no sparse-attention layers"):
        mla.generate([[5, 6, 7]], greedy(2, return_indexer_topk=True), use_tqdm=False)


def test_graph_replay_and_async_scheduling_equal_serial_eager(tiny_dsa_dir):
    """The graph runner (its eager replay on the CPU) with async scheduling against the
    serial eager engine: tokens, logprobs and the captured top-k, for a decode batch of 3."""
    kw = {"enable_return_indexer_topk": True, "cudagraph_capture_sizes": (1, 2, 4)}
    prompts = prompts_for(384, seed=6, count=3)
    runs = []
    for eager, ahead in ((True, False), (False, True)):
        engine = engine_for(tiny_dsa_dir, enforce_eager=eager, async_scheduling=ahead, **kw)
        params = greedy(10, return_indexer_topk=True)
        runs.append((engine.generate(prompts, params, use_tqdm=False), engine))
    (ref, _), (got, engine) = runs
    assert engine.stats.graph_replays > 0
    for a, b in zip(got, ref):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        # padded batch shapes change float32 rounding (seen: 1.6e-5), never the picks
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
        np.testing.assert_array_equal(x.indexer_topk, y.indexer_topk)


def test_glm5_shared_indexer_layers_match_hf(tiny_glm5_dir):
    """GLM-5: layers 1 and 3 reuse the picks of layers 0 and 2 (HF runs no indexer there)."""
    engine = engine_for(tiny_glm5_dir, enable_return_indexer_topk=True)
    prompts = prompts_for(engine.validator.vocab_size, seed=5, count=1)
    outs = engine.generate(prompts, greedy(6, return_indexer_topk=True), use_tqdm=False)
    assert_matches_hf(tiny_glm5_dir, prompts, outs, max_new=6)
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        fed = prompt + got.token_ids[:-1]
        ref = hf_indexer_topk(tiny_glm5_dir, fed)  # the two full layers
        np.testing.assert_array_equal(got.indexer_topk[:, [0, 2]], ref)
        np.testing.assert_array_equal(got.indexer_topk[:, [1, 3]], ref)
