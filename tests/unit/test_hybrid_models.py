"""Linear-attention (Gated DeltaNet) models through the engine against Hugging Face: greedy ids
and raw logprobs with chunked prefill carrying state across chunks, mixed prefill / decode
batches, and preemption under a tight KV and state budget."""

from __future__ import annotations

import logging

import pytest
from raylane.actors.models.layer_layout import model_layout
from transformers import AutoConfig

from tests.hf_reference import hf_greedy
from tests.tiny_models import make_qwen3_5, make_qwen3_5_moe
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
    assert engine.block_manager.num_hits == 0  # no state snapshots yet: prefix caching is off


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


def test_qwen3_5_moe_matches_hf_with_routing(tmp_path_factory) -> None:
    model_dir = make_qwen3_5_moe(tmp_path_factory.mktemp("tiny_qwen3_5_moe"))
    engine = engine_for(model_dir, max_num_batched_tokens=16, enable_return_routed_experts=True)
    prompts = prompts_for(engine.validator.vocab_size, seed=2, count=3)
    hf_greedy(model_dir, prompts[0], 1)  # HF first, as above
    outs = engine.generate(prompts, greedy(8, return_routed_experts=True), use_tqdm=False)
    assert_matches_hf(model_dir, prompts, outs, max_new=8)
    assert_routing_matches_hf(model_dir, prompts, outs, num_moe_layers=3, top_k=2)


def test_qwen3_5_async_scheduling_equals_serial(tiny_qwen3_5_dir: str) -> None:
    prompts = prompts_for(engine_for(tiny_qwen3_5_dir).validator.vocab_size, seed=3, count=4)
    runs = [
        engine_for(tiny_qwen3_5_dir, max_num_batched_tokens=16, async_scheduling=mode).generate(
            prompts, greedy(), use_tqdm=False
        )
        for mode in (False, True)
    ]
    for serial, ahead in zip(*runs):
        assert serial.outputs[0].token_ids == ahead.outputs[0].token_ids
        assert serial.outputs[0].logprobs == ahead.outputs[0].logprobs
