"""A 5-turn session with tool messages on the tiny Qwen3-MoE, checked against the engine's own
outputs for every turn."""

from __future__ import annotations

import pytest
from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from raylane.actors.engine.output_accumulator import accumulate
from raylane.router.generator import RequestTurnGenerator
from raylane.router.replica_calls import LocalReplica
from raylane.router.sessions import SessionRegistry
from raylane.router.tito import TemplateSplicer

from tests.unit.sessions_helpers import Agent, rendered, user

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TURNS = [
    [{"role": "system", "content": "You call tools."}, user("Weather in Berlin?")],
    [{"role": "tool", "content": '{"city": "Berlin", "temp": 21}'}],
    [user("And tomorrow?")],
    [{"role": "tool", "content": '{"temp": 19}'}, {"role": "tool", "content": '{"rain": 0.2}'}],
    [user("Thanks!")],
]


class SpyEngine:
    """Passes through to the engine and keeps each request's deltas; their final output, as
    the engine's own `generate` builds it, is the reference."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.deltas: dict[str, list] = {}

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def generate_deltas(self, prompt, params, request_id):
        async for delta in self.engine.generate_deltas(prompt, params, request_id):
            self.deltas.setdefault(request_id, []).append(delta)
            yield delta

    @property
    def finals(self) -> list:
        return [accumulate(deltas) for deltas in self.deltas.values()]


@pytest.fixture(scope="module")
def engine(tiny_moe_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_moe_dir, enable_return_routed_experts=True))


async def test_five_turns_with_tools_merge_to_the_engines_outputs(engine):
    spy = SpyEngine(AsyncLLMEngine(engine))
    registry = SessionRegistry(
        TemplateSplicer(engine.tokenizer),
        RequestTurnGenerator(LocalReplica(spy), return_routed_experts=True),
    )
    agent = await Agent.start(registry)
    for i, new in enumerate(TURNS):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=8)
        await agent.say(*new, params=params, tools=TOOLS)
    await spy.engine.shutdown()
    finals = spy.finals
    assert len(finals) == 5
    s = await registry.sample(agent.id)
    last = finals[-1]
    assert s.tokens == last.prompt_token_ids + last.outputs[0].token_ids
    mask = [0] * len(s.tokens)
    logprobs = [0.0] * len(s.tokens)
    for out in finals:  # each turn's prompt + output is a prefix of the trajectory
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        assert s.tokens[: len(ids)] == ids
        start = len(out.prompt_token_ids)
        mask[start : len(ids)] = [1] * (len(ids) - start)
        logprobs[start : len(ids)] = out.outputs[0].logprobs
    assert s.loss_mask == mask and s.rollout_logprobs == logprobs
    assert s.routed_experts.shape[0] == len(s.tokens) - 1
    assert (s.routed_experts == last.outputs[0].routed_experts).all()
    assert finals[0].prompt_token_ids == rendered(engine.tokenizer, TURNS[0], tools=TOOLS)
    assert s.weight_versions == [out.weight_version for out in finals]
