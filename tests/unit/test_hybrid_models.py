"""Linear-attention (Gated DeltaNet) models through the engine against Hugging Face: greedy ids
and raw logprobs with chunked prefill carrying state across chunks, mixed prefill / decode
batches, and preemption under a tight KV and state budget."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from raylane.actors.models import TPGroup, load_model
from raylane.actors.models.layer_layout import model_layout
from safetensors.torch import load_file
from transformers import AutoConfig

from tests.hf_reference import hf_greedy
from tests.support.faults import arm_fault
from tests.tiny_models import make_qwen3_5, make_qwen3_5_moe, make_qwen3_next
from tests.unit.test_engine_parity import assert_matches_hf, engine_for, greedy, prompts_for
from tests.unit.test_windowed_models import assert_routing_matches_hf


@pytest.fixture(scope="module")
def tiny_qwen3_5_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_qwen3_5(tmp_path_factory.mktemp("tiny_qwen3_5"))


def test_qwen3_5_chunked_batch_matches_hf(tiny_qwen3_5_dir: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="raylane.actors.engine.setup")
    # chunks of at most 16 tokens: every prompt but the first spans several steps
    engine = engine_for(tiny_qwen3_5_dir, max_num_batched_tokens=16, max_num_seqs=8)
    assert "8 sequences run at once" in caplog.text  # the start-up log line
    # the config-derived layout (memory accounting) against the pools the runner allocated
    layout = model_layout(AutoConfig.from_pretrained(tiny_qwen3_5_dir), 4)  # float32
    assert layout.kinds == {"linear", "full"} and engine.runner_info.num_state_slots == 8
    assert layout.state_bytes == engine.runner_info.state_bytes_per_seq > 0
    prompts = prompts_for(engine.validator.vocab_size, count=5)
    # NOTE: HF first: in a fresh process the engine's first steps on this model ran far slower
    # until transformers had run once (docs/benchmarks.md, open anomaly); only a time cost
    hf_greedy(tiny_qwen3_5_dir, prompts[0], 1)
    outs = engine.generate(prompts, greedy(), use_tqdm=False)
    assert_matches_hf(tiny_qwen3_5_dir, prompts, outs)


def test_qwen3_5_preemption_under_tight_budget_matches_hf(tiny_qwen3_5_dir: str) -> None:
    # room for ~2 sequences' KV at a time, and 3 state slots under max_num_seqs=8: the
    # scheduler admits no more than 3 (the rest wait), and preempted sequences recompute
    engine = engine_for(
        tiny_qwen3_5_dir,
        max_num_batched_tokens=32,
        num_kv_blocks=10,
        max_num_seqs=8,
        num_state_slots=3,
    )
    assert engine.runner_info.num_state_slots == 3
    running: list[int] = []
    schedule = engine.scheduler.schedule

    def schedule_and_count():
        out = schedule()
        running.append(len(engine.scheduler.running))
        return out

    engine.scheduler.schedule = schedule_and_count  # type: ignore[method-assign]
    prompts = prompts_for(engine.validator.vocab_size, seed=1, count=5)
    outs = engine.generate(prompts, greedy(20), use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    assert max(running) == 3
    assert_matches_hf(tiny_qwen3_5_dir, prompts, outs, max_new=20)


# Qwen3.5-MoE: every layer MoE. Qwen3-Next: fused per-key-head projections regrouped at load,
# MoE on layers 0 and 2, layer 1 dense (mlp_only_layers)
@pytest.mark.parametrize(
    "make,num_moe_layers,seed", [(make_qwen3_5_moe, 3, 2), (make_qwen3_next, 2, 6)]
)
def test_moe_variants_match_hf_with_routing(make, num_moe_layers, seed, tmp_path_factory) -> None:
    model_dir = make(tmp_path_factory.mktemp("tiny_hybrid_moe"))
    engine = engine_for(model_dir, max_num_batched_tokens=16, enable_return_routed_experts=True)
    prompts = prompts_for(engine.validator.vocab_size, seed=seed, count=3)
    hf_greedy(model_dir, prompts[0], 1)  # HF first, as above
    outs = engine.generate(prompts, greedy(8, return_routed_experts=True), use_tqdm=False)
    assert_matches_hf(model_dir, prompts, outs, max_new=8)
    assert_routing_matches_hf(model_dir, prompts, outs, num_moe_layers, top_k=2)


# async == serial; the graph runner's replay (static buffers, each row's state slot, padding
# rows on the scratch slot; eager on the CPU) == eager
@pytest.mark.parametrize(
    "option,reference,variant", [("async_scheduling", False, True), ("enforce_eager", True, False)]
)
def test_qwen3_5_variant_equals_reference(tiny_qwen3_5_dir: str, option, reference, variant):
    engines = [
        engine_for(tiny_qwen3_5_dir, max_num_batched_tokens=16, **{option: value})
        for value in (reference, variant)
    ]
    prompts = prompts_for(engines[0].validator.vocab_size, seed=3, count=3)
    runs = [engine.generate(prompts, greedy(), use_tqdm=False) for engine in engines]
    for ref, got in zip(*runs):
        assert ref.outputs[0].token_ids == got.outputs[0].token_ids
        assert ref.outputs[0].logprobs == got.outputs[0].logprobs
    if option == "enforce_eager":  # 3 decoding rows replay padded to 4
        assert engines[1].stats.graph_replays > 0 == engines[0].stats.graph_replays


def test_qwen3_5_prefix_cache_warm_equals_cold_next_turn_and_new_weights(
    tiny_qwen3_5_dir: str, tmp_path_factory
) -> None:
    cold_engine = engine_for(
        tiny_qwen3_5_dir, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    assert cold_engine.block_manager.snapshots is None
    engine = engine_for(tiny_qwen3_5_dir, max_num_batched_tokens=16)
    rng, vocab = random.Random(5), engine.validator.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(37)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (5, 12, 30)]
    cold = cold_engine.generate(prompts, greedy(), use_tqdm=False)
    engine.generate(prompts[:1], greedy(), use_tqdm=False)  # snapshots its state at 32 tokens
    warm = engine.generate(prompts, greedy(), use_tqdm=False)
    # the other prompts resumed from that snapshot, the first from its own
    assert engine.block_manager.num_hits >= 3 * 32
    for c, w in zip(cold, warm):
        assert w.num_cached_tokens >= 32
        assert w.outputs[0].token_ids == c.outputs[0].token_ids
        assert np.allclose(w.outputs[0].logprobs, c.outputs[0].logprobs, atol=1e-5)
    # a conversation's next turn: turn 1 (20 prompt tokens + 40 generated, so 59 computed)
    # publishes its state at 48 (a decode step ending on a block) when it ends; turn 2
    # extends turn 1 and resumes there
    first = [rng.randrange(3, vocab) for _ in range(20)]
    said = engine.generate([first], greedy(40), use_tqdm=False)[0].outputs[0].token_ids
    turn = first + said + [rng.randrange(3, vocab) for _ in range(7)]
    warm_turn = engine.generate([turn], greedy(), use_tqdm=False)[0]
    assert warm_turn.num_cached_tokens == 48  # the prompt's own boundary alone would give 16
    ref = cold_engine.generate([turn], greedy(), use_tqdm=False)[0].outputs[0]
    assert warm_turn.outputs[0].token_ids == ref.token_ids
    assert np.allclose(warm_turn.outputs[0].logprobs, ref.logprobs, atol=1e-5)
    # new weights: the snapshots (and cached KV) of the old ones must not be used
    other_dir = make_qwen3_5(tmp_path_factory.mktemp("tiny_qwen3_5_other"), seed=1)
    engine.load_weights(load_file(f"{other_dir}/model.safetensors").items())
    assert not engine.block_manager.snapshots.by_hash
    again = engine.generate(prompts, greedy(), use_tqdm=False)
    assert_matches_hf(other_dir, prompts, again)


def test_qwen3_5_tp_slices_follow_the_heads(tiny_qwen3_5_dir: str) -> None:
    """Each TP=2 rank's Gated DeltaNet and gated-attention weights are its heads' rows of the
    checkpoint, cut by plain indexing here (TP=2 outputs vs TP=1: tests/ray, Qwen3-Next)."""
    raw = load_file(f"{tiny_qwen3_5_dir}/model.safetensors")
    cfg = AutoConfig.from_pretrained(tiny_qwen3_5_dir)
    key, value = cfg.linear_num_key_heads * 16, cfg.linear_num_value_heads * 8  # dk 16, dv 8

    def half(t: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
        return t.chunk(2, dim)[rank]

    for rank in (0, 1):
        model, _, _ = load_model(tiny_qwen3_5_dir, "float32", "cpu", TPGroup(rank, 2))
        got = dict(model.named_parameters())
        lin, att = "model.layers.0.self_attn", "model.layers.2.self_attn"
        raw_lin = "model.layers.0.linear_attn"
        for name in ("in_proj_qkv.weight", "conv1d.weight"):  # q | k | v, each by heads
            q, k, v = raw[f"{raw_lin}.{name}"].split([key, key, value])
            want = torch.cat([half(q, rank), half(k, rank), half(v, rank)])
            assert torch.equal(got[f"{lin}.{name}"], want), name
        for name in ("in_proj_z.weight", "in_proj_b.weight", "dt_bias", "A_log"):
            assert torch.equal(got[f"{lin}.{name}"], half(raw[f"{raw_lin}.{name}"], rank)), name
        assert torch.equal(got[f"{lin}.norm.weight"], raw[f"{raw_lin}.norm.weight"])
        want_out = half(raw[f"{raw_lin}.out_proj.weight"], rank, 1)
        assert torch.equal(got[f"{lin}.out_proj.weight"], want_out)
        for name in ("q_proj.weight", "k_proj.weight"):  # q rows are per head [q | gate]
            assert torch.equal(got[f"{att}.{name}"], half(raw[f"{att}.{name}"], rank)), name


def test_a_failed_step_drops_the_state_snapshots(tiny_qwen3_5_dir: str) -> None:
    # its snapshot saves and copies may not have run: no later request may resume from them
    engine = engine_for(tiny_qwen3_5_dir, max_num_batched_tokens=64)
    prompts = prompts_for(engine.validator.vocab_size, seed=9, count=2)
    first = engine.generate(prompts, greedy(4), use_tqdm=False)
    assert engine.block_manager.snapshots.by_hash
    arm_fault(engine, "forward")
    failed = engine.generate(prompts, greedy(4), use_tqdm=False)
    assert {o.outputs[0].finish_reason for o in failed} == {"error"}
    assert not engine.block_manager.snapshots.by_hash
    again = engine.generate(prompts, greedy(4), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
