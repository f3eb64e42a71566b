"""Draft-model speculation changes no token: against the engine without speculation (the
reference). A draft that is the target has every draft accepted (counted on the wire); a
draft with other weights gives the same greedy and seeded outputs, under async scheduling
and preemption too, and across a weight update of the target."""

from __future__ import annotations

import numpy as np
import pytest
from raylane.actors.engine import SamplingParams

from tests.hf_reference import perturbed_model
from tests.tiny_models import make_llama
from tests.unit.spec.helpers import Tap, make_loopy_llama, on_results, spec_engine
from tests.unit.spec.test_parity import K, assert_same, greedy
from tests.unit.spec.test_rl import run_with_update


def draft_spec(path: str) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": K, "adaptive": False}


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory) -> str:
    """Other weights (attention scaled to 0.03 instead of 0.05): its argmax sometimes agrees
    with the target's (noise on every weight gives a draft that is almost never right)."""
    return make_loopy_llama(tmp_path_factory.mktemp("draft") / "model", attention_scale=0.03)


def test_draft_that_is_the_target_accepts_everything(loopy_dir, reference, prompts):
    params = greedy(max_tokens=24)
    ref = reference.generate(prompts, params, use_tqdm=False)
    engine = spec_engine(loopy_dir, draft_spec(loopy_dir))
    tap = Tap(engine, K)
    assert_same(ref, engine.generate(prompts, params, use_tqdm=False))
    stats = engine.stats
    assert tap.num_draft_tokens > 0
    assert tap.num_accepted == tap.num_draft_tokens == stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens == tap.num_accepted
    assert stats.spec_decode_num_accepted_tokens_per_pos == tap.per_pos
    engine.shutdown()


@pytest.mark.parametrize(
    "options",
    [{}, {"async_scheduling": True}, {"num_kv_blocks": 9}],
    ids=["serial", "async", "preemption"],
)
def test_other_draft_greedy_and_seeded_parity(loopy_dir, other_dir, reference, prompts, options):
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=24, logprobs=2, ignore_eos=True)
    ref = reference.generate(prompts, greedy(max_tokens=24), use_tqdm=False)
    ref_seeded = reference.generate(prompts, seeded, use_tqdm=False)
    engine = spec_engine(loopy_dir, draft_spec(other_dir), **options)
    tap = Tap(engine, K)
    assert_same(ref, engine.generate(prompts, greedy(max_tokens=24), use_tqdm=False))
    assert_same(ref_seeded, engine.generate(prompts, seeded, use_tqdm=False))
    # both paths ran: some drafts accepted, some rejected (and their KV rolled back)
    assert 0 < tap.num_accepted < tap.num_draft_tokens
    if "num_kv_blocks" in options:
        assert engine.scheduler.num_preemptions > 0
    engine.shutdown()


def test_target_weight_update_keeps_outputs_exact(
    loopy_dir, other_dir, reference, prompts, tmp_path
):
    """The draft keeps its own weights (older than the target's after the update): it may
    accept less, never change a token."""
    _, weights = perturbed_model(loopy_dir, str(tmp_path / "v1"), 5, scale=0.01)
    _, v0 = perturbed_model(loopy_dir, str(tmp_path / "v0"), 0, 0.0)
    engine = spec_engine(loopy_dir, draft_spec(other_dir))
    for prompt in prompts[:2]:
        got, at = run_with_update(engine, prompt, weights, 16)
        want, ref_at = run_with_update(reference, prompt, weights, at)
        assert at == ref_at
        a, b = got.outputs[0], want.outputs[0]
        assert a.token_ids == b.token_ids
        assert a.weight_versions == b.weight_versions
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
        for e in (engine, reference):
            e.update_weights(v0, version=e.weight_version + 1)
    assert engine.stats.spec_decode_num_accepted_tokens > 0
    engine.shutdown()


def test_draft_with_another_vocabulary_is_refused(loopy_dir, tmp_path):
    path = make_llama(tmp_path / "small", vocab_size=300)
    with pytest.raises(ValueError, match="speculative_config.model"):
        spec_engine(loopy_dir, draft_spec(path))
    with pytest.raises(ValueError, match="speculative_config.model"):
        spec_engine(loopy_dir, {"method": "draft_model", "num_speculative_tokens": 2})


