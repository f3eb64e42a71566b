"""Sliding-window models through the engine against Hugging Face: greedy ids and raw logprobs,
with prompts longer than the window and than a prefill chunk, in mixed batches."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_gemma3
from tests.unit.test_engine_parity import assert_matches_hf, engine_for, greedy, prompts_for


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_gemma3(tmp_path_factory.mktemp("tiny_gemma3"))  # window 8


def test_gemma3_chunked_batch_matches_hf(tiny_gemma3_dir: str) -> None:
    # chunks of at most 16 tokens; every prompt is longer than the window, most than a chunk
    engine = engine_for(tiny_gemma3_dir, max_num_batched_tokens=16)
    prompts = prompts_for(engine.validator.vocab_size, count=4)
    outs = engine.generate(prompts, greedy(), use_tqdm=False)
    assert_matches_hf(tiny_gemma3_dir, prompts, outs)
    # the same prompts again: served from the prefix cache, the same tokens
    again = engine.generate(prompts, greedy(), use_tqdm=False)
    assert engine.block_manager.num_hits > 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
