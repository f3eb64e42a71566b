"""Async scheduling on tensor-parallel Ray shards against the serial engine at TP=1 in process:
a staggered-arrival run (greedy and seeded, n > 1), and a seeded request in a batch at
TP=2 against the same request alone at TP=1. One pair of engines for the module."""

from __future__ import annotations

import numpy as np
import pytest
from raylane.actors.engine import SamplingParams

from tests.ray.tp_helpers import build, prompts_for
from tests.unit.async_helpers import assert_idle, assert_same, drive, greedy, seeded

ATOL = 1e-4  # TP splits the matmul reductions: fp32 rounding differs, not the math


@pytest.fixture(scope="module")
def engines(ray_cluster, tiny_llama_dir):
    """(TP=1 serial in process, TP=2 async on Ray shards)."""
    tp1 = build(tiny_llama_dir)
    tp2 = None
    try:
        tp2 = build(tiny_llama_dir, tensor_parallel_size=2, async_scheduling=True)
        yield tp1, tp2
    finally:
        tp1.shutdown()
        if tp2 is not None:
            tp2.shutdown()


@pytest.mark.timeout(300)  # a step that never returns fails here instead of blocking the suite
def test_staggered_arrivals_at_tp2_async_match_tp1_serial(engines):
    tp1, tp2 = engines
    ps = prompts_for(tp1.validator.vocab_size, (17, 33, 49, 70, 25, 40), seed=31)
    arrivals = {
        0: [("g0", ps[0], greedy(12)), ("s0", ps[1], seeded(5, 10))],
        2: [("s1", ps[2], seeded(6, 9, n=2)), ("g1", ps[3], greedy(3))],
        5: [("g2", ps[4], greedy(10)), ("s2", ps[5], seeded(7, 1))],
    }
    planned = tp2.stats.steps_planned_ahead
    ref = drive(tp1, arrivals)
    got = drive(tp2, arrivals)
    assert_same(got, ref, ATOL)
    assert tp2.stats.steps_planned_ahead > planned
    assert_idle(tp2)


@pytest.mark.timeout(300)
def test_seeded_request_in_a_tp2_async_batch_matches_tp1_alone(engines):
    tp1, tp2 = engines
    ps = prompts_for(tp1.validator.vocab_size, (21, 37, 18, 52, 29, 44, 33, 26), seed=32)
    target = seeded(2024, 14, n=2, top_p=0.9)
    others = [
        seeded(40 + i, 4 + 2 * i) if i % 2 else SamplingParams(max_tokens=5 + i, ignore_eos=True)
        for i in range(7)
    ]
    alone = drive(tp1, {0: [("alone", ps[0], target)]})["alone"]
    batch = drive(
        tp2,
        {
            0: [(f"o{i}", ps[1 + i], others[i]) for i in range(4)],
            1: [("in-batch", ps[0], target)],
            3: [(f"o{i}", ps[1 + i], others[i]) for i in range(4, 7)],
        },
    )["in-batch"]
    for got, want in zip(batch.outputs, alone.outputs, strict=True):
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=ATOL)
    assert_idle(tp2)