def test_rejected_drafts_are_rolled_back(loopy_dir, other_dir, prompts):
    """Every draft the runner's draft model drew, after rejected drafts (their KV in its pool
    written over later) and after all-accepted runs (its pool a position behind), is what
    HF's greedy generate of the draft from scratch gives for the sequence's tokens then."""
    import torch
    from transformers import AutoModelForCausalLM

    engine = spec_engine(loopy_dir, draft_spec(other_dir))
    steps: list[tuple[int, list[int], int]] = []  # (tokens made before, drafts, accepted)
    made = [0]

    def record(result) -> None:
        if result.token_ids[0] is None:
            return
        extra = len(result.extra[0].token_ids) if result.extra[0] is not None else 0
        if result.drafts and result.drafts[0] is not None:
            steps.append((made[0], list(result.drafts[0]), extra))
        made[0] += 1 + extra

    on_results(engine, lambda plan, result: record(result))
    prompt = list(prompts[1])
    out = engine.generate([prompt], greedy(max_tokens=32), use_tqdm=False)[0].outputs[0]
    engine.shutdown()
    tokens = prompt + out.token_ids
    hf = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32)
    for before, drafts, _ in steps:
        ids = tokens[: len(prompt) + before]
        want: list[int] = []  # greedy, one full forward per token (EOS is a token like any)
        with torch.inference_mode():
            for _ in drafts:
                want.append(int(hf(torch.tensor([ids + want])).logits[0, -1].argmax()))
        assert drafts == want, before
    # rejections, then drafts again (an all-accepted run, the pool a position behind after
    # it, is test_draft_that_is_the_target_accepts_everything's every step)
    assert any(a < len(d) for _, d, a in steps[:-1])


def test_block_budget_pays_for_the_draft_pool(loopy_dir, reference, prompts, tmp_path):
    """A smaller draft (1 layer, random weights): its pool has the target's blocks, and the
    memory budget pays for both per block (from the HF configs: 2 x layers x KV heads x
    head dim x 4 bytes per token); outputs stay the target's."""
    from transformers import AutoConfig

    small = make_llama(tmp_path / "small", seed=3, num_hidden_layers=1)

    def per_token(path: str) -> int:
        c = AutoConfig.from_pretrained(path)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4

    gb = 0.002
    engine = spec_engine(loopy_dir, draft_spec(small), num_kv_blocks=None, kv_cache_memory_gb=gb)
    both = per_token(loopy_dir) + per_token(small)
    assert engine.runner_info.kv_bytes_per_token == both
    assert engine.runner_info.num_kv_blocks == int(gb * 2**30) // (both * 16)
    params = greedy(max_tokens=16)
    want = reference.generate(prompts, params, use_tqdm=False)  # (its version may be > 0)
    for a, b in zip(want, engine.generate(prompts, params, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].logprobs, b.outputs[0].logprobs, atol=1e-4)
    engine.shutdown()


def test_sleep_releases_and_restores_the_draft(loopy_dir, prompts):
    """Sleep level 2 frees both pools and spills both models' weights; after wake-up the
    draft (the target itself) still has every draft accepted, and outputs are unchanged."""
    engine = spec_engine(loopy_dir, draft_spec(loopy_dir))
    params = greedy(max_tokens=16)
    before = engine.generate(prompts[:2], params, use_tqdm=False)
    sums = engine.upkeep.weight_checksums()
    engine.upkeep.sleep(2)
    engine.upkeep.wake_up()
    assert engine.upkeep.weight_checksums() == sums
    tap = Tap(engine, K)
    assert_same(before, engine.generate(prompts[:2], params, use_tqdm=False))
    assert 0 < tap.num_accepted == tap.num_draft_tokens
    engine.shutdown()


def test_prefix_cache_hits_recompute_the_draft_rows(loopy_dir, reference, prompts):
    """A prompt sent again hits the prefix cache, whose blocks' draft rows this sequence did
    not write: the draft (the target itself) recomputes them and still has every draft
    accepted; tokens are the reference's."""
    engine = spec_engine(loopy_dir, draft_spec(loopy_dir))
    params = greedy(max_tokens=16)
    want = reference.generate(prompts[3:], params, use_tqdm=False)
    engine.generate(prompts[3:], params, use_tqdm=False)
    tap = Tap(engine, K)
    got = engine.generate(prompts[3:], params, use_tqdm=False)
    assert got[0].num_cached_tokens > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert 0 < tap.num_accepted == tap.num_draft_tokens
    engine.shutdown()
