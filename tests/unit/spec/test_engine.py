"""Speculative decoding under the engine's other machinery, each against the engine without
speculation: async scheduling (speculation switching on and off with the batch size), the
graph runner's eager replay, preemption under a tight KV budget, prefix-cache hits on blocks
written by verify steps (against a cold cache), MoE routed experts, and retract between steps."""

from __future__ import annotations

import numpy as np
import pytest
from raylane.actors.engine import SamplingParams
from raylane.actors.runner.plan import PLACEHOLDER

from tests.unit.async_helpers import drive, prompts_for
from tests.unit.spec.helpers import Tap, on_results, spec_engine
from tests.unit.spec.test_parity import NGRAM, SUFFIX, assert_same, greedy

LENGTHS = (9, 17, 30, 45)


def mixed_params() -> list[SamplingParams]:
    """Different lengths, so the batch shrinks under disable_by_batch_size as requests end."""
    return [greedy(max_tokens=n) for n in (12, 24, 36, 48)]


@pytest.mark.parametrize(
    "options",
    [
        {"async_scheduling": True},
        {"enforce_eager": False},  # the graph runner (an eager replay on the CPU)
        {"async_scheduling": True, "enforce_eager": False},
        {"num_kv_blocks": 9},  # preemption by recompute
    ],
    ids=["async", "graphs", "async-graphs", "preemption"],
)
def test_parity_with_the_engine_machinery(loopy_dir, reference, prompts, options):
    spec = {**NGRAM, "disable_by_batch_size": 2}
    params = mixed_params()
    ref = reference.generate(prompts, params, use_tqdm=False)
    engine = spec_engine(loopy_dir, spec, **options)
    tap = Tap(engine, 4)
    assert_same(ref, engine.generate(prompts, params, use_tqdm=False))
    assert tap.num_accepted > 0
    stats = engine.stats
    if options.get("async_scheduling"):
        assert stats.steps_planned_ahead > 0  # big batches still plan ahead
    if options.get("enforce_eager") is False:
        assert stats.graph_replays > 0  # pure decode steps still replay
    if "num_kv_blocks" in options:
        assert engine.scheduler.num_preemptions > 0
    engine.shutdown()


def test_prefix_cache_holds_only_accepted_tokens(loopy_dir, prompts):
    """Requests that extend finished ones hit blocks their verify steps wrote: their logprobs
    are those of a cold cache (a rejected draft's KV in a cached block would change them)."""
    engine = spec_engine(loopy_dir, NGRAM)
    cold = spec_engine(loopy_dir, None, enable_prefix_caching=False)
    first = engine.generate(prompts, greedy(max_tokens=48), use_tqdm=False)
    assert engine.stats.spec_decode_num_accepted_tokens > 0
    longer = [p + o.outputs[0].token_ids[:40] for p, o in zip(prompts, first)]
    out = engine.generate(longer, greedy(max_tokens=8), use_tqdm=False)
    assert_same(cold.generate(longer, greedy(max_tokens=8), use_tqdm=False), out)
    assert all(o.num_cached_tokens >= 32 for o in out)
    engine.shutdown()
    cold.shutdown()


def test_moe_routed_experts_with_sibling_drafts(tiny_moe_dir):
    """A greedy twin behind another: suffix drafts copy the first one's output, and every
    routed-expert row (prompt and output) is the non-speculative run's."""
    kw = {"enable_return_routed_experts": True}
    ref_engine = spec_engine(tiny_moe_dir, None, **kw)
    engine = spec_engine(tiny_moe_dir, SUFFIX, **kw)
    prompt = prompts_for(ref_engine.validator.vocab_size, (21,))[0]
    params = greedy(max_tokens=30, return_routed_experts=True)
    arrivals = {0: [("lead", prompt, params)], 20: [("twin", prompt, params)]}
    ref, out = drive(ref_engine, arrivals), drive(engine, arrivals)
    for rid in ("lead", "twin"):
        assert_same([ref[rid]], [out[rid]])
        a, b = ref[rid].outputs[0].routed_experts, out[rid].outputs[0].routed_experts
        assert a is not None and a.shape[0] == len(prompt) + 29
        np.testing.assert_array_equal(a, b)
    assert engine.stats.spec_decode_num_accepted_tokens >= 10
    engine.shutdown()
    ref_engine.shutdown()


