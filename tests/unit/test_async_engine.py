"""AsyncLLMEngine against a serial run of the same engine; cancellation frees blocks."""

from __future__ import annotations

import asyncio

import pytest
from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_qwen3_dir))


def prompts(vocab: int) -> list[list[int]]:
    return [[(11 * i + j) % (vocab - 5) + 5 for j in range(8 + 9 * i)] for i in range(6)]


async def collect(engine: AsyncLLMEngine, prompt, params, rid: str):
    outs = [out async for out in engine.generate(prompt, params, rid)]
    return outs


async def test_concurrent_requests_equal_serial_run(engine):
    ps = prompts(engine.validator.vocab_size)
    params = SamplingParams(temperature=0.7, max_tokens=12, seed=3, ignore_eos=True, logprobs=0)
    serial = [engine.generate([p], params, use_tqdm=False)[0] for p in ps]
    aeng = AsyncLLMEngine(engine)
    results = await asyncio.gather(*(collect(aeng, p, params, f"r{i}") for i, p in enumerate(ps)))
    for outs, ref in zip(results, serial):
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        assert final.outputs[0].token_ids == ref.outputs[0].token_ids
        # outputs are cumulative: each is a prefix of the next
        ids = [o.outputs[0].token_ids for o in outs]
        assert all(b[: len(a)] == a and len(b) >= len(a) for a, b in zip(ids, ids[1:]))
    await aeng.shutdown()


async def test_cancel_aborts_and_frees_blocks(engine):
    aeng = AsyncLLMEngine(engine)
    ps = prompts(engine.validator.vocab_size)
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def consume_two():
        seen = 0
        async for _ in aeng.generate(ps[5], long, "cancel-me"):
            seen += 1
            if seen == 2:
                break  # leaving the iterator aborts the request
        return seen

    task = asyncio.create_task(collect(aeng, ps[4], long, "cancel-task"))
    assert await consume_two() == 2
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.02)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    await aeng.shutdown()


async def test_bad_request_raises_value_error(engine):
    aeng = AsyncLLMEngine(engine)
    with pytest.raises(ValueError, match="prompt"):
        await collect(aeng, [], SamplingParams(), "bad")
    await aeng.shutdown()


async def test_external_abort_ends_the_consumer_with_abort(engine):
    aeng = AsyncLLMEngine(engine)
    ps = prompts(engine.validator.vocab_size)
    seen = []

    async def consume():
        async for out in aeng.generate(
            ps[3], SamplingParams(max_tokens=300, ignore_eos=True), "external-abort"
        ):
            seen.append(out)
            if len(seen) == 2:
                await aeng.abort("external-abort")
        return seen[-1]

    final = await asyncio.wait_for(consume(), timeout=30)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    await aeng.shutdown()
