"""What the replica's output channel ships (the engine's deltas as they are, pickled as Ray
sends them): after a request's first message, a step's message is the same size whatever the
prompt's length, and the tokens the batches carry are exactly the request's."""

from __future__ import annotations

import asyncio
import pickle

from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from raylane.actors.output_channel import OutputChannel

MAX_TOKENS = 24


async def _messages(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], list[int]]:
    """(pickled size of each batch, the token ids the batches carried)."""
    aeng, channel = AsyncLLMEngine(engine), OutputChannel()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    channel.start(await aeng.add_request(prompt, params, "r"))
    sizes, ids = [], []
    async for batch in channel.batches():
        sizes.append(len(pickle.dumps(batch, protocol=5)))
        ((_, delta),) = batch
        ids += delta.outputs[0].token_ids
        if delta.finished:
            break
    channel.close()
    await aeng.shutdown()
    return sizes, ids


def test_a_step_message_does_not_grow_with_the_prompt(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, max_model_len=1024))
    short, long = [5, 6, 7], [(3 * i) % 200 + 3 for i in range(900)]
    (s_sizes, s_ids), (l_sizes, l_ids) = (asyncio.run(_messages(engine, p)) for p in (short, long))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [out.outputs[0].token_ids for out in engine.generate([short, long], greedy)]
    assert (s_ids, l_ids) == (want[0], want[1])
    assert max(l_sizes[1:]) <= max(s_sizes[1:]) + 16, (s_sizes, l_sizes)
    assert l_sizes[0] > 900  # the prompt goes once, with the first message
    engine.shutdown()
