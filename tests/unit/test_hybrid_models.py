"""Linear-attention (Gated DeltaNet) models through the engine against Hugging Face: greedy ids
and raw logprobs with chunked prefill carrying state across chunks, mixed prefill / decode
batches, and preemption under a tight KV and state budget."""

from __future__ import annotations

import logging

import pytest

from tests.tiny_models import make_qwen3_5
from tests.unit.test_engine_parity import assert_matches_hf, engine_for, greedy, prompts_for


@pytest.fixture(scope="module")
def tiny_qwen3_5_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_qwen3_5(tmp_path_factory.mktemp("tiny_qwen3_5"))


def test_qwen3_5_chunked_batch_matches_hf(tiny_qwen3_5_dir: str, caplog) -> None:
    caplog.set_level(logging.INFO, logger="raylane.actors.engine.setup")
    # chunks of at most 16 tokens: every prompt but the first spans several steps
    engine = engine_for(tiny_qwen3_5_dir, max_num_batched_tokens=16, max_num_seqs=8)
    assert "8 sequences run at once" in caplog.text  # the start-up log line
    prompts = prompts_for(engine.validator.vocab_size, count=5)
    outs = engine.generate(prompts, greedy(), use_tqdm=False)
    assert_matches_hf(tiny_qwen3_5_dir, prompts, outs)
    assert engine.block_manager.num_hits == 0  # no state snapshots yet: prefix caching is off


def test_qwen3_5_preemption_under_tight_budget_matches_hf(tiny_qwen3_5_dir: str) -> None:
    # room for ~2 sequences' KV at a time and 3 state slots: preempted sequences recompute
    engine = engine_for(
        tiny_qwen3_5_dir, max_num_batched_tokens=32, num_kv_blocks=10, max_num_seqs=3
    )
    prompts = prompts_for(engine.validator.vocab_size, seed=1, count=5)
    outs = engine.generate(prompts, greedy(20), use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    assert_matches_hf(tiny_qwen3_5_dir, prompts, outs, max_new=20)


def test_layout_state_bytes_match_the_runner_pools(tiny_qwen3_5_dir: str) -> None:
    """The config-derived layout (memory accounting) against the tensors the runner allocates."""
    from raylane.actors.models.layer_layout import model_layout
    from transformers import AutoConfig

    engine = engine_for(tiny_qwen3_5_dir, max_num_seqs=4)
    info = engine.runner_info
    layout = model_layout(AutoConfig.from_pretrained(tiny_qwen3_5_dir), 4)  # float32
    assert info.num_state_slots == 4
    assert layout.state_bytes == info.state_bytes_per_seq > 0
    assert layout.kinds == {"linear", "full"}
