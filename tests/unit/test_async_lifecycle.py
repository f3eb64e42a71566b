"""Async scheduling against the serial engine where a request's life is cut short or paused:
aborts while a step is in flight, preemption under a tight KV cache, and drain()."""

from __future__ import annotations

import pytest

from tests.tiny_models import VOCAB_SIZE
from tests.unit.async_helpers import (
    MAX_STEPS,
    all_at_once,
    assert_idle,
    assert_same,
    check_stream,
    drive,
    engine_for,
    greedy,
    lengths,
    prompts_for,
    run_both,
    seeded,
    token_ids,
)

LENGTHS = (17, 33, 40, 49, 58, 64, 71, 90)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_for(VOCAB_SIZE, LENGTHS, seed=1)


@pytest.mark.parametrize("abort_at", [1, 2, 5])
def test_abort_while_a_step_is_in_flight_yields_no_extra_token(tiny_llama_dir, prompts, abort_at):
    # with async scheduling on, the step after `abort_at` is already planned (and holds a
    # token for the aborted requests) when they are aborted
    params = [greedy(30) if i % 2 else seeded(i, 30) for i in range(6)]
    arrivals = all_at_once(prompts[:6], params)
    arrivals[1] = [("late", prompts[7], greedy(12))]
    aborts = {abort_at: ["r0", "r1", "late"]}
    serial, ahead = run_both(tiny_llama_dir, lambda e: drive(e, arrivals, aborts))
    for rid in aborts[abort_at]:
        ref, got = serial[rid].outputs[0], ahead[rid].outputs[0]
        assert got.finish_reason == ref.finish_reason == "abort"
        assert len(got.token_ids) <= len(ref.token_ids), (rid, got.token_ids, ref.token_ids)
        assert got.token_ids == ref.token_ids[: len(got.token_ids)], rid
        assert got.logprobs == pytest.approx(ref.logprobs[: len(got.logprobs)], abs=1e-5)
    # running since step 0: each step() collected one step in both modes, so no token less
    # either ("late" arrived while a step was in flight: async schedules it a step later)
    assert token_ids({rid: ahead[rid] for rid in ("r0", "r1")}) == token_ids(
        {rid: serial[rid] for rid in ("r0", "r1")}
    )
    keep = [rid for rid in serial if rid not in aborts[abort_at]]
    assert_same({rid: ahead[rid] for rid in keep}, {rid: serial[rid] for rid in keep})


def test_preemption_under_a_tight_cache_matches_serial(tiny_llama_dir, prompts):
    # every prompt longer than the token budget (chunked); room for ~2 sequences (preempted)
    params = [greedy(20) if i % 2 else seeded(i, 20) for i in range(len(prompts))]
    arrivals = all_at_once(prompts, params)
    arrivals[4] = [("late", prompts[2], seeded(77, 16, repetition_penalty=1.3))]

    def run(engine):
        outs = drive(engine, arrivals)
        assert engine.scheduler.num_preemptions > 0
        return outs

    serial, ahead = run_both(
        tiny_llama_dir,
        run,
        max_num_batched_tokens=16,
        num_kv_blocks=14,
        enable_prefix_caching=False,
    )
    assert_same(ahead, serial)


def test_preemption_with_the_prefix_cache_matches_serial(tiny_llama_dir, prompts):
    shared = prompts[3][:32]
    ps = [shared + p[: 10 + 3 * i] for i, p in enumerate(prompts[:6])]
    params = [greedy(18) if i % 2 else seeded(i, 18) for i in range(len(ps))]

    def run(engine):
        outs = drive(engine, all_at_once(ps, params))
        assert engine.scheduler.num_preemptions > 0
        return outs

    serial, ahead = run_both(tiny_llama_dir, run, max_num_batched_tokens=32, num_kv_blocks=12)
    assert_same(ahead, serial)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drain_collects_the_step_in_flight_and_plans_nothing(
    tiny_llama_dir, prompts, async_scheduling
):
    ps = prompts[:4]
    params = [greedy(10) if i % 2 else seeded(i, 10) for i in range(len(ps))]
    serial = engine_for(tiny_llama_dir, False)
    reference = drive(serial, all_at_once(ps, params))
    serial.shutdown()
    engine = engine_for(tiny_llama_dir, async_scheduling)
    try:
        finals, seen = {}, {}
        for rid, prompt, p in all_at_once(ps, params)[0]:
            engine.admit(rid, prompt, p)
        for _ in range(3):
            for out in engine.step_deltas():
                check_stream(out, finals, seen)
        before = lengths(seen)
        planned = engine.stats.steps_planned_ahead
        assert (planned > 0) == async_scheduling
        for out in engine.drain():  # the paused engine: nothing runs after this
            check_stream(out, finals, seen)
        after = lengths(seen)
        assert engine.drain() == []
        assert engine.stats.steps_planned_ahead == planned  # drain plans nothing
        if not async_scheduling:
            assert after == before  # no step was in flight
        else:  # the step in flight: one more token each
            assert after == {rid: [n + 1 for n in lens] for rid, lens in before.items()}
        assert engine.has_unfinished_requests()
        for _ in range(MAX_STEPS):  # resume
            if not engine.has_unfinished_requests():
                break
            for out in engine.step_deltas():
                check_stream(out, finals, seen)
        assert_idle(engine)
        assert token_ids(finals) == token_ids(reference)
        assert_same(finals, reference)
    finally:
        engine.shutdown()


def test_context_limit_ends_requests_like_serial(tiny_llama_dir, prompts):
    """Requests that reach max_model_len (some exactly at their max_tokens, some with no
    max_tokens at all) get every token the serial engine gives them, and no more."""
    limit = 100
    params = [
        greedy(limit - len(p))
        if i % 3 == 0
        else greedy(None)
        if i % 3 == 1
        else seeded(i, limit - len(p) + 5)
        for i, p in enumerate(prompts)
    ]
    serial, ahead = run_both(
        tiny_llama_dir, lambda e: drive(e, all_at_once(prompts, params)), max_model_len=limit
    )
    assert_same(ahead, serial)
    for rid, out in serial.items():
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == limit, rid
        assert out.outputs[0].finish_reason == "length", rid
