"""Sliding-window models through the engine against Hugging Face: greedy ids and raw logprobs,
with prompts longer than the window and than a prefill chunk, in mixed batches."""

from __future__ import annotations

import numpy as np
import pytest

from tests.hf_reference import hf_router_topk
from tests.tiny_models import make_gemma3, make_gpt_oss
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


def test_gpt_oss_chunked_batch_matches_hf_with_routing(tmp_path_factory) -> None:
    model_dir = make_gpt_oss(tmp_path_factory.mktemp("tiny_gpt_oss"))  # window 8, sinks
    engine = engine_for(model_dir, max_num_batched_tokens=16, enable_return_routed_experts=True)
    prompts = prompts_for(engine.validator.vocab_size, seed=1, count=4)
    outs = engine.generate(prompts, greedy(return_routed_experts=True), use_tqdm=False)
    assert_matches_hf(model_dir, prompts, outs)
    assert_routing_matches_hf(model_dir, prompts, outs, num_moe_layers=2, top_k=2)


def assert_routing_matches_hf(model_dir: str, prompts, outs, num_moe_layers: int, top_k: int):
    """Every input position's routed experts equal HF's router picks (order within k free)."""
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        fed = prompt + got.token_ids[:-1]  # the last sampled token is never fed to the model
        ref = hf_router_topk(model_dir, fed).numpy()
        assert got.routed_experts.shape == (len(fed), num_moe_layers, top_k)
        assert np.array_equal(np.sort(got.routed_experts, -1), np.sort(ref, -1))


def test_sliding_only_model_holds_o_window_blocks(tmp_path_factory) -> None:
    # every layer slides (window 8): blocks wholly before the window are freed as decode goes,
    # so a sequence holds a few 4-token blocks however long it grows, and tokens still equal HF
    model_dir = make_gemma3(
        tmp_path_factory.mktemp("tiny_gemma3_sliding"),
        num_hidden_layers=2,
        layer_types=["sliding_attention", "sliding_attention"],
    )
    engine = engine_for(model_dir, block_size=4, max_num_batched_tokens=16)
    assert engine.block_manager.windows == (8,)
    prompts = prompts_for(engine.validator.vocab_size, seed=4, count=2)  # 17 and 33 tokens
    blocks = engine.block_manager
    held: list[int] = []
    allocate = blocks.allocate

    def allocate_and_count(seq, num_new):  # blocks in use right after each allocation
        allocate(seq, num_new)
        held.append(blocks.num_blocks - blocks.num_free_blocks)

    blocks.allocate = allocate_and_count  # type: ignore[method-assign]
    outs = engine.generate(prompts, greedy(64), use_tqdm=False)
    assert_matches_hf(model_dir, prompts, outs, max_new=64)
    # 97 tokens is 25 blocks for the longer sequence alone; the window (2 blocks), the block
    # being written, a chunk's reach (16 tokens: 4 blocks) and the chain's root bound it
    assert max(held[-20:]) <= 2 * (2 + 2)
    assert max(held) <= 2 * (2 + 4 + 2) < 25


def test_sliding_only_model_under_speculation(tmp_path) -> None:
    # every layer slides (window 8) and n-gram drafts are accepted and rejected, under async
    # scheduling: the blocks outside the window are still freed, and tokens and logprobs are
    # the run without speculation's. A draft model attends over the one table with a reach
    # of its own: there every block is kept, and the tokens are the same.
    from tests.unit.spec.helpers import make_echo
    from tests.unit.test_mixed_window_models import (
        K,
        assert_same,
        assert_spec_ran,
        generate_counting_blocks,
        mixed_engine,
        spec_run,
    )

    sliding = ["sliding_attention", "sliding_attention"]
    model_dir = make_echo(make_gpt_oss(tmp_path / "echo", layer_types=sliding))
    ref_engine = mixed_engine(model_dir, async_scheduling=False)
    assert ref_engine.block_manager.windows == (8,)
    prompts = prompts_for(ref_engine.validator.vocab_size, seed=4, count=2)  # 17, 33 tokens
    ref = ref_engine.generate(prompts, greedy(48), use_tqdm=False)
    ref_engine.shutdown()
    engine = spec_run(model_dir, {"method": "ngram"}, num_kv_blocks=14)  # 81 tokens: 21 blocks
    outs, held = generate_counting_blocks(engine, prompts, greedy(48))
    assert_same(outs, ref, atol=1e-4)
    assert_spec_ran(engine)
    # decoding: the window and its slack (9 positions) and K drafts, in 4-token blocks, and
    # the hash chain's root (5 blocks), of the 21 the longer sequence would hold
    decoding = [live for live, _, covered in held if covered > 40]
    assert decoding and max(decoding) <= -(-(8 + 1 + K) // 4) + 2
    engine.shutdown()
    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": K}
    engine = mixed_engine(model_dir, speculative_config=spec, num_kv_blocks=64)
    assert not engine.block_manager.frees_windows
    assert_same(engine.generate(prompts, greedy(48), use_tqdm=False), ref, atol=1e-4)
    engine.shutdown()
