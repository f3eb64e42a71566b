"""Planning the next step late (actors/engine/plan_ahead.py): a request that arrives while a step
runs joins the step planned after it, one step sooner, with the serial run's tokens."""

from __future__ import annotations

import pytest
from raylane.actors.engine.output_accumulator import accumulate
from raylane.actors.engine.plan_ahead import PlanAheadClock

from tests.unit.async_helpers import engine_for, greedy, prompts_for


def steps_to_first_token(engine, prompt, params, plan_late: bool) -> tuple[int, list[int]]:
    """Start request a, then add b while a's second step runs: the steps from b's arrival to
    its first token, and b's tokens."""
    engine.admit("a", prompt, params)
    engine.step_deltas()  # a's first step; with async scheduling its second is now in flight
    engine.begin_step(plan_ahead=not plan_late)
    engine.admit("b", prompt[::-1], params)  # arrives while that step runs
    if plan_late:
        engine.plan_ahead()
    steps, outputs = 1, engine.end_step()
    b = [o for o in outputs if o.request_id == "b"]
    while not any(o.outputs and o.outputs[0].token_ids for o in b):
        steps, outputs = steps + 1, engine.step_deltas()
        b += [o for o in outputs if o.request_id == "b"]
    while engine.has_unfinished_requests():
        b += [o for o in engine.step_deltas() if o.request_id == "b"]
    return steps, accumulate(b).outputs[0].token_ids


def test_a_late_plan_takes_in_a_request_that_arrived_during_the_step(tiny_llama_dir):
    params = greedy(max_tokens=6)
    serial = engine_for(tiny_llama_dir, async_scheduling=False)
    prompt = prompts_for(serial.validator.vocab_size, (12,))[0]
    expected = serial.generate([prompt[::-1]], [params], use_tqdm=False)[0].outputs[0].token_ids
    engine = engine_for(tiny_llama_dir, async_scheduling=True)
    early, early_ids = steps_to_first_token(engine, prompt, params, plan_late=False)
    late, late_ids = steps_to_first_token(engine, prompt, params, plan_late=True)
    assert late == early - 1  # planned at the step's start, b waited one more step
    assert early_ids == late_ids == expected


def test_plan_ahead_launches_once_and_not_without_async_scheduling(tiny_llama_dir):
    params = greedy(max_tokens=4)
    for async_scheduling, launches in ((True, True), (False, False)):
        engine = engine_for(tiny_llama_dir, async_scheduling=async_scheduling)
        engine.admit("a", prompts_for(engine.validator.vocab_size, (8,))[0], params)
        engine.begin_step(plan_ahead=False)
        assert engine.plan_ahead() is launches
        assert engine.plan_ahead() is False  # one step ahead at most
        engine.drain()


def test_the_clock_plans_before_the_predicted_end_of_the_step():
    clock = PlanAheadClock(smoothing=0.5, plan_margin=2.0, min_wait_s=0.001)
    assert clock.wait_s(0.0) == 0.0  # nothing known yet: plan at once
    clock.step_done(0.0)
    clock.step_done(0.100)
    clock.planned(0.002)
    clock.planned(0.002)  # smoothed from 0: 0.001, then 0.0015
    assert clock.period_s == pytest.approx(0.100)
    # 100 ms period, 10 ms since the last step ended, room for two 1.5 ms plans
    assert clock.wait_s(0.110) == pytest.approx(0.100 - 0.010 - 2 * 0.0015)
    assert clock.wait_s(0.199) == 0.0  # less than min_wait_s left: plan now
    clock.step_done(0.160)  # a shorter step pulls the period down
    assert clock.period_s == pytest.approx(0.080)
    clock.idle()  # no work: the gap until the next step is not a period
    assert clock.wait_s(5.0) == 0.0
    clock.step_done(5.0)
    assert clock.period_s == pytest.approx(0.080)
