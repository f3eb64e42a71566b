"""Speculative decoding on tensor-parallel Ray shards: drafts and verification at TP=2 (async
scheduling on) give TP=1's output without speculation, greedy and seeded."""

from __future__ import annotations

import pytest
from raylane.actors.engine import SamplingParams

from tests.ray.tp_helpers import build
from tests.tiny_models import make_qwen3_5
from tests.unit.async_helpers import assert_same, drive, greedy, prompts_for, seeded
from tests.unit.spec.helpers import make_loopy, make_loopy_llama, on_results
from tests.unit.spec.test_linear_attention import echo_prompts

ATOL = 1e-4  # TP splits the matmul reductions: fp32 rounding differs, not the math
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}


@pytest.mark.timeout(300)
def test_tp2_speculation_matches_tp1_without(ray_cluster, tmp_path):
    model = make_loopy_llama(tmp_path / "loopy")
    tp1 = build(model, async_scheduling=False)
    tp2 = build(model, tensor_parallel_size=2, async_scheduling=True, speculative_config=SPEC)
    try:
        ps = prompts_for(tp1.validator.vocab_size, (9, 17, 30, 45))
        arrivals = {
            0: [("g0", ps[0], greedy(40)), ("s0", ps[1], seeded(5, 24))],
            3: [("g1", ps[2], greedy(40)), ("s1", ps[3], seeded(6, 20, n=2))],
        }
        assert_same(drive(tp2, arrivals), drive(tp1, arrivals), ATOL)
        assert tp2.stats.spec_decode_num_accepted_tokens > 0
    finally:
        tp1.shutdown()
        tp2.shutdown()


@pytest.mark.timeout(300)
def test_tp2_draft_model_with_sampled_drafts(ray_cluster, tmp_path):
    """A draft model at TP=2 (async scheduling on), sharded on both ranks with its own KV
    pool: greedy and seeded outputs (tokens and logprobs) are TP=1's without speculation;
    an unseeded sampled request's drafts are drawn on the shards (the same on both: the
    verify forward feeds them) and verified there (its tokens are its own: unseeded streams
    are keyed by seq id)."""
    model = make_loopy_llama(tmp_path / "loopy")
    draft = make_loopy_llama(tmp_path / "draft", attention_scale=0.03)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive": False}
    tp1 = build(model, async_scheduling=False)
    tp2 = build(model, tensor_parallel_size=2, async_scheduling=True, speculative_config=spec)
    drawn = []  # the drafts the shards drew, from each result
    on_results(tp2, lambda plan, result: drawn.extend(d for d in result.drafts if d))
    try:
        ps = prompts_for(tp1.validator.vocab_size, (9, 17, 30))
        arrivals = {0: [("g0", ps[0], greedy(32)), ("s0", ps[1], seeded(5, 24))]}
        assert_same(drive(tp2, arrivals), drive(tp1, arrivals), ATOL)
        unseeded = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)
        out = tp2.generate([ps[2]], unseeded, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 24
        assert drawn and -1 not in {t for d in drawn for t in d}
        assert tp2.stats.spec_decode_num_accepted_tokens > 0
    finally:
        tp1.shutdown()
        tp2.shutdown()


@pytest.mark.timeout(300)
def test_tp2_speculation_on_a_linear_attention_model(ray_cluster, tmp_path):
    """Qwen3.5 at TP=2 (serial: only rank 0 reports), n-gram drafts accepted and rejected:
    every rank feeds the same accepted drafts into its slice of the recurrent state, and the
    output is TP=1's without speculation."""
    model = make_loopy(make_qwen3_5(tmp_path / "qwen3_5"))
    tp1 = build(model, async_scheduling=False)
    tp2 = build(model, tensor_parallel_size=2, async_scheduling=False, speculative_config=SPEC)
    try:
        ps = echo_prompts(tp1, count=2)
        arrivals = {0: [("g0", ps[0], greedy(32)), ("g1", ps[1], greedy(32))]}
        assert_same(drive(tp2, arrivals), drive(tp1, arrivals), ATOL)
        stats = tp2.stats
        assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    finally:
        tp1.shutdown()
        tp2.shutdown()


@pytest.mark.timeout(300)
def test_tp2_chained_mtp_matches_tp1_without(ray_cluster, tmp_path):
    """DeepSeek-V3's MTP layer at TP=2 (async scheduling on), k = 2 chained steps on its one
    layer: every rank draws the step's tokens and runs the MTP layers (their collectives),
    and greedy and seeded outputs are TP=1's without speculation, drafts accepted."""
    from tests.unit.spec.test_mtp import biased_copy
    from tests.unit.test_mtp_layers import make_deepseek_v3_with_mtp

    path, _, _ = make_deepseek_v3_with_mtp(tmp_path / "ds_mtp")
    model = biased_copy(path, str(tmp_path / "biased"))
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    tp1 = build(model, async_scheduling=False)
    tp2 = build(model, tensor_parallel_size=2, async_scheduling=True, speculative_config=spec)
    try:
        ps = [list(range(5, 5 + n)) for n in (7, 20)]
        arrivals = {0: [("g0", ps[0], greedy(16)), ("s0", ps[1], seeded(5, 16))]}
        assert_same(drive(tp2, arrivals), drive(tp1, arrivals), ATOL)
        assert tp2.stats.spec_decode_num_accepted_tokens_per_pos[1] > 0
    finally:
        tp1.shutdown()
        tp2.shutdown()


@pytest.mark.timeout(300)
def test_tp2_chained_mtp_on_a_linear_attention_model(ray_cluster, tmp_path):
    """Qwen3.5's MTP module at TP=2 (async scheduling on), k = 3 chained steps (only the MTP
    block's attention, no recurrent state): greedy and seeded outputs are TP=1's without
    speculation, chained drafts accepted at positions 2 and 3."""
    from tests.unit.spec.test_qwen_mtp import add_mtp

    # next token mostly from the current one; the MTP module an exact copy of that path
    model = add_mtp(make_loopy(make_qwen3_5(tmp_path / "qwen3_5"), 0.01), scale=0.0)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
    tp1 = build(model, async_scheduling=False)
    tp2 = build(model, tensor_parallel_size=2, async_scheduling=True, speculative_config=spec)
    try:
        ps = echo_prompts(tp1, count=2)
        arrivals = {0: [("g0", ps[0], greedy(24)), ("s0", ps[1], seeded(5, 16))]}
        assert_same(drive(tp2, arrivals), drive(tp1, arrivals), ATOL)
        per_pos = tp2.stats.spec_decode_num_accepted_tokens_per_pos
        assert per_pos[1] > 0 and per_pos[2] > 0
    finally:
        tp1.shutdown()
        tp2.shutdown()
