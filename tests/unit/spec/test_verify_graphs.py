"""The graph runner replays verify steps (on the CPU, its eager replay over the padded static
buffers of a [rows, 1 + k] grid): n-gram speculation with graphs on gives the greedy and
seeded tokens and logprobs of graphs off and of no speculation, and the engine's counter shows
verify steps replayed (none with graphs off, none under the torch backend, which runs verify
rows eagerly)."""

from __future__ import annotations

import numpy as np
import pytest
from raylane.actors.engine import SamplingParams
from raylane.actors.runner.verify_layout import grid_rows, verify_fits
from raylane.kernels.attention.metadata import SeqSlice

from tests.unit.async_helpers import drive, prompts_for
from tests.unit.spec.helpers import Tap, spec_engine
from tests.unit.spec.test_parity import NGRAM, SUFFIX, K, assert_same, greedy

# verify graphs hold rows x (1 + k) tokens within the largest size: rows 1, 2, 4 at k = 4
SIZES = (1, 2, 4, 8, 16, 20)


def params() -> list[SamplingParams]:
    """Greedy and seeded rows of different lengths: the batch shrinks through the sizes."""
    seeded = {"temperature": 0.8, "logprobs": 3, "ignore_eos": True}
    return [
        greedy(max_tokens=20),
        SamplingParams(max_tokens=28, seed=7, **seeded),
        greedy(max_tokens=36),
        SamplingParams(max_tokens=44, seed=11, **seeded),
    ]


def engine(model_dir: str, spec: dict | None, graphs: bool, **kw):
    return spec_engine(
        model_dir,
        spec,
        enforce_eager=not graphs,
        max_num_seqs=SIZES[-1],
        cudagraph_capture_sizes=SIZES,
        **kw,
    )


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_verify_steps_replay_with_the_outputs_of_eager_and_no_speculation(
    loopy_dir, prompts, async_scheduling
):
    ref_engine = engine(loopy_dir, None, graphs=False)
    ref = ref_engine.generate(prompts, params(), use_tqdm=False)
    ref_engine.shutdown()
    outs, stats = {}, {}
    for graphs in (False, True):
        spec = engine(loopy_dir, NGRAM, graphs, async_scheduling=async_scheduling)
        tap = Tap(spec, K)
        outs[graphs] = spec.generate(prompts, params(), use_tqdm=False)
        assert tap.num_accepted > 0 and tap.num_accepted < tap.num_draft_tokens
        stats[graphs] = spec.stats
        spec.shutdown()
    assert_same(ref, outs[False])
    assert_same(ref, outs[True])
    assert stats[False].verify_graph_replays == 0 == stats[False].graph_replays
    # verify steps replayed (of at most 4 rows x 5 tokens), and decode steps too
    assert 0 < stats[True].verify_graph_replays < stats[True].graph_replays


def test_moe_routed_experts_from_verify_graphs(tiny_moe_dir):
    """A greedy twin behind another (suffix drafts copy the first one's output): the routed
    experts of replayed verify rows, gathered from the grid, are the eager run's."""
    kw = {"enable_return_routed_experts": True}
    ref_engine = engine(tiny_moe_dir, None, graphs=False, **kw)
    spec = engine(tiny_moe_dir, SUFFIX, graphs=True, **kw)
    prompt = prompts_for(ref_engine.validator.vocab_size, (21,))[0]
    params = greedy(max_tokens=30, return_routed_experts=True)
    arrivals = {0: [("lead", prompt, params)], 20: [("twin", prompt, params)]}
    ref, out = drive(ref_engine, arrivals), drive(spec, arrivals)
    for rid in ("lead", "twin"):
        assert_same([ref[rid]], [out[rid]])
        a, b = ref[rid].outputs[0].routed_experts, out[rid].outputs[0].routed_experts
        assert a is not None and a.shape[0] == len(prompt) + 29
        np.testing.assert_array_equal(a, b)
    assert spec.stats.spec_decode_num_accepted_tokens >= 10
    assert spec.stats.verify_graph_replays > 0
    spec.shutdown()
    ref_engine.shutdown()


def test_torch_backend_runs_verify_rows_eagerly(loopy_dir, prompts):
    """The torch backend's prefill path plans on the host: no verify graphs, same outputs."""
    ref = engine(loopy_dir, None, graphs=False, attention_backend="torch")
    spec = engine(loopy_dir, NGRAM, graphs=True, attention_backend="torch")
    assert_same(
        ref.generate(prompts, params(), use_tqdm=False),
        spec.generate(prompts, params(), use_tqdm=False),
    )
    assert spec.stats.verify_graph_replays == 0 < spec.stats.graph_replays
    ref.shutdown()
    spec.shutdown()


def test_grid_layout():
    """A row's new tokens end its grid row; rows must fit the width and have the context."""
    seqs = [SeqSlice(3, 10, [0]), SeqSlice(1, 7, [1]), SeqSlice(5, 5, [2])]
    assert grid_rows(seqs, 5) == [2, 3, 4, 9, 10, 11, 12, 13, 14]
    assert verify_fits(seqs, 5, 4)
    assert not verify_fits(seqs, 5, 2)  # more rows than the largest verify graph
    assert not verify_fits(seqs, 4, 4)  # a row wider than the graph
    assert not verify_fits([SeqSlice(2, 4, [0])], 5, 4)  # less context than the width
    assert not verify_fits([SeqSlice(1, 9, [0])] * 2, 5, 4)  # a decode batch


def test_draft_model_verify_steps_replay(loopy_dir, prompts):
    """A draft model (the target itself: every draft accepted) drafts eagerly; the target's
    verify steps replay, with the outputs of no speculation."""
    spec = {"method": "draft_model", "model": loopy_dir, "num_speculative_tokens": K}
    ref_engine = engine(loopy_dir, None, graphs=False)
    ref = ref_engine.generate(prompts, params(), use_tqdm=False)
    ref_engine.shutdown()
    drafted = engine(loopy_dir, {**spec, "adaptive": False}, graphs=True)
    assert_same(ref, drafted.generate(prompts, params(), use_tqdm=False))
    stats = drafted.stats
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert stats.verify_graph_replays > 0
    drafted.shutdown()
