"""Sampling with drafts keeps the target's distribution: a chi-square test of 3-token
continuations drawn over many seeds against the probabilities Hugging Face's forward of the
same model gives (the naive reference: its logits at each position, top-k kept, softmax at
temperature T), with drafts both accepted and rejected along the way."""

from __future__ import annotations

from collections import Counter

import pytest
from raylane.actors.engine import SamplingParams

from tests.unit.spec.helpers import (
    Tap,
    chi_square_p_value,
    hf_probability,
    make_loopy_llama,
    spec_engine,
)

TEMPERATURE = 1.0
TOP_K = 3  # 27 continuations: each one is expected often enough for the test
NUM_SEEDS = 800
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory) -> str:
    """The tiny Llama with no attention output: the next token's distribution depends on the
    current token only, so sampled paths revisit the prompt's and n-gram drafts often hold."""
    return make_loopy_llama(tmp_path_factory.mktemp("bigram") / "model", attention_scale=0.0)


def test_sampled_continuations_follow_the_target_distribution(bigram_dir):
    loopy_dir = bigram_dir
    reference = spec_engine(loopy_dir, None, max_num_seqs=256)
    # a prompt the model's own greedy path fills: n-gram drafts then follow its loop, and a
    # sampled token sometimes leaves it (rejections)
    head = [200, 218, 23, 135, 264, 251, 17]
    tail = reference.generate([head], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    prompt = head + tail[0].outputs[0].token_ids
    params = [
        SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=s, max_tokens=3, ignore_eos=True)
        for s in range(NUM_SEEDS)
    ]
    engine = spec_engine(loopy_dir, NGRAM, max_num_seqs=256)
    tap = Tap(engine, 2)
    outs = engine.generate([prompt] * NUM_SEEDS, params, use_tqdm=False)
    triples = [tuple(o.outputs[0].token_ids) for o in outs]
    # the position-keyed words make each seed's draw the non-speculative one
    ref = reference.generate([prompt] * NUM_SEEDS, params, use_tqdm=False)
    assert triples == [tuple(o.outputs[0].token_ids) for o in ref]
    # drafts were verified on both paths: some accepted, some rejected
    assert 0 < tap.num_accepted < tap.num_draft_tokens
    observed = Counter(triples)
    probs = hf_probability(loopy_dir, prompt, list(observed), TEMPERATURE, TOP_K)
    p_value, dof = chi_square_p_value(observed, probs, NUM_SEEDS)
    assert dof >= 15
    assert p_value > 1e-3, (p_value, dof)
    # and the test bites: the same draws scored against a distribution at another temperature
    wrong = hf_probability(loopy_dir, prompt, list(observed), 0.6, TOP_K)
    assert chi_square_p_value(observed, wrong, NUM_SEEDS)[0] < 1e-6
    engine.shutdown()
    reference.shutdown()