def test_retract_between_speculative_steps(loopy_dir, reference, prompts):
    """retract_all (RL's pause with retract) frees every sequence's KV mid-run; the recompute
    and the drafts after it give the same output."""

    def run(engine):
        for i, p in enumerate(prompts):
            engine.admit(f"r{i}", p, greedy(max_tokens=40))
        outputs = {}
        for step in range(200):
            if step in (5, 11):
                engine.retract_all()
            for delta in engine.step_deltas():
                outputs.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
            if not engine.has_unfinished_requests():
                return outputs
        raise AssertionError("unfinished")

    engine = spec_engine(loopy_dir, NGRAM)
    assert run(engine) == run(reference)
    assert engine.stats.spec_decode_num_accepted_tokens > 0
    engine.shutdown()


def test_no_step_is_planned_ahead_of_a_verify_step(loopy_dir, reference, prompts, monkeypatch):
    """Even when the drafter would let the next step go ahead (here: every other time it is
    asked), a step is never planned while a step with drafts runs: its accepted count decides
    the next positions."""
    params = mixed_params()
    ref = reference.generate(prompts, params, use_tqdm=False)
    engine = spec_engine(loopy_dir, NGRAM, async_scheduling=True)
    calls = iter(range(10**6))
    monkeypatch.setattr(engine.speculation, "wants_serial", lambda running: next(calls) % 2 == 0)
    assert_same(ref, engine.generate(prompts, params, use_tqdm=False))
    assert engine.stats.spec_decode_num_accepted_tokens > 0
    engine.shutdown()


def test_sampled_groups_with_sibling_drafts(loopy_dir, reference, prompts):
    """RL groups (n=4, temperature 0.8) with suffix drafts from siblings, async scheduling on:
    the seeded group's samples are the non-speculative ones, beside an unseeded group (whose
    random words are keyed by seq ids, which differ between two engines)."""
    params = [
        SamplingParams(n=4, temperature=0.8, seed=7, max_tokens=32, logprobs=1, ignore_eos=True),
        SamplingParams(n=4, temperature=0.8, max_tokens=32, logprobs=1, ignore_eos=True),
    ]
    engine = spec_engine(loopy_dir, SUFFIX, async_scheduling=True)
    ref = reference.generate(prompts[:2], params, use_tqdm=False)
    got = engine.generate(prompts[:2], params, use_tqdm=False)
    assert_same(ref[:1], got[:1])  # seeded: the same samples whatever the seq ids
    assert engine.stats.spec_decode_num_draft_tokens > 0
    engine.shutdown()


def test_drafts_past_a_token_in_flight(loopy_dir, reference, prompts, monkeypatch):
    """Async scheduling plans a step while the one before it runs: a row whose last token is
    in flight drafts past a guess of it (the plan carries a placeholder, then the drafts).
    Here the drafter always lets the next step be planned ahead, and its lookup is an oracle
    (the reference's own tokens) spoiled at every other call, so blind drafts are accepted
    and rejected. Greedy and seeded outputs, logprobs and max_tokens stops inside accepted
    runs are the non-speculative ones."""
    params = [
        greedy(max_tokens=27),
        greedy(max_tokens=41),
        SamplingParams(temperature=0.9, seed=3, max_tokens=40, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.3, seed=4, max_tokens=37, logprobs=2, ignore_eos=True),
    ]
    ref = reference.generate(prompts, params, use_tqdm=False)
    full = {tuple(p): p + o.outputs[0].token_ids for p, o in zip(prompts, ref)}
    engine = spec_engine(loopy_dir, NGRAM, async_scheduling=True)
    calls = iter(range(10**6))

    def oracle(seq, k):
        n = len(seq.token_ids)
        found = full[tuple(seq.token_ids[: seq.num_prompt_tokens])][n : n + k]
        if next(calls) % 2 and len(found) > 1:
            found[1] = (found[1] + 1) % engine.validator.vocab_size  # its first draft is wrong
        return found, 4  # a 4-token match (the best class)

    monkeypatch.setattr(engine.speculation, "wants_serial", lambda running: False)
    monkeypatch.setattr(engine.speculation, "_lookup", oracle)
    accepted: list[int] = []  # per row drafted past a placeholder, its accepted drafts

    def count(plan, result) -> None:
        blind = {c.seq_id for c in plan.cached_requests if PLACEHOLDER in c.new_token_ids}
        drafted = {seq_id for seq_id, _ in plan.draft_token_ids if seq_id in blind}
        order = [seq_id for seq_id, _ in plan.scheduled]
        for seq_id, extra in zip(order, result.extra):
            if seq_id in drafted:
                accepted.append(len(extra.token_ids) if extra is not None else 0)

    on_results(engine, count)
    assert_same(ref, engine.generate(prompts, params, use_tqdm=False))
    assert max(accepted) == 4 and min(accepted) == 0  # guesses right and wrong
    engine.shutdown()
