"""Multi-LoRA composed with the engine's other parts, each against PEFT's PeftModel in float32:
preemption under a tiny KV cache, n-gram and suffix speculative decoding (drafts verified
with the adapter), routed-expert capture on an MoE model with adapters on attention, and the
batch-invariant mode (a row's tokens and logprobs the same alone and in a mixed batch)."""

from __future__ import annotations

import numpy as np
import pytest
from raylane import EngineConfig, LLMEngine, LoRARequest, SamplingParams

from tests.hf_reference import router_topk
from tests.lora_adapters import make_adapter, peft_greedy, peft_models
from tests.tiny_models import make_llama, make_qwen3_moe

REPEATS = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]  # n-gram drafts find matches
PROMPTS = [REPEATS, list(range(30, 50)), [60, 61, 62, 60, 61, 62, 60, 61], list(range(90, 101))]
N = 10


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora_compose")
    base = make_llama(root / "base")
    adapters = {
        "a": make_adapter(base, root / "a", seed=4, r=4),
        "b": make_adapter(base, root / "b", seed=5, r=8, target_modules=["q_proj", "up_proj"]),
    }
    names = ["a", None, "b", "a"]
    ref = peft_models(base, adapters)
    expected = [peft_greedy(ref, n, p, N) for n, p in zip(names, PROMPTS)]
    loras = [None if n is None else LoRARequest(n, 1 + "ab".index(n), adapters[n]) for n in names]
    return base, loras, expected


def _generate(base: str, loras, **options):
    config = EngineConfig(model=base, enable_lora=True, max_loras=2, max_lora_rank=8, **options)
    engine = LLMEngine(config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=N, logprobs=1)
        outs = engine.generate(PROMPTS, params, False, loras)
        return [o.outputs[0] for o in outs], engine.stats_snapshot()
    finally:
        engine.shutdown()


def _check(samples, expected) -> None:
    for sample, (tokens, logprobs) in zip(samples, expected):
        assert sample.token_ids == tokens
        assert sample.logprobs == pytest.approx(logprobs, abs=1e-4)


def test_preemption(dense) -> None:
    base, loras, expected = dense
    samples, snap = _generate(base, loras, num_kv_blocks=10, block_size=4)
    assert snap["counters"]["num_preemptions"] > 0
    _check(samples, expected)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_drafts_verified_with_the_adapter(dense, method: str) -> None:
    """n=2: a suffix draft of one sample comes from its sibling's tokens (the same, greedy),
    so verify rows of several tokens are accepted; each sample equals PEFT."""
    base, loras, expected = dense
    spec = {"method": method, "num_speculative_tokens": 3}
    config = EngineConfig(
        model=base, enable_lora=True, max_loras=2, max_lora_rank=8, speculative_config=spec
    )
    engine = LLMEngine(config)
    try:
        params = SamplingParams(n=2, temperature=0.0, max_tokens=N, logprobs=1)
        outs = engine.generate(PROMPTS, params, False, loras)
        spec_stats = engine.stats_snapshot()["spec_decode"]
    finally:
        engine.shutdown()
    for out, (tokens, logprobs) in zip(outs, expected):
        for sample in out.outputs:
            assert sample.token_ids == tokens
            assert sample.logprobs == pytest.approx(logprobs, abs=1e-4)
    # rows verified drafts: those steps' tokens came from verify forwards with the adapters
    assert spec_stats["spec_decode_num_draft_tokens"] > 0
    if method == "suffix":
        assert spec_stats["spec_decode_num_accepted_tokens"] > 0


def test_routed_experts_with_attention_adapters(tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("lora_moe")
    base = make_qwen3_moe(root / "base")
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapter = make_adapter(base, root / "att", seed=6, r=4, target_modules=attention)
    engine = LLMEngine(
        EngineConfig(model=base, enable_lora=True, enable_return_routed_experts=True)
    )
    loras = [LoRARequest("att", 1, adapter), None]
    prompts = PROMPTS[:2]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, return_routed_experts=True)
        outs = engine.generate(prompts, params, False, loras)
    finally:
        engine.shutdown()
    ref = peft_models(base, {"att": adapter})
    for out, prompt, name in zip(outs, prompts, ["att", None]):
        got = out.outputs[0]
        assert got.token_ids == peft_greedy(ref, name, prompt, 6)[0]
        fed = prompt + got.token_ids[:-1]
        if name is None:
            with ref.disable_adapter():
                picks = router_topk(ref, fed).numpy()
        else:
            ref.set_adapter(name)
            picks = router_topk(ref, fed).numpy()
        assert np.array_equal(np.sort(got.routed_experts, -1), np.sort(picks, -1))


def test_batch_invariant_with_lora_rows(dense) -> None:
    base, loras, expected = dense
    config = EngineConfig(
        model=base, enable_lora=True, max_loras=2, max_lora_rank=8, batch_invariant=True
    )
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=N, logprobs=1)
    try:
        together = engine.generate(PROMPTS, params, False, loras)
        alone = [engine.generate([p], params, False, lr)[0] for p, lr in zip(PROMPTS, loras)]
    finally:
        engine.shutdown()
    for x, y, (tokens, _) in zip(together, alone, expected):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids == tokens
        assert x.outputs[0].logprobs == y.outputs[0].logprobs  # bitwise
