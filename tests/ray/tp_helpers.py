"""Helpers for the tensor-parallel engine tests: engines, prompts, TP=N against TP=1 pairs,
output comparison, and what the Ray control plane says about an engine's shard actors and
placement group."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams
from raylane.actors.engine.outputs import RequestOutput

SHARD_CLASS = "ModelShard"


def build(model_dir: str, **kw) -> LLMEngine:
    kw.setdefault("block_size", 16)
    # a small explicit cache: the same block pool at every TP size (so cache hits and evictions
    # compare), and no 1 GiB cache per rank on a shared machine
    kw.setdefault("num_kv_blocks", 128)
    return LLMEngine(EngineConfig(model=model_dir, **kw))


def prompts_for(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """Random token prompts of the given lengths (ids 3.. skip the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outs: list[RequestOutput]) -> list[list[list[int]]]:
    """[request][sample] -> token ids."""
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_same_outputs(got: list[RequestOutput], ref: list[RequestOutput], atol: float) -> None:
    """Every sample: identical token ids, logprobs within `atol`, the same top-logprob ids
    (their values within `atol`)."""
    assert len(got) == len(ref)
    for g_req, r_req in zip(got, ref):
        assert len(g_req.outputs) == len(r_req.outputs)
        for g, r in zip(g_req.outputs, r_req.outputs):
            assert g.token_ids == r.token_ids
            np.testing.assert_allclose(g.logprobs, r.logprobs, rtol=0, atol=atol)
            assert (g.top_logprobs is None) == (r.top_logprobs is None)
            for g_top, r_top in zip(g.top_logprobs or [], r.top_logprobs or []):
                assert g_top.keys() == r_top.keys()
                for token, value in r_top.items():
                    assert abs(g_top[token] - value) <= atol, (token, g_top[token], value)


def assert_same_prompt_logprobs(
    got: list[RequestOutput], ref: list[RequestOutput], atol: float
) -> None:
    for g_req, r_req in zip(got, ref):
        assert g_req.prompt_logprobs is not None and r_req.prompt_logprobs is not None
        assert len(g_req.prompt_logprobs) == len(r_req.prompt_logprobs)
        for g, r in zip(g_req.prompt_logprobs, r_req.prompt_logprobs):
            assert (g is None) == (r is None)
            if r is None:
                continue
            assert g.keys() == r.keys()
            for token, value in r.items():
                assert abs(g[token] - value) <= atol, (token, g[token], value)


# --- TP=N against TP=1 ------------------------------------------------------------------------

LENGTHS = (17, 33, 49, 70)  # 2 to 5 blocks of 16
ATOL = 1e-4  # TP splits the matmul reductions: fp32 rounding differs, not the math


class Pair(NamedTuple):
    tp1: LLMEngine  # the reference: in process
    tp2: LLMEngine  # Ray shards


def tp_pair(model_dir: str, tp: int = 2, **kw):
    tp1 = build(model_dir, **kw)
    tp2 = None
    try:
        tp2 = build(model_dir, tensor_parallel_size=tp, **kw)
        yield Pair(tp1, tp2)
    finally:
        tp1.shutdown()
        if tp2 is not None:
            tp2.shutdown()


def check_greedy_parity(pair: Pair) -> None:
    prompts = prompts_for(pair.tp1.validator.vocab_size, LENGTHS)
    params = greedy(12, logprobs=2)
    ref = pair.tp1.generate(prompts, params, use_tqdm=False)
    got = pair.tp2.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in got)
    assert_same_outputs(got, ref, ATOL)


def checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


# --- the Ray control plane ----------------------------------------------------------------------
# NOTE: read from the GCS, not `ray.util.state.list_actors`: the state API goes through the
# dashboard, which the test cluster does not start (and its default port may be another
# cluster's dashboard on a shared machine).


def alive_shard_ids() -> set[str]:
    """Actor ids of every ALIVE `ModelShard` in the cluster (any engine)."""
    import ray

    return {
        a["ActorID"]
        for a in ray._private.state.actors().values()
        if a["ActorClassName"] == SHARD_CLASS and a["State"] == "ALIVE"
    }


def shard_ids(engine: LLMEngine) -> list[str]:
    return [shard._actor_id.hex() for shard in engine.executor.shards]


def placement_group_id(engine: LLMEngine) -> str:
    return engine.executor.placement.group.id.hex()


def placement_group_state(group_id: str) -> str | None:
    import ray

    entry = ray.util.placement_group_table().get(group_id)
    return None if entry is None else entry["state"]


def placement_group_ids() -> set[str]:
    import ray

    return set(ray.util.placement_group_table())


def wait_until(check: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
    """Poll `check` (Ray applies kills and removals asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.2)


def assert_group_freed(shards: list[str], group_id: str) -> None:
    """No shard of the group is ALIVE and its placement group is REMOVED."""
    wait_until(lambda: not set(shards) & alive_shard_ids(), what=f"shards {shards} dead")
    wait_until(
        lambda: placement_group_state(group_id) == "REMOVED",
        what=f"placement group {group_id} removed",
    )
