"""Multi-LoRA through AsyncLLMEngine: concurrent requests on two adapters and the base model
equal the serial LLMEngine's outputs, and an adapter update made while a request streams
leaves that request on its version (the one after it runs on the new one)."""

from __future__ import annotations

import asyncio

import pytest
from raylane import AsyncLLMEngine, EngineConfig, LLMEngine, LoRARequest, SamplingParams

from tests.lora_adapters import make_adapter
from tests.tiny_models import make_llama

PROMPTS = [[5, 17, 33, 8], [9, 10, 11, 12, 13], [40, 41, 42]]
N = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora_async")
    base = make_llama(root / "base")
    adapters = {
        "a": make_adapter(base, root / "a", seed=9, r=4),
        "b": make_adapter(base, root / "b", seed=10),
    }
    return base, adapters


def _config(base: str) -> EngineConfig:
    return EngineConfig(model=base, enable_lora=True, max_loras=2, max_lora_rank=8)


def test_async_equals_serial_and_keeps_versions(setup) -> None:
    base, adapters = setup
    loras = [LoRARequest("a", 1, adapters["a"]), None, LoRARequest("b", 2, adapters["b"])]
    params = SamplingParams(temperature=0.0, max_tokens=N, logprobs=1)
    serial = LLMEngine(_config(base))
    try:
        expected = serial.generate(PROMPTS, params, False, loras)
        flipped = {
            n: -t if "lora_B" in n else t
            for n, t in serial.loras.weights("a").named_tensors().items()
        }
        serial.update_lora("a", flipped.items())
        expected_v2 = serial.generate([PROMPTS[0]], params, False, LoRARequest("a", 1))[0]
    finally:
        serial.shutdown()

    async def main():
        engine = AsyncLLMEngine(LLMEngine(_config(base)))

        async def run(rid, prompt, lora):
            last = None
            async for out in engine.generate(prompt, params, rid, lora_request=lora):
                last = out
                if (
                    rid == "r0"
                    and len(out.outputs[0].token_ids) == 2
                    and engine.list_loras()[0].version == 1
                ):
                    engine.update_lora("a", flipped.items())  # mid-stream
            return last

        try:
            outs = await asyncio.gather(
                *(run(f"r{i}", p, lr) for i, (p, lr) in enumerate(zip(PROMPTS, loras)))
            )
            after = await run("late", PROMPTS[0], LoRARequest("a", 1))
            return outs, after, engine.list_loras()
        finally:
            await engine.shutdown()
            engine.engine.shutdown()

    outs, after, infos = asyncio.run(main())
    for got, want in zip(outs, expected):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == pytest.approx(want.outputs[0].logprobs, abs=1e-5)
    assert outs[0].outputs[0].lora_versions == [1] * N
    assert [i.version for i in infos if i.name == "a"] == [2]
    assert after.outputs[0].token_ids == expected_v2.outputs[0].token_ids
    assert after.outputs[0].token_ids != expected[0].outputs[0].token_ids
    assert after.outputs[0].lora_versions == [2] * N
