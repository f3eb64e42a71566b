"""The engine on CUDA against Hugging Face transformers on CUDA, float32: greedy ids and raw
logprobs, with graphs (the default on CUDA) and eager."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@functools.lru_cache(maxsize=2)
def hf_cuda_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()


@torch.inference_mode()
def hf_greedy_cuda(
    model_dir: str,
    prompt: list[int],
    max_new: int,
) -> tuple[list[int], list[float]]:
    """HF `generate(do_sample=False)` on CUDA: ids and the log_softmax at each chosen id."""
    ids = torch.tensor([prompt], device="cuda")
    # eos_token_id=None: never stop early, like ignore_eos
    out = hf_cuda_model(model_dir).generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    got = out.sequences[0, len(prompt) :].tolist()
    assert len(got) == max_new, "the reference stopped early"
    return got, [
        torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, got)
    ]


def engine_for(model_dir: str, enforce_eager: bool | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model_dir,
            device="cuda",
            dtype="float32",
            max_model_len=512,
            enforce_eager=enforce_eager,
        )
    )


def assert_matches_hf(model_dir: str, engine: LLMEngine, prompts, max_new: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=1)
    try:
        outs = engine.generate(prompts, params, use_tqdm=False)
    finally:
        engine.shutdown()
    for prompt, out in zip(prompts, outs):
        ref_ids, ref_lps = hf_greedy_cuda(model_dir, prompt, max_new)
        got = out.outputs[0]
        assert got.token_ids == ref_ids
        assert np.allclose(got.logprobs, ref_lps, atol=1e-3), (got.logprobs, ref_lps)


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
    assert (engine.stats.graph_replays > 0) == (enforce_eager is None)


@pytest.mark.parametrize("enforce_eager", [None, True], ids=["graphs", "eager"])
def test_tiny_moe_batch_matches_hf_on_cuda(tiny_moe_dir, enforce_eager):
    engine = engine_for(tiny_moe_dir, enforce_eager)
    rng, vocab = random.Random(0), engine.validator.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (17, 33, 40, 49, 58, 71)]
    assert_matches_hf(tiny_moe_dir, engine, prompts, max_new=12)
    assert (engine.stats.graph_replays > 0) == (enforce_eager is None)
