"""A step that fails (injected in planning, input preparation or the forward pass) ends its own
requests with finish reason "error" and nothing else: queued and later requests complete as on
a fresh engine, every KV block comes back, and nothing hangs; with async scheduling off and on.
Also: a seeded request's tokens do not depend on its batch or on the scheduling mode."""

from __future__ import annotations

import numpy as np
import pytest
from raylane.actors.engine import SamplingParams
from raylane.actors.engine.outputs import RequestOutput

from tests.support.faults import arm_fault
from tests.tiny_models import VOCAB_SIZE
from tests.unit.async_helpers import (
    MAX_STEPS,
    assert_idle,
    assert_same,
    check_stream,
    drive,
    engine_for,
    greedy,
    prompts_for,
    run_both,
    seeded,
)

STAGES = ("plan", "prepare", "forward")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_for(VOCAB_SIZE, (17, 33, 25, 41, 20, 52), seed=4)


@pytest.fixture(scope="module")
def fresh(tiny_llama_dir, prompts) -> list[RequestOutput]:
    """Each prompt's greedy output on a fresh serial engine that never failed."""
    engine = engine_for(tiny_llama_dir, False)
    try:
        return engine.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    finally:
        engine.shutdown()


def step_until(engine, done, finals: dict, seen: dict) -> None:
    """Step (a bounded number of times: a hang fails) until `done()` holds."""
    for _ in range(MAX_STEPS):
        if done():
            return
        for out in engine.step_deltas():
            check_stream(out, finals, seen)
    raise AssertionError(f"not done after {MAX_STEPS} steps")


@pytest.mark.timeout(120)  # a step that never returns fails here instead of blocking the suite
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_failed_step_ends_only_its_requests(
    tiny_llama_dir, prompts, fresh, stage, async_scheduling
):
    engine = engine_for(tiny_llama_dir, async_scheduling, max_num_seqs=4)
    try:
        with pytest.raises(ValueError, match="stage"):
            arm_fault(engine, "sample")
        finals: dict[str, RequestOutput] = {}
        seen: dict[str, list[list[int]]] = {}
        # r1 has two samples: with r0 and r2 they fill max_num_seqs, so "queued" waits
        for i, n in ((0, 1), (1, 2), (2, 1)):
            engine.admit(f"r{i}", prompts[i], greedy(MAX_TOKENS, n=n))
        step_until(engine, lambda: len(engine.scheduler.running) == 4, finals, seen)
        engine.admit("queued", prompts[3], greedy(MAX_TOKENS))
        arm_fault(engine, stage)
        failed = ["r0", "r1", "r2"]
        step_until(engine, lambda: all(rid in finals for rid in failed), finals, seen)
        assert "queued" not in finals
        for i, rid in enumerate(failed):
            out = finals[rid]
            assert isinstance(out.error, str) and stage in out.error, out.error
            for c in out.outputs:
                assert c.finish_reason == "error", (rid, c.finish_reason)
                assert len(c.token_ids) < MAX_TOKENS
                # no made-up token: what it did get is what a fresh engine gives
                assert c.token_ids == fresh[i].outputs[0].token_ids[: len(c.token_ids)], rid
        # the engine serves on: the queued request and new ones as on a fresh engine
        for i in (4, 5):
            engine.admit(f"r{i}", prompts[i], greedy(MAX_TOKENS))
        step_until(engine, lambda: not engine.has_unfinished_requests(), finals, seen)
        for i, rid in ((3, "queued"), (4, "r4"), (5, "r5")):
            assert finals[rid].error is None
            assert_same({rid: finals[rid]}, {rid: fresh[i]})
        assert_idle(engine)
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_repeated_failures_leave_the_engine_whole(tiny_llama_dir, prompts, fresh, async_scheduling):
    engine = engine_for(tiny_llama_dir, async_scheduling)
    try:
        finals: dict[str, RequestOutput] = {}
        seen: dict[str, list[list[int]]] = {}
        for round_, stage in enumerate(STAGES * 2):
            rid = f"{stage}-{round_}"
            engine.admit(rid, prompts[round_ % 3], greedy(MAX_TOKENS))
            step_until(engine, lambda: rid in seen, finals, seen)  # it is running
            arm_fault(engine, stage)
            step_until(engine, lambda: rid in finals, finals, seen)
            assert finals[rid].outputs[0].finish_reason == "error"
        engine.admit("after", prompts[5], greedy(MAX_TOKENS))
        step_until(engine, lambda: not engine.has_unfinished_requests(), finals, seen)
        assert_same({"after": finals["after"]}, {"after": fresh[5]})
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_seeded_request_is_the_same_alone_in_a_batch_and_ahead(tiny_llama_dir, prompts):
    target = seeded(2024, 16, n=2, top_p=0.9)
    others = [
        seeded(7 + i, 5 + 3 * i)
        if i % 3 == 0
        else greedy(4 + 2 * i)
        if i % 3 == 1
        else SamplingParams(max_tokens=3 + i, ignore_eos=True)  # unseeded: the shared stream
        for i in range(7)
    ]
    batch = {
        0: [(f"o{i}", prompts[i % 6], others[i]) for i in range(4)],
        1: [("in-batch", prompts[1], target)],
        2: [(f"o{i}", prompts[i % 6], others[i]) for i in range(4, 7)],
    }

    def run(engine):
        alone = drive(engine, {0: [("alone", prompts[1], target)]})["alone"]
        return alone, drive(engine, batch)["in-batch"]

    serial, ahead = run_both(tiny_llama_dir, run)
    ref = serial[0].outputs
    assert ref[0].token_ids != ref[1].token_ids  # two samples, two streams
    for out in (serial[1], *ahead):
        for got, want in zip(out.outputs, ref, strict=True):
            assert got.token_ids == want.token_ids
            np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
