"""Drafts drawn from a distribution q (a draft model, MTP) for unseeded sampled requests are
verified by speculative sampling: kept with probability min(1, p/q), else the residual
max(0, p - q)'s draw. Chi-square tests of the output against the naive distribution (the
kernel alone against p; the engine against Hugging Face's forward of the target), with drafts
both kept and rejected. Seeded requests stay reproducible alone and in a batch (their drafts
are drawn with the position's own words and kept while equal to the target's token, so the
tokens are the non-speculative ones). `wrong_rule.py` (not collected) shows these chi-square
tests fail for a wrong rule."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from raylane.actors.engine import SamplingParams
from raylane.kernels import sampling

from tests.unit.spec.helpers import (
    Tap,
    chi_square_p_value,
    hf_probability,
    make_loopy_llama,
    sharpened_copy,
    spec_engine,
)
from tests.unit.spec.test_parity import assert_same

TOP_K = 3
NUM_REQUESTS = 600
HEAD = [200, 218, 23, 135, 264, 251, 17]


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory) -> str:
    return make_loopy_llama(tmp_path_factory.mktemp("bigram") / "model", attention_scale=0.0)


@pytest.fixture(scope="module")
def sharp_dir(bigram_dir, tmp_path_factory) -> str:
    return sharpened_copy(bigram_dir, tmp_path_factory.mktemp("sharp") / "model")


def test_kernel_output_is_distributed_as_p():
    """4000 rows: drafts drawn from q with words of their own, verified against p."""
    p = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1, 0.0])
    q = torch.tensor([0.05, 0.5, 0.0, 0.15, 0.1, 0.2])
    rows = 4000
    gen = torch.Generator().manual_seed(3)
    key, ctr0, dkey = (torch.randint(0, 2**32, (rows,), generator=gen) for _ in range(3))
    ctr1 = torch.full((rows,), 9)
    drafts = sampling.sample_race(q.expand(rows, -1), dkey, ctr0, ctr1)
    out = sampling.speculative_accept(
        p.expand(rows, -1), q.expand(rows, -1), drafts, key, ctr0, ctr1
    )
    counts = torch.bincount(out, minlength=6).tolist()
    assert counts[5] == 0  # p = 0: never output, though q drafts it
    observed = Counter(dict(enumerate(counts)))
    p_value, _ = chi_square_p_value(observed, {t: float(p[t]) for t in range(5)}, rows)
    assert p_value > 1e-3, p_value
    # a token equals its draft only when kept (a rejected draft has no residual mass), and
    # drafts are kept with probability sum(min(p, q)) = 0.55
    kept = (out == drafts).double().mean().item()
    assert abs(kept - 0.55) < 5 * (0.55 * 0.45 / rows) ** 0.5
    # q == p: no residual mass, every draft kept
    same = sampling.speculative_accept(
        q.expand(rows, -1), q.expand(rows, -1), drafts, key, ctr0, ctr1
    )
    assert torch.equal(same, drafts)


def prompt_for(model_dir: str) -> list[int]:
    """A prompt the model's greedy path fills (sampled paths then stay where drafts hold)."""
    engine = spec_engine(model_dir, None)
    tail = engine.generate([HEAD], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    engine.shutdown()
    return HEAD + tail[0].outputs[0].token_ids


def sampled_paths(model_dir: str, spec: dict, prompt: list[int], max_tokens: int):
    """NUM_REQUESTS unseeded draws of `max_tokens` tokens: (Counter of the paths, Tap,
    positions the runner verified by min(1, p/q), against their draft's q)."""
    engine = spec_engine(model_dir, spec, max_num_seqs=256)
    tap = Tap(engine, spec["num_speculative_tokens"])
    with_q: list[int] = []
    rule = sampling.speculative_accept  # (wrong_rule.py swaps it)

    def counted(p, q, drafts, *words):
        with_q.extend(drafts.tolist())
        return rule(p, q, drafts, *words)

    sampling.speculative_accept = counted
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=max_tokens, ignore_eos=True)
    try:
        outs = engine.generate([prompt] * NUM_REQUESTS, params, use_tqdm=False)
    finally:
        sampling.speculative_accept = rule
    engine.shutdown()
    return Counter(tuple(o.outputs[0].token_ids) for o in outs), tap, with_q


def draft_model_check(bigram_dir: str, sharp_dir: str) -> tuple[float, int, Tap, int]:
    """(chi-square p-value, dof, Tap, rows verified by min(1, p/q)) of 4-token draws with a
    draft model proposing 2 tokens per step."""
    spec = {"method": "draft_model", "model": sharp_dir, "num_speculative_tokens": 2}
    prompt = prompt_for(bigram_dir)
    observed, tap, with_q = sampled_paths(bigram_dir, {**spec, "adaptive": False}, prompt, 4)
    probs = hf_probability(bigram_dir, prompt, list(observed), 1.0, TOP_K)
    return (*chi_square_p_value(observed, probs, NUM_REQUESTS), tap, len(with_q))


def test_draft_model_sampling_follows_the_target_distribution(bigram_dir, sharp_dir):
    p_value, dof, tap, num_with_q = draft_model_check(bigram_dir, sharp_dir)
    assert num_with_q > NUM_REQUESTS // 2  # the drafts were verified against their q
    assert 0.2 * tap.num_draft_tokens < tap.num_accepted < 0.9 * tap.num_draft_tokens
    assert dof >= 15
    assert p_value > 1e-3, (p_value, dof)


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "in_a_batch"])
def test_seeded_draws_are_reproducible(bigram_dir, sharp_dir, batched):
    """A seeded request's tokens with drafts from q are the non-speculative ones, alone or
    beside other requests (how many positions are drafted differs between the two)."""
    spec = {"method": "draft_model", "model": sharp_dir, "num_speculative_tokens": 3}
    prompt = prompt_for(bigram_dir)
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, logprobs=1) for s in (4, 5)]
    others = [list(range(10 + i, 30 + i)) for i in range(6)] if batched else []
    other_params = [SamplingParams(temperature=0.8, max_tokens=24)] * len(others)
    reference = spec_engine(bigram_dir, None)
    want = reference.generate([prompt] * 2, seeded, use_tqdm=False)
    reference.shutdown()
    engine = spec_engine(bigram_dir, spec)
    tap = Tap(engine, 3)
    got = engine.generate([prompt] * 2 + others, seeded + other_params, use_tqdm=False)
    assert_same(want, got[:2])
    assert 0 < tap.num_accepted < tap.num_draft_tokens
    engine.shutdown()
