"""The graph runner (on the CPU: its eager replay over padded static buffers) against the eager
runner: the same tokens, logprobs and routed experts for every capture size and the padded
batch sizes between them, with seeded sampling, alone and with async scheduling."""

from __future__ import annotations

import pytest
import torch
from raylane.actors.engine import EngineConfig, LLMEngine
from raylane.actors.engine.layer_kinds import kv_groups
from raylane.actors.runner.graph_runner import GraphRunner

from tests.unit.async_helpers import assert_same, engine_for, greedy, prompts_for, seeded

SIZES = (1, 2, 4, 8)


def run(
    model_dir: str, batch: int, enforce_eager: bool, async_scheduling: bool = False, **kw
) -> tuple[dict, LLMEngine]:
    """`batch` requests at once (decode batches shrink from `batch` as they finish)."""
    engine = engine_for(
        model_dir,
        async_scheduling,
        enforce_eager=enforce_eager,
        max_num_seqs=8,
        cudagraph_capture_sizes=SIZES,
        **kw,
    )
    prompts = prompts_for(
        engine.validator.vocab_size, tuple(5 + 4 * i for i in range(batch)), seed=batch
    )
    routed = {"return_routed_experts": True} if kw.get("enable_return_routed_experts") else {}
    params = [
        seeded(i, 4 + i, logprobs=3, **routed) if i % 2 else greedy(4 + i, logprobs=3, **routed)
        for i in range(batch)
    ]
    try:
        outs = engine.generate(prompts, params, use_tqdm=False)
        return {o.request_id: o for o in outs}, engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 7, 8])
def test_replay_equals_eager_for_every_size(tiny_llama_dir, batch):
    eager, _ = run(tiny_llama_dir, batch, enforce_eager=True)
    graphs, engine = run(tiny_llama_dir, batch, enforce_eager=False)
    assert_same(graphs, eager)  # tokens, text, finish reasons; (top) logprobs within 1e-5
    # every step after the first (a prefill) decodes the whole running batch
    assert engine.stats.graph_replays == max(4 + i for i in range(batch)) - 1


@pytest.mark.parametrize(
    ("model", "async_scheduling"),
    [("tiny_moe_dir", False), ("tiny_moe_dir", True), ("tiny_deepseek_dir", True)],
)
def test_replay_with_routed_experts_and_async(model, async_scheduling, request):
    model_dir = request.getfixturevalue(model)  # DeepSeek: MLA's latent cache in the graphs
    kw = {"enable_return_routed_experts": True}
    eager, _ = run(model_dir, 5, enforce_eager=True, **kw)
    graphs, engine = run(model_dir, 5, enforce_eager=False, async_scheduling=async_scheduling, **kw)
    assert_same(graphs, eager)  # routed experts exactly
    assert engine.stats.graph_replays > 0
    for out in graphs.values():
        c = out.outputs[0]
        assert c.routed_experts.shape[0] == len(out.prompt_token_ids) + len(c.token_ids) - 1


def test_eager_engine_replays_nothing(tiny_llama_dir):
    _, engine = run(tiny_llama_dir, 3, enforce_eager=True)
    assert engine.stats.graph_replays == 0
    # None (the default) is eager on the CPU: graphs only where they capture
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=16))
    try:
        engine.generate([[5, 6, 7]], greedy(4), use_tqdm=False)
        assert engine.stats.graph_replays == 0
    finally:
        engine.shutdown()


class _KV:
    block_size, scratch_block = 4, 9
    scratch_slot = 36
    groups = kv_groups([8, None])  # two KV cache groups: a static table and mapping each


def test_padding_goes_to_the_next_size_and_the_scratch_block():
    graphs = GraphRunner(
        model=None, kv=_KV(), sizes=(8, 1, 4, 2), max_model_len=30, device=torch.device("cpu")
    )
    assert [graphs.padded_size(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [t.shape for t in graphs.group_tables] == [(8, 8)] * 2  # ceil(30 / 4) per row
    graphs.seq_lens[:] = 7
    for tables in graphs.group_tables:
        tables.fill_(5)
    graphs._pad(3, 8)
    assert graphs.seq_lens.tolist() == [7, 7, 7, 1, 1, 1, 1, 1]
    for slots, tables in zip(graphs.slot_mappings, graphs.group_tables):
        assert slots[3:].tolist() == [36] * 5
        assert tables[3:, 0].tolist() == [9] * 5 and tables[:3, 0].tolist() == [5] * 3


def test_capture_sizes_default_ladder_and_validation():
    config = EngineConfig(model="m", max_num_seqs=20)
    assert config.capture_sizes == (1, 2, 4, 8, 16, 20)  # max_num_seqs itself always fits
    assert EngineConfig(
        model="m", max_num_seqs=4, cudagraph_capture_sizes=(8, 2)
    ).capture_sizes == (2, 4)
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        EngineConfig(model="m", cudagraph_capture_sizes=())
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(model="m", enforce_eager="yes")
