"""The mixture-of-experts families at TP=2 (Ray shards) against TP=1 in process: Qwen3-MoE and
DeepSeek-V3 (routed experts through the prefix cache), Qwen3-Next (recurrent-state snapshots),
gpt-oss (KV cache groups), DeepSeek-V3.2 (DSA indexer selections).

Engines are class-scoped, so each model's shards are freed when its class ends; tests that end
an engine run last in their class. The Ray cluster is the session's (`ray_cluster`).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.ray.tp_helpers import (
    ATOL,
    LENGTHS,
    assert_same_outputs,
    check_greedy_parity,
    greedy,
    prompts_for,
    tp_pair,
)
from tests.tiny_models import make_gpt_oss, make_qwen3_next

# --- Qwen3-MoE (routed experts) ----------------------------------------------------------------


@pytest.fixture(scope="class")
def moe(ray_cluster, tiny_moe_dir):
    yield from tp_pair(tiny_moe_dir, enable_return_routed_experts=True)


class TestQwen3Moe:
    def test_greedy_matches_tp1(self, moe):
        check_greedy_parity(moe)

    def test_routed_experts_match_tp1_through_the_prefix_cache(self, moe):
        vocab = moe.tp1.validator.vocab_size
        shared = prompts_for(vocab, (40,), seed=17)[0]  # 2.5 blocks: 2 full ones to share
        tails = prompts_for(vocab, (3, 9, 14), seed=18)
        prompts = [shared + tail for tail in tails]
        params = greedy(8, logprobs=1, return_routed_experts=True)
        for run in range(2):
            ref = moe.tp1.generate(prompts, params, use_tqdm=False)
            got = moe.tp2.generate(prompts, params, use_tqdm=False)
            assert_same_outputs(got, ref, ATOL)
            if run == 1:  # every prompt's shared blocks come from the cache now
                assert all(o.num_cached_tokens > 0 for o in got)
                assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in ref]
            for g, r, prompt in zip(got, ref, prompts):
                experts, expected = g.outputs[0].routed_experts, r.outputs[0].routed_experts
                assert experts.dtype == np.int32
                assert experts.shape == (
                    len(prompt) + 8 - 1,
                    moe.tp1.runner_info.num_moe_layers,
                    moe.tp1.runner_info.moe_top_k,
                )
                np.testing.assert_array_equal(experts, expected)


class TestDeepseekV3(TestQwen3Moe):
    """The same checks on DeepSeek-V3: MLA heads split across ranks with the latent rows
    replicated, grouped routing with shared experts (split by intermediate size)."""

    @pytest.fixture(scope="class")
    @classmethod
    def moe(cls, ray_cluster, tiny_deepseek_dir):
        yield from tp_pair(tiny_deepseek_dir, enable_return_routed_experts=True)


def test_qwen3_next_matches_tp1_through_state_snapshots(ray_cluster, tmp_path_factory):
    """Qwen3-Next at TP=2: Gated DeltaNet key / value heads split across ranks with their conv
    channels, decay parameters and recurrent state, gated attention heads split, shared-expert
    MoE; the second run resumes from recurrent-state snapshots on every rank."""
    model_dir = make_qwen3_next(tmp_path_factory.mktemp("tp_qwen3_next"))
    pair = tp_pair(model_dir, max_num_batched_tokens=16, enable_return_routed_experts=True)
    tp = next(pair)
    try:
        vocab = tp.tp1.validator.vocab_size
        shared = prompts_for(vocab, (40,), seed=17)[0]
        prompts = [shared + tail for tail in prompts_for(vocab, (3, 14), seed=18)]
        params = greedy(8, logprobs=1, return_routed_experts=True)
        for run in range(2):
            ref = tp.tp1.generate(prompts, params, use_tqdm=False)
            got = tp.tp2.generate(prompts, params, use_tqdm=False)
            assert_same_outputs(got, ref, ATOL)
            for g, r in zip(got, ref):
                np.testing.assert_array_equal(
                    g.outputs[0].routed_experts, r.outputs[0].routed_experts
                )
        assert [o.num_cached_tokens for o in got] == [32, 48]  # from the snapshots
    finally:
        pair.close()


def test_gpt_oss_kv_groups_match_tp1_through_the_prefix_cache(ray_cluster, tmp_path_factory):
    """gpt-oss at TP=2 with its sliding and full layers in separate KV cache groups (4-token
    blocks, window 8: the sliding group frees blocks as it decodes, on every rank); the second
    run's prefix hits take both groups' blocks."""
    model_dir = make_gpt_oss(tmp_path_factory.mktemp("tp_gpt_oss"))
    pair = tp_pair(
        model_dir, block_size=4, max_num_batched_tokens=16, enable_return_routed_experts=True
    )
    tp = next(pair)
    try:
        assert tp.tp2.block_manager.windows == (None, 8)
        prompts = prompts_for(tp.tp1.validator.vocab_size, (17, 33), seed=19)
        params = greedy(24, logprobs=1, return_routed_experts=True)
        for _ in range(2):
            ref = tp.tp1.generate(prompts, params, use_tqdm=False)
            got = tp.tp2.generate(prompts, params, use_tqdm=False)
            assert_same_outputs(got, ref, ATOL)
            for g, r in zip(got, ref):
                np.testing.assert_array_equal(
                    g.outputs[0].routed_experts, r.outputs[0].routed_experts
                )
        assert [o.num_cached_tokens for o in got] == [16, 32]
    finally:
        pair.close()


@pytest.fixture(scope="class")
def dsa(ray_cluster, tiny_dsa_dir):
    yield from tp_pair(tiny_dsa_dir, enable_return_indexer_topk=True)


class TestDeepseekV32:
    def test_greedy_and_indexer_topk_match_tp1(self, dsa):
        """DSA at TP=2: heads split, latent rows and indexer (weights, keys) replicated, so
        every rank picks the same positions as TP=1."""
        prompts = prompts_for(dsa.tp1.validator.vocab_size, LENGTHS)
        params = greedy(8, logprobs=1, return_indexer_topk=True)
        ref = dsa.tp1.generate(prompts, params, use_tqdm=False)
        got = dsa.tp2.generate(prompts, params, use_tqdm=False)
        assert_same_outputs(got, ref, ATOL)
        for g, r in zip(got, ref):
            np.testing.assert_array_equal(g.outputs[0].indexer_topk, r.outputs[0].indexer_topk)
