"""The engine's deltas (`EngineCoreOutput`) and the cumulative outputs folded from them.

References: the request's own state read straight from its sequences (`Request.output`, which
never sees a delta), the serial `LLMEngine.generate`, and the size of a pickled step message
against the prompt's length.
"""

from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest
from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from raylane.actors.engine.output_accumulator import OutputAccumulator, accumulate
from raylane.actors.engine.outputs import EngineCoreOutput, SampleDelta

FIELDS = (
    "index",
    "token_ids",
    "logprobs",
    "top_logprobs",
    "finish_reason",
    "stop_reason",
    "weight_versions",
    "kept_mass_logprobs",
)


def _same(got, want, text: bool = True) -> None:
    assert got.prompt_token_ids == want.prompt_token_ids and got.finished == want.finished
    assert got.prompt_logprobs == want.prompt_logprobs
    assert len(got.outputs) == len(want.outputs)
    for x, y in zip(got.outputs, want.outputs):
        for name in FIELDS + (("text",) if text else ()):
            assert getattr(x, name) == getattr(y, name), name
        if y.routed_experts is None:
            assert x.routed_experts is None
        else:
            np.testing.assert_array_equal(x.routed_experts, y.routed_experts)


def _steps(engine: LLMEngine, prompt, params, rid: str = "r"):
    """(delta, the request's own cumulative output) after every step that advanced it."""
    engine.admit(rid, prompt, params)
    request = engine.requests[rid]  # kept: the engine forgets it once finished
    pairs = []
    while engine.has_unfinished_requests():
        for delta in engine.step_deltas():
            pairs.append((pickle.loads(pickle.dumps(delta)), request.output(0)))
    return pairs


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
def test_folded_deltas_equal_the_requests_own_outputs(request, model, params):
    model_dir = request.getfixturevalue(model)
    engine = LLMEngine(
        EngineConfig(model=model_dir, enable_return_routed_experts=True, max_num_batched_tokens=8)
    )  # chunked prefill: several steps
    prompt = [(7 * i) % 200 + 3 for i in range(21)]
    pairs = _steps(engine, prompt, params)
    assert len(pairs) > 3
    acc, snapshots = OutputAccumulator(), []
    for delta, want in pairs:
        acc.add(delta)
        snapshots.append(acc.output())
        _same(snapshots[-1], want)
    _same(snapshots[0], pairs[0][1])  # earlier outputs were not changed by later ones
    assert pairs[0][0].prompt_token_ids == prompt
    assert all(d.prompt_token_ids is None for d, _ in pairs[1:])  # the prompt goes once
    engine.shutdown()


def test_bytes_per_step_do_not_grow_with_the_prompt(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, max_model_len=1024))
    params = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    sizes = {}
    for length in (8, 900):
        prompt = [(5 * i) % 200 + 3 for i in range(length)]
        pairs = _steps(engine, prompt, params, f"len{length}")
        deltas = [d for d, _ in pairs]
        assert sum(len(d.outputs[0].token_ids) for d in deltas) == 32
        sizes[length] = [len(pickle.dumps(d)) for d in deltas]
        cumulative = len(pickle.dumps(pairs[-1][1]))
        # the cumulative output carries the prompt (and its logprobs) each time; a delta once
        assert max(sizes[length][1:]) < cumulative / 4 if length == 900 else True
    # after the first, a step's message is the same size whatever the prompt's length
    assert max(sizes[900][1:]) <= max(sizes[8][1:]) + 16, sizes
    assert sizes[900][0] > 10 * sizes[8][0]  # the first carries the prompt
    engine.shutdown()


def _stream_texts(engine: LLMEngine, prompt, params) -> tuple[list[str], str]:
    pairs = _steps(engine, prompt, params)
    texts, sent = [], ""
    for delta, own in pairs:
        if delta.outputs:
            texts.append(delta.outputs[0].text)
            sent += texts[-1]
            # what is held back is exactly the rest of the sequence's text so far
            assert sent + delta.outputs[0].held_text == own.outputs[0].text
    return texts, pairs[-1][1].outputs[0].text


def test_stop_strings_never_retract_streamed_text(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir))
    prompt = [5, 6, 7, 8]
    base = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=11)
    _, full = _stream_texts(engine, prompt, base)
    assert len(full) > 20
    for start, width, include in ((9, 3, False), (14, 4, True), (5, 2, False)):
        stop = full[start : start + width]
        params = SamplingParams(
            max_tokens=40,
            ignore_eos=True,
            temperature=1.0,
            seed=11,
            stop=[stop, "\x00never"],
            include_stop_str_in_output=include,
        )
        texts, final = _stream_texts(engine, prompt, params)
        # the reference: the unstopped text cut at the stop string's first occurrence
        at = full.find(stop)
        assert final == full[: at + len(stop) if include else at]
        assert "".join(texts) == final  # every delta only appends
    engine.shutdown()


def test_offline_generate_equals_folded_async_deltas(tiny_qwen3_dir):
    engine = LLMEngine(EngineConfig(model=tiny_qwen3_dir))
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=3, logprobs=1, stop=["a"])
    prompts = [[9, 10, 11], [12, 13, 14, 15, 16]]
    serial = engine.generate(prompts, params, use_tqdm=False)

    async def run(i: int, prompt):
        aeng = AsyncLLMEngine(engine)
        deltas = [d async for d in aeng.generate_deltas(prompt, params, f"a{i}")]
        outs = [o async for o in aeng.generate(prompt, params, f"b{i}")]
        await aeng.shutdown()
        return deltas, outs

    for i, (prompt, ref) in enumerate(zip(prompts, serial)):
        deltas, outs = asyncio.run(run(i, prompt))
        _same(accumulate(deltas), ref)
        _same(outs[-1], ref)
    engine.shutdown()


def test_a_callers_own_last_delta_keeps_what_the_engine_reported():
    # a deadline's end (session_server/streaming/) knows neither version nor cached tokens
    first = EngineCoreOutput(
        "r",
        [SampleDelta(0, "ab", [7, 8], weight_versions=[3, 3])],
        False,
        weight_version=3,
        num_cached_tokens=16,
        prompt_token_ids=list(range(20)),
    )
    last = EngineCoreOutput("r", [SampleDelta(0, "", [], finish_reason="abort")], True)
    out = accumulate([first, last])
    assert (out.weight_version, out.num_cached_tokens, out.finished) == (3, 16, True)
    c = out.outputs[0]
    assert (c.text, c.token_ids, c.weight_versions, c.finish_reason) == (
        "ab",
        [7, 8],
        [3, 3],
        "abort",
    )
    assert out.prompt_token_ids == list(range(20))
