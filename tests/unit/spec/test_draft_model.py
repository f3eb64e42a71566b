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
from tests.unit.spec.helpers import Tap, make_loopy_llama, spec_engine
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


def test_rejected_drafts_are_rolled_back(other_dir, prompts):
    """After rejected drafts, the proposer's cropped cache proposes what HF's greedy
    generate from scratch (no cache of ours) gives for the sequence's tokens now."""
    import torch
    from raylane.actors.engine.spec.draft_model import DraftModelProposer
    from transformers import AutoModelForCausalLM

    proposer = DraftModelProposer(other_dir, target_vocab_size=len_vocab(other_dir))
    hf = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32)
    tokens = list(prompts[1])
    for step in range(4):
        drafts, _ = proposer.propose(7, tokens, K)
        ids = torch.tensor([tokens])
        want = hf.generate(ids, max_new_tokens=K, do_sample=False, min_new_tokens=K)
        assert drafts == want[0, len(tokens) :].tolist()
        # accept `step` drafts (0: all rejected), then a token the draft did not propose
        tokens += drafts[:step] + [(drafts[step] + 1) % 100]


def len_vocab(path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).vocab_size
