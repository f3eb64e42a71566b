"""Qwen3 at TP=2 (Ray shards) against TP=1 in process, and a shard that dies mid-run.

Engines are class-scoped, so each model's shards are freed when its class ends; tests that end
an engine run last in their class. The Ray cluster is the session's (`ray_cluster`).
"""

from __future__ import annotations

import time

import pytest
from raylane.actors.executor import ExecutorError

from tests.ray.tp_helpers import (
    assert_group_freed,
    check_greedy_parity,
    greedy,
    placement_group_id,
    prompts_for,
    shard_ids,
    tp_pair,
)

# --- Qwen3 (q/k norm, head_dim != hidden / heads) ----------------------------------------------


@pytest.fixture(scope="class")
def qwen3(ray_cluster, tiny_qwen3_dir):
    yield from tp_pair(tiny_qwen3_dir)


class TestQwen3:
    def test_greedy_matches_tp1(self, qwen3):
        check_greedy_parity(qwen3)

    @pytest.mark.timeout(120)  # a hang in a collective fails here instead of blocking
    def test_dead_shard_fails_the_step_and_frees_the_group(self, ray_cluster, qwen3):
        # NOTE: ends this class's TP=2 engine, so it runs last in the class
        engine = qwen3.tp2
        shards, group = shard_ids(engine), placement_group_id(engine)
        # rank 1 samples nothing: only watching every rank (not rank 0's reply) notices it died
        ray_cluster.kill(engine.executor.shards[1], no_restart=True)
        prompts = prompts_for(engine.validator.vocab_size, (20,), seed=1)
        start = time.monotonic()
        with pytest.raises(ExecutorError, match=r"a shard (died|failed)"):
            engine.generate(prompts, greedy(4), use_tqdm=False)
        assert time.monotonic() - start < 60
        with pytest.raises(ExecutorError):
            engine.check_health()
        assert_group_freed(shards, group)
        with pytest.raises(ExecutorError):
            engine.step()
