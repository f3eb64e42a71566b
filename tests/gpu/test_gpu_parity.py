"""The engine on CUDA against Hugging Face transformers on CUDA, float32: greedy ids and raw
logprobs, with graphs (the default on CUDA) and eager."""

from __future__ import annotations

import random

import numpy as np
import pytest
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams

from tests.gpu.device import DEVICE, ON_CUDA, needs_device
from tests.hf_reference import hf_greedy

pytestmark = needs_device


def engine_for(model_dir: str, enforce_eager: bool | None, **kw) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model_dir,
            device=DEVICE,
            dtype="float32",
            max_model_len=512,
            enforce_eager=enforce_eager,
            **kw,
        )
    )


def assert_matches_hf(model_dir: str, engine: LLMEngine, prompts, max_new: int, **params):
    """Greedy ids equal HF's on the same device, raw logprobs within 1e-3; returns the
    outputs. The engine is shut down either way."""
    sampling = SamplingParams(
        temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=1, **params
    )
    try:
        outs = engine.generate(prompts, sampling, use_tqdm=False)
    finally:
        engine.shutdown()
    for prompt, out in zip(prompts, outs):
        ref_ids, ref_lps = hf_greedy(model_dir, prompt, max_new, device=DEVICE)
        got = out.outputs[0]
        assert got.token_ids == ref_ids
        assert np.allclose(got.logprobs, ref_lps, atol=1e-3), (got.logprobs, ref_lps)
    return outs


def assert_graphs_used(engine: LLMEngine, enforce_eager: bool | None) -> None:
    if ON_CUDA:
        assert (engine.stats.graph_replays > 0) == (enforce_eager is None)


@pytest.mark.parametrize("enforce_eager", [None, True], ids=["graphs", "eager"])
def test_smollm2_chat_batch_matches_hf_on_cuda(smollm2_dir, enforce_eager):
    engine = engine_for(smollm2_dir, enforce_eager)
    questions = [
        "What is 2+2?",
        "Name a color.",
        "Say hello in French.",
        "What is rain?",
        "Write a short greeting for a friend who just moved to a new city far away.",
        "List the planets.",
        "What is Python?",
        "Why is the sky blue? Answer briefly.",
    ]
    prompts = [engine.validator.render_chat([{"role": "user", "content": q}]) for q in questions]
    assert_matches_hf(smollm2_dir, engine, prompts, max_new=16)
    assert_graphs_used(engine, enforce_eager)


@pytest.mark.parametrize("enforce_eager", [None, True], ids=["graphs", "eager"])
def test_tiny_moe_batch_matches_hf_on_cuda(tiny_moe_dir, enforce_eager):
    engine = engine_for(tiny_moe_dir, enforce_eager)
    rng, vocab = random.Random(0), engine.validator.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (17, 33, 40, 49, 58, 71)]
    assert_matches_hf(tiny_moe_dir, engine, prompts, max_new=12)
    assert_graphs_used(engine, enforce_eager)
