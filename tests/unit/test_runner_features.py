"""The runner's feature seam (actors/runner/features/): a feature defined here, plugged in by
`register` alone, takes part in every step. It adds a fixed bias to the logits rows of the
requests whose seed is BIASED_SEED (sampling rows and prompt-logprob rows); the engine's
greedy tokens, logprobs and prompt logprobs then equal Hugging Face's forward with the same
bias added, argmax and log_softmax computed here, and the other requests of the same batch
equal the plain forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from raylane.actors.runner.features import FEATURES, RunnerFeature, register, unregister

from tests.hf_reference import hf_model
from tests.unit.test_engine_parity import engine_for, greedy, prompts_for

BIASED_SEED = 4242
MAX_NEW = 10


def logit_bias(vocab: int) -> torch.Tensor:
    """[vocab]: a smooth, large swing over the ids (it changes the greedy picks)."""
    return 8.0 * torch.cos(torch.arange(vocab, dtype=torch.float32) * 0.37)


class SeededBias(RunnerFeature):
    name = "test_seeded_bias"

    @classmethod
    def enabled(cls, config, model) -> bool:
        return True

    def after_logits(self, scheduled, step, logits: torch.Tensor) -> torch.Tensor:
        bias = logit_bias(logits.shape[1]).to(logits.device, logits.dtype)
        for item, (first, count) in zip(scheduled, step.logits_rows):
            if item.state.params.seed == BIASED_SEED:
                logits[first : first + count] += bias
        return logits


@pytest.fixture
def seeded_bias():
    register(SeededBias)
    try:
        yield SeededBias
    finally:
        unregister(SeededBias)
    assert SeededBias not in FEATURES


@torch.inference_mode()
def reference(model_dir: str, prompt: list[int], biased: bool, max_new: int = MAX_NEW):
    """Greedy ids, their logprobs, and each prompt token's logprob (from position 1), from
    full HF forwards with the bias added to every row's logits when `biased`."""
    model = hf_model(model_dir)
    ids = list(prompt)
    tokens, logprobs = [], []
    prompt_lps: list[float] = []
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[0].float()  # [len(ids), vocab]
        if biased:
            logits = logits + logit_bias(logits.shape[1])
        lp = torch.log_softmax(logits, dim=-1)
        if not prompt_lps:
            prompt_lps = [lp[t - 1, prompt[t]].item() for t in range(1, len(prompt))]
        token = int(lp[-1].argmax())
        tokens.append(token)
        logprobs.append(lp[-1, token].item())
        ids.append(token)
    return tokens, logprobs, prompt_lps


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graph-runner"])
def test_a_registered_feature_changes_exactly_its_rows(tiny_llama_dir, seeded_bias, enforce_eager):
    engine = engine_for(tiny_llama_dir, max_num_batched_tokens=128, enforce_eager=enforce_eager)
    try:
        prompts = prompts_for(engine.validator.vocab_size, seed=3, count=4)
        chosen = [True, False, True, False]  # biased and plain rows share every step
        params = [
            greedy(MAX_NEW, seed=BIASED_SEED if c else None, prompt_logprobs=1) for c in chosen
        ]
        outs = engine.generate(prompts, params, use_tqdm=False)
    finally:
        engine.shutdown()
    for prompt, biased, out in zip(prompts, chosen, outs):
        ids, lps, prompt_lps = reference(tiny_llama_dir, prompt, biased)
        got = out.outputs[0]
        assert got.token_ids == ids, (biased, got.token_ids, ids)
        np.testing.assert_allclose(got.logprobs, lps, rtol=0, atol=1e-4)
        got_prompt = [entry[t] for entry, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        np.testing.assert_allclose(got_prompt, prompt_lps, rtol=0, atol=1e-4)
    # the bias matters: the biased rows' greedy continuation is not the plain one
    for prompt, out in zip(prompts[::2], outs[::2]):
        plain_ids = reference(tiny_llama_dir, prompt, biased=False)[0]
        assert out.outputs[0].token_ids != plain_ids


def test_an_unregistered_feature_is_gone_from_new_engines(tiny_llama_dir):
    register(SeededBias)
    unregister(SeededBias)
    engine = engine_for(tiny_llama_dir)
    try:
        prompt = prompts_for(engine.validator.vocab_size, seed=3, count=1)[0]
        (out,) = engine.generate([prompt], greedy(MAX_NEW, seed=BIASED_SEED), use_tqdm=False)
    finally:
        engine.shutdown()
    assert out.outputs[0].token_ids == reference(tiny_llama_dir, prompt, biased=False)[0]
