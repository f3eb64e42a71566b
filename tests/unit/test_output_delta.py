"""Deltas between processes: encoding a request's cumulative outputs and decoding them gives
back exactly those outputs (reference: the engine's own cumulative outputs), while each delta
carries only what the step added."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest
from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from raylane.actors.engine.output_delta import DeltaDecoder, DeltaEncoder


async def _cumulative(engine, prompt, params) -> list:
    aeng = AsyncLLMEngine(engine)
    return [out async for out in aeng.generate(prompt, params, "r")]


def _same(a, b) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids and a.finished == b.finished
    assert a.prompt_logprobs == b.prompt_logprobs
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs):
        for name in (
            "index",
            "text",
            "token_ids",
            "logprobs",
            "top_logprobs",
            "finish_reason",
            "stop_reason",
            "weight_versions",
            "kept_mass_logprobs",
        ):
            assert getattr(x, name) == getattr(y, name), name
        if x.routed_experts is None:
            assert y.routed_experts is None
        else:
            np.testing.assert_array_equal(x.routed_experts, y.routed_experts)


@pytest.mark.parametrize(
    "model, params",
    [
        (
            "tiny_llama_dir",
            SamplingParams(
                max_tokens=24,
                temperature=0.8,
                seed=3,
                n=2,
                logprobs=2,
                prompt_logprobs=1,
                return_kept_mass=True,
                top_k=20,
            ),
        ),
        (
            "tiny_moe_dir",
            SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, return_routed_experts=True),
        ),
    ],
)
def test_decoded_deltas_equal_the_cumulative_outputs(request, model, params):
    model_dir = request.getfixturevalue(model)
    engine = LLMEngine(
        EngineConfig(model=model_dir, enable_return_routed_experts=True, max_num_batched_tokens=8)
    )  # chunked prefill: several steps
    prompt = [(7 * i) % 200 + 3 for i in range(21)]
    outs = asyncio.run(_cumulative(engine, prompt, params))
    assert len(outs) > 3
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    decoded = [decoder.decode(pickle.loads(pickle.dumps(encoder.encode(o)))) for o in outs]
    for got, want in zip(decoded, outs):
        _same(got, want)
    _same(decoded[0], outs[0])  # earlier outputs were not changed by later ones


def test_a_delta_carries_only_the_new_tokens(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir))
    params = SamplingParams(max_tokens=64, ignore_eos=True, logprobs=1)
    outs = asyncio.run(_cumulative(engine, [5, 6, 7], params))
    encoder = DeltaEncoder()
    deltas = [encoder.encode(o) for o in outs]
    sizes = [len(d.outputs[0].token_ids) for d in deltas]
    assert sum(sizes) == 64 and max(sizes) <= 2
    size = [len(pickle.dumps(x)) for x in (deltas[8], deltas[-1], outs[8], outs[-1])]
    # a cumulative output grows with every token; a delta only with the text (sent whole)
    assert size[1] - size[0] < (size[3] - size[2]) / 4, size
