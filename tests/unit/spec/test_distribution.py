"""Sampling with drafts keeps the target's distribution: a chi-square test of 3-token
continuations drawn over many seeds against the probabilities Hugging Face's forward of the
same model gives (the naive reference: its logits at each position, top-k kept, softmax at
temperature T), with drafts both accepted and rejected along the way."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from raylane.actors.engine import SamplingParams

from tests.hf_reference import hf_model
from tests.unit.spec.helpers import Tap, make_loopy_llama, spec_engine

TEMPERATURE = 1.0
TOP_K = 3  # 27 continuations: each one is expected often enough for the test
NUM_SEEDS = 800
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory) -> str:
    """The tiny Llama with no attention output: the next token's distribution depends on the
    current token only, so sampled paths revisit the prompt's and n-gram drafts often hold."""
    return make_loopy_llama(tmp_path_factory.mktemp("bigram") / "model", attention_scale=0.0)


@torch.inference_mode()
def hf_probability(model_dir: str, prompt: list[int], triples: list[tuple[int, ...]]) -> dict:
    """P(triple | prompt) under softmax(logits / T), from HF's full forward of every prefix."""
    model = hf_model(model_dir)
    probs = {}
    for triple in triples:
        ids = torch.tensor([prompt + list(triple)])
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + 2].float()
        kth = logits.topk(TOP_K, dim=-1).values[:, -1:]
        p = torch.softmax(logits.masked_fill(logits < kth, float("-inf")) / TEMPERATURE, dim=-1)
        probs[triple] = float(p[0, triple[0]] * p[1, triple[1]] * p[2, triple[2]])
    return probs


def chi_square_p_value(observed: Counter, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's test over the triples expected >= 5 times, the rest pooled in one bin."""
    bins = [t for t in probs if probs[t] * n >= 5]
    obs = [observed[t] for t in bins] + [n - sum(observed[t] for t in bins)]
    exp = [probs[t] * n for t in bins] + [n * (1 - sum(probs[t] for t in bins))]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    dof = len(obs) - 1
    p = torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)).item()
    return p, dof


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
    probs = hf_probability(loopy_dir, prompt, list(observed))
    p_value, dof = chi_square_p_value(observed, probs, NUM_SEEDS)
    assert dof >= 15
    assert p_value > 1e-3, (p_value, dof)
    # and the test bites: the same draws scored against a distribution at another temperature
    global TEMPERATURE
    saved, TEMPERATURE = TEMPERATURE, 0.6
    try:
        wrong = hf_probability(loopy_dir, prompt, list(observed))
    finally:
        TEMPERATURE = saved
    assert chi_square_p_value(observed, wrong, NUM_SEEDS)[0] < 1e-6
    engine.shutdown()
    reference.shutdown()
