"""The TP shard group's life cycle as the Ray control plane sees it: an exception in one rank's
forward, shapes refused before any actor starts, a failed start that frees what it made.
The Ray cluster is the session's (`ray_cluster`).
"""

from __future__ import annotations

import shutil
import time

import pytest
from raylane.actors.executor import ExecutorError

from tests.ray.tp_helpers import (
    alive_shard_ids,
    assert_group_freed,
    build,
    checkpoint,
    greedy,
    placement_group_id,
    placement_group_ids,
    prompts_for,
    shard_ids,
    wait_until,
)
from tests.tiny_models import make_llama


@pytest.mark.timeout(120)  # a hang in a collective fails here instead of blocking
def test_an_exception_in_one_ranks_forward_fails_the_step_and_frees_the_group(
    ray_cluster, tiny_llama_dir
):
    import ray

    engine = build(tiny_llama_dir, tensor_parallel_size=2)
    shards, group = shard_ids(engine), placement_group_id(engine)
    prompts = prompts_for(engine.validator.vocab_size, (20, 33), seed=2)
    assert engine.generate(prompts, greedy(4), use_tqdm=False)  # the group works
    # break rank 1 only: its forward raises while rank 0 waits for it in a collective.
    # NOTE: a shard serving the step channel takes no Ray call; any collective_rpc releases it
    engine.executor.collective_rpc("info")
    ray.get(engine.executor.shards[1].rpc.remote("__setattr__", "model", None), timeout=60)
    start = time.monotonic()
    with pytest.raises(ExecutorError, match="rank 1"):
        engine.generate(prompts, greedy(4), use_tqdm=False)
    assert time.monotonic() - start < 60
    with pytest.raises(ExecutorError):
        engine.check_health()
    assert_group_freed(shards, group)


# --- shape checks before any actor --------------------------------------------------------------


def test_bad_tp_shape_is_a_value_error_before_any_actor(ray_cluster, tmp_path):
    # 9 query heads / 3 KV heads (SmolLM2's shape, tiny): TP=2 splits neither
    model_dir = make_llama(
        tmp_path / "nine_heads", hidden_size=72, num_attention_heads=9, num_key_value_heads=3
    )
    shards, groups = alive_shard_ids(), placement_group_ids()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2") as err:
        build(model_dir, tensor_parallel_size=2)
    assert "num_attention_heads=9" in str(err.value)
    assert alive_shard_ids() == shards
    assert placement_group_ids() == groups


def test_shards_that_fit_no_node_are_a_value_error_before_any_actor(ray_cluster, tiny_llama_dir):
    shards, groups = alive_shard_ids(), placement_group_ids()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 4 CPU on one node"):
        build(tiny_llama_dir, tensor_parallel_size=2, shard_resources={"CPU": 2})
    assert alive_shard_ids() == shards
    assert placement_group_ids() == groups


def test_a_failed_start_frees_its_shards_and_group(ray_cluster, tiny_llama_dir, tmp_path):
    # the shape check passes, the shards start, then loading fails on every rank
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    weights = checkpoint(tiny_llama_dir)
    del weights["model.norm.weight"]
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    shards, groups = alive_shard_ids(), placement_group_ids()
    with pytest.raises(ValueError, match=r"checkpoint lacks 1 weights"):
        build(str(broken), tensor_parallel_size=2)
    new_groups = placement_group_ids() - groups
    assert len(new_groups) == 1  # the group was made: this is the path after placement
    assert_group_freed([], new_groups.pop())
    wait_until(lambda: alive_shard_ids() == shards, what="the new shards dead")
