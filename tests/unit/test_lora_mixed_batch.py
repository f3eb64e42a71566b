"""Multi-LoRA, the math: rows of two adapters (r=4, and r=8 with rsLoRA on other modules) and
base rows in one batch, each equal to PEFT's PeftModel over the same base model in float32
(greedy tokens equal, logprobs within 1e-4), with serial and async scheduling and through the
graph runner's path (on the CPU its eager replay over static buffers)."""

from __future__ import annotations

import pytest
from raylane import EngineConfig, LLMEngine, LoRARequest, SamplingParams

from tests.lora_adapters import make_adapter, peft_greedy, peft_models
from tests.tiny_models import make_llama, make_qwen2

PROMPTS = [[5, 17, 33, 8, 100, 7], [9, 10, 11, 12], [40, 41, 42], [7, 7, 8, 9, 30, 31, 2]]
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    base = (make_llama if request.param == "llama" else make_qwen2)(root / "base")
    adapters = {
        "a4": make_adapter(base, root / "a4", seed=1, r=4),
        "a8": make_adapter(
            base,
            root / "a8",
            seed=2,
            r=8,
            lora_alpha=4,
            use_rslora=True,
            target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        ),
    }
    ref = peft_models(base, adapters)
    names = ["a4", None, "a8", "a4"]
    expected = [peft_greedy(ref, n, p, MAX_TOKENS) for n, p in zip(names, PROMPTS)]
    return base, adapters, names, expected


def _requests(adapters: dict[str, str], names: list[str | None]) -> list[LoRARequest | None]:
    ids = {"a4": 1, "a8": 2}
    return [None if n is None else LoRARequest(n, ids[n], adapters[n]) for n in names]


@pytest.mark.parametrize(
    "options",
    [
        {"async_scheduling": False},
        {"async_scheduling": True},
        {"async_scheduling": True, "enforce_eager": False},
    ],
    ids=["serial", "async", "graphs"],
)
def test_mixed_batch_equals_peft(setup, options: dict) -> None:
    base, adapters, names, expected = setup
    engine = LLMEngine(
        EngineConfig(
            model=base, enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, **options
        )
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
        outs = engine.generate(PROMPTS, params, False, _requests(adapters, names))
        replays = engine.stats_snapshot()["counters"]["graph_replays"]
    finally:
        engine.shutdown()
    assert (replays > 0) == (options.get("enforce_eager") is False)  # decodes replayed
    for out, name, (tokens, logprobs) in zip(outs, names, expected):
        sample = out.outputs[0]
        assert sample.token_ids == tokens, name
        assert sample.logprobs == pytest.approx(logprobs, abs=1e-4)
        assert sample.lora_versions == (None if name is None else [1] * MAX_TOKENS)
    # the adapters change what the model says (this test could fail)
    assert expected[0][0] != peft_greedy(peft_models(base, adapters), None, PROMPTS[0], 8)[0]


def test_add_request_and_step(setup) -> None:
    base, adapters, names, expected = setup
    engine = LLMEngine(EngineConfig(model=base, enable_lora=True, max_lora_rank=8))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        requests = _requests(adapters, names)
        for i, (prompt, lora) in enumerate(zip(PROMPTS, requests)):
            engine.add_request(f"r{i}", prompt, params, lora_request=lora)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    finally:
        engine.shutdown()
    assert [done[f"r{i}"] for i in range(len(PROMPTS))] == [t for t, _ in expected]


def test_more_adapters_than_slots_wait_their_turn(setup) -> None:
    """max_loras=1: a batch naming both adapters runs the second once the first's requests
    end (vLLM's scheduler does the same), each still equal to PEFT; a waiting request can be
    aborted."""
    base, adapters, names, expected = setup
    engine = LLMEngine(EngineConfig(model=base, enable_lora=True, max_loras=1, max_lora_rank=8))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
        requests = _requests(adapters, names)
        engine.add_request("gone", PROMPTS[0], params, lora_request=requests[0])
        engine.add_request("waits", PROMPTS[2], params, lora_request=requests[2])
        engine.step()
        assert [o.outputs[0].finish_reason for o in engine.abort_request("waits")] == ["abort"]
        engine.abort_request("gone")
        outs = engine.generate(PROMPTS, params, False, requests)
    finally:
        engine.shutdown()
    for out, (tokens, logprobs) in zip(outs, expected):
        assert out.outputs[0].token_ids == tokens
        assert out.outputs[0].logprobs == pytest.approx(logprobs, abs=1e-4)
