"""Speculative decoding on linear-attention (Gated DeltaNet) models: rejected drafts leave
nothing in the recurrent and conv state. The reference is the same model decoded without
speculation: greedy tokens equal, logprobs within 1e-4, with drafts both accepted and
rejected (counted on the wire), async scheduling on, prefix-cache hits on state snapshots
and preemption under a tight KV and state budget."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_qwen3_5, make_qwen3_next
from tests.unit.async_helpers import prompts_for
from tests.unit.spec.helpers import Tap, make_loopy, spec_engine
from tests.unit.spec.test_parity import NGRAM, SUFFIX, assert_same, greedy

K = NGRAM["num_speculative_tokens"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    # token mixers scaled down, MLPs off: greedy output repeats itself (drafts get
    # accepted), while a wrong recurrent state still moves every logprob
    return make_loopy(make_qwen3_5(tmp_path_factory.mktemp("qwen3_5")))


@pytest.fixture(scope="module")
def reference(qwen_dir):
    engine = spec_engine(qwen_dir, None)
    yield engine
    engine.shutdown()


def echo_prompts(engine, count: int = 4) -> list[list[int]]:
    """prompt + its own greedy answer + prompt: the answer comes again, mostly (drafts from
    the prompt are accepted, then rejected where the longer context changes a token)."""
    base = prompts_for(engine.validator.vocab_size, (9, 17, 30, 45)[:count])
    outs = engine.generate(base, greedy(24), use_tqdm=False)
    return [p + o.outputs[0].token_ids + p for p, o in zip(base, outs)]


@pytest.fixture(scope="module")
def prompts(reference) -> list[list[int]]:
    return echo_prompts(reference)


def run_counted(engine, prompts, params):
    tap = Tap(engine, K)
    out = engine.generate(prompts, params, use_tqdm=False)
    stats = engine.stats
    # both paths ran: some drafts accepted, some rejected
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_draft_tokens == tap.num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens == tap.num_accepted
    assert stats.spec_decode_num_accepted_tokens_per_pos == tap.per_pos
    return out


@pytest.mark.parametrize(
    "spec, async_scheduling",
    [(NGRAM, False), (SUFFIX, True)],
    ids=["ngram-serial", "suffix-async"],
)
def test_greedy_output_equals_no_speculation(qwen_dir, reference, prompts, spec, async_scheduling):
    params = greedy(32)
    ref = reference.generate(prompts, params, use_tqdm=False)
    engine = spec_engine(qwen_dir, spec, async_scheduling=async_scheduling)
    assert_same(ref, run_counted(engine, prompts, params))
    engine.shutdown()


def test_preemption_under_a_tight_budget(qwen_dir, reference, prompts):
    """KV for about two sequences and three state slots: preempted sequences recompute
    their state from scratch, drafts and all, and every output equals the reference's."""
    params = greedy(32)
    engine = spec_engine(
        qwen_dir, NGRAM, num_kv_blocks=14, num_state_slots=3, max_num_batched_tokens=64
    )
    out = run_counted(engine, prompts, params)
    assert_same(reference.generate(prompts, params, use_tqdm=False), out)
    assert engine.scheduler.num_preemptions > 0
    engine.shutdown()


def test_prefix_cache_hits(qwen_dir, reference, prompts):
    """The same prompts again and a next turn of each: prefix-cache hits resume from state
    snapshots (prompt boundaries, and the decode rows that verify steps saved), and every
    output equals the reference's."""
    params = greedy(32)
    engine = spec_engine(qwen_dir, NGRAM)
    first = run_counted(engine, prompts, params)
    turns = [p + o.outputs[0].token_ids + p[:5] for p, o in zip(prompts, first)]
    again = engine.generate(prompts + turns, params, use_tqdm=False)
    assert_same(reference.generate(prompts + turns, params, use_tqdm=False), again)
    cached = [o.num_cached_tokens for o in again]
    assert all(c > 0 for c in cached)
    # a next turn resumes past its prompt: from a decode row published at the end
    assert any(c > len(p) for c, p in zip(cached[len(prompts) :], prompts))
    engine.shutdown()


def test_qwen3_next(tmp_path):
    model = make_loopy(make_qwen3_next(tmp_path / "next"))
    ref_engine, engine = spec_engine(model, None), spec_engine(model, NGRAM)
    ps = echo_prompts(ref_engine, count=2)
    params = greedy(32)
    assert_same(ref_engine.generate(ps, params, use_tqdm=False), run_counted(engine, ps, params))
    ref_engine.shutdown()
    engine.shutdown()


def test_seeded_sampling_equals_no_speculation(qwen_dir, reference, prompts):
    """Sampled with a seed: every position draws with its own words, so the tokens (and
    logprobs) are the non-speculative run's, accepted drafts or not."""
    params = greedy(24, temperature=0.2, seed=3)  # sharp: drafts get accepted
    engine = spec_engine(qwen_dir, NGRAM)
    out = engine.generate(prompts, params, use_tqdm=False)
    assert_same(reference.generate(prompts, params, use_tqdm=False), out)
    assert engine.stats.spec_decode_num_accepted_tokens > 0
    engine.shutdown()
