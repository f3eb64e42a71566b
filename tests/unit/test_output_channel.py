"""The replica's output channel takes each output as the engine fans it out
(`RequestStream.forward`): a step that failed reaches the channel as `RequestFailed` for each of
its requests, which the engine then forgets, and the channel serves on; closing the channel
aborts what still runs on it."""

from __future__ import annotations

import asyncio

from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from raylane.actors.engine.errors import RequestFailed
from raylane.actors.output_channel import OutputChannel

from tests.support.faults import arm_fault

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


async def _until_done(channel: OutputChannel, ids: set[str]) -> dict[str, list]:
    """Each request's items off the channel's batches until every one in `ids` ended."""
    items: dict[str, list] = {rid: [] for rid in ids}
    ended: set[str] = set()
    async for batch in channel.batches():
        for rid, item in batch:
            items[rid].append(item)
            if isinstance(item, Exception) or item.finished:
                ended.add(rid)
        if ended == ids:
            return items
    raise AssertionError("the channel ended first")


async def _run(engine: LLMEngine) -> tuple[dict, dict, int]:
    aeng, channel = AsyncLLMEngine(engine), OutputChannel()
    arm_fault(engine, "forward", 1)  # the first step raises on the runner
    for rid in ("a", "b"):
        channel.start(await aeng.add_request([5, 6, 7], GREEDY, rid))
    failed = await _until_done(channel, {"a", "b"})
    held_after_fault = aeng.num_requests
    channel.start(await aeng.add_request([5, 6, 7], GREEDY, "c"))
    served = await _until_done(channel, {"c"})
    channel.start(await aeng.add_request([8, 9], GREEDY, "d"))
    channel.close()  # its caller is gone: "d" is aborted and released
    await asyncio.sleep(0.05)
    held = aeng.num_requests + held_after_fault
    await aeng.shutdown()
    return failed, served, held


def test_a_failed_step_reaches_the_channel_and_the_channel_serves_on(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, max_model_len=256, num_kv_blocks=64))
    failed, served, held = asyncio.run(asyncio.wait_for(_run(engine), timeout=30))
    for rid in ("a", "b"):
        assert isinstance(failed[rid][-1], RequestFailed), failed[rid]
    tokens = [t for d in served["c"] for t in d.outputs[0].token_ids]
    (want,) = engine.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert tokens == want.outputs[0].token_ids and served["c"][-1].finished
    assert held == 0 and not engine.requests  # nothing left behind, "d" included
