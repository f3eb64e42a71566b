"""Chained MTP steps (k = 3) on the linear-attention models' MTP module (Qwen3.5, Qwen3.5-MoE,
Qwen3-Next): the chained steps run only the MTP block's full attention (its own paged K/V),
never the main model's recurrent state. Greedy tokens and logprobs equal the engine without
speculation (serial, async, preemption under a tight pool), every plan's drafts equal a naive
chain from the checkpoint's tensors (test_qwen_mtp.NaiveMtp), and with an MTP module that
predicts well, drafts at positions 2 and 3 are accepted (counted from the plans and results,
so a runner that drafted one token per step fails)."""

from __future__ import annotations

import pytest
from raylane.actors.engine import SamplingParams

from tests.tiny_models import make_qwen3_5, make_qwen3_5_moe, make_qwen3_next
from tests.unit.spec.helpers import Tap, make_loopy, spec_engine
from tests.unit.spec.test_linear_attention import echo_prompts
from tests.unit.spec.test_mtp import MTP, record_drafts
from tests.unit.spec.test_parity import assert_same
from tests.unit.spec.test_qwen_mtp import NaiveMtp, add_mtp

K = 3
CHAINED = {**MTP, "num_speculative_tokens": K}
GREEDY = SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True)


def run_against_no_speculation(path: str, **options):
    """(engine with k = 3 chained MTP drafts, the plans' (tokens, drafts), its Tap), after its
    greedy output (tokens, logprobs) was checked against the engine without speculation."""
    reference = spec_engine(path, None)
    prompts = echo_prompts(reference, count=2)
    ref = reference.generate(prompts, GREEDY, use_tqdm=False)
    reference.shutdown()
    engine = spec_engine(path, CHAINED, max_num_batched_tokens=32, **options)
    seen, tap = record_drafts(engine), Tap(engine, K)
    assert_same(ref, engine.generate(prompts, GREEDY, use_tqdm=False))
    stats = engine.stats
    assert tap.num_draft_tokens == stats.spec_decode_num_draft_tokens
    assert tap.per_pos == stats.spec_decode_num_accepted_tokens_per_pos
    assert max(len(d) for _, d in seen) == K  # chained: k drafts per plan
    if "num_kv_blocks" in options:
        assert engine.scheduler.num_preemptions > 0
    return engine, seen, tap


@pytest.mark.parametrize(
    "make, options",
    [
        (make_qwen3_5, {}),
        (make_qwen3_5_moe, {"async_scheduling": True}),
        (make_qwen3_next, {"async_scheduling": True, "num_kv_blocks": 7}),
    ],
    ids=["qwen3_5", "qwen3_5_moe-async", "qwen3_next-async-tight"],
)
def test_chained_drafts_equal_a_naive_chain(tmp_path, make, options):
    """A noisy MTP module (drafts mostly rejected): every plan's drafts are the naive chain's
    from the sequence's tokens at that step (so the chained steps' cache rows, written over
    by later steps, hold what a recomputation gives). A tight pool leaves some rows without
    the chain's reserved slots (fewer drafts there)."""
    path = add_mtp(make_loopy(make(tmp_path / "model")))
    engine, seen, _ = run_against_no_speculation(path, **options)
    engine.shutdown()
    naive = NaiveMtp(path)
    for tokens, drafts in seen:
        assert drafts == naive.drafts(tokens, len(drafts))


@pytest.fixture(scope="module")
def predicting(tmp_path_factory) -> str:
    """Qwen3.5 whose next token depends almost only on the current one (token mixers x 0.01,
    MLPs off) and an MTP module that is an exact copy of that path (block = the full layer,
    `fc` passing the embedding, norms as the model's): its chained drafts are mostly right,
    while attention and the recurrent state still move the logprobs."""
    path = make_loopy(make_qwen3_5(tmp_path_factory.mktemp("qwen3_5")), attention_scale=0.01)
    return add_mtp(path, scale=0.0)


@pytest.mark.parametrize(
    "options",
    [{}, {"async_scheduling": True}, {"num_kv_blocks": 5}],
    ids=["serial", "async", "preemption"],
)
def test_chained_drafts_accepted(predicting, options):
    engine, _, tap = run_against_no_speculation(predicting, **options)
    engine.shutdown()
    assert 0 < tap.num_accepted < tap.num_draft_tokens  # accepted and rejected
    assert tap.per_pos[1] > 0 and tap.per_pos[2] > 0  # chained drafts accepted
