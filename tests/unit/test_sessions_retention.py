"""Blob retention keeps memory O(prefix); no drift against the chat template's rendering."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Awaitable, Callable
from contextlib import aclosing

import pytest
from raylane.router.sessions import SessionConfig, SessionRegistry

from tests.tiny_models import make_tokenizer
from tests.unit.sessions_helpers import Agent, logprobs_for, make_registry, rendered, user

SYSTEM = {"role": "system", "content": "You answer briefly."}


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


async def holding(registry, sid) -> list[bool]:
    return [r.routed_experts is not None for r in (await registry.get(sid)).trajectory.records]


async def nothing(agent: Agent) -> None:
    pass


async def turns(
    tok, config: SessionConfig, count: int, after_each: Callable[[Agent], Awaitable[None]] = nothing
) -> Agent:
    """An agent session that has run `count` turns."""
    registry, _ = make_registry(tok, config)
    agent = await Agent.start(registry)
    await agent.say(SYSTEM, user("turn 0"))
    await after_each(agent)
    for turn in range(1, count):
        await agent.user(f"turn {turn}")
        await after_each(agent)
    return agent


@pytest.mark.parametrize("steps", [0, 1, 2])
async def test_only_the_newest_records_hold_blobs(tok, steps):
    async def check(agent: Agent) -> None:
        held = await holding(agent.registry, agent.id)
        window = min(steps + 1, len(held))
        assert held == [False] * (len(held) - window) + [True] * window

    agent = await turns(tok, SessionConfig(max_rollback_steps=steps), 6, check)
    # ids and logprobs survive everywhere
    for r in (await agent.registry.get(agent.id)).trajectory.records:
        assert r.logprobs == logprobs_for(r.output_ids)


async def test_results_carry_no_blob_the_record_keeps_it(tok):
    registry, _ = make_registry(tok)
    agent = await Agent.start(registry)
    async with aclosing(registry.chat_stream(agent.id, [SYSTEM, user("turn 0")])) as turn:
        results = [result async for result in turn]
    assert results[-1].message is not None
    assert all(r.output.routed_experts is None for r in results)  # never sent to the client
    record = (await registry.get(agent.id)).trajectory.records[-1]
    assert record.routed_experts is not None and record.routed_experts.shape[0] == record.end - 1
    assert results[-1].weight_version == record.weight_version == 7


async def test_dropped_blobs_are_released(tok):
    registry, _ = make_registry(tok)
    agent = await Agent.start(registry)
    await agent.say(SYSTEM, user("turn 0"))
    first = weakref.ref((await registry.get(agent.id)).trajectory.records[0].routed_experts)
    await agent.user("turn 1")
    assert first() is not None  # still inside the window of max_rollback_steps + 1 = 2
    await agent.user("turn 2")
    gc.collect()
    assert first() is None


@pytest.mark.parametrize("steps", [1, 2])
async def test_a_rollback_lands_on_a_record_with_its_blob(tok, steps):
    agent = await turns(tok, SessionConfig(max_rollback_steps=steps), 5)
    registry = agent.registry
    records = (await registry.get(agent.id)).trajectory.records
    tail = records[-1 - steps]  # where a rollback of `steps` turns lands
    assert tail.routed_experts is not None and tail.routed_experts.shape[0] == tail.end - 1
    # retry from just after `tail`'s reply: the kept tail still holds its blob
    traj = (await registry.get(agent.id)).trajectory
    conversation = traj.messages()
    cut = traj.checkpoint_ends()[len(records) - steps]
    result = await registry.chat(agent.id, conversation[:cut] + [user("retry")])
    assert result.rolled_back == steps
    assert (await registry.get(agent.id)).trajectory.records[-2] is tail
    assert tail.routed_experts is not None


async def test_no_dropping_keeps_every_blob(tok):
    agent = await turns(tok, SessionConfig(drop_blobs=False), 4)
    assert all(await holding(agent.registry, agent.id))


async def test_describe_is_json_without_blobs(tok):
    registry, _ = make_registry(tok)
    agent = await Agent.start(registry)
    for turn in range(3):
        await agent.user(f"turn {turn}", tools=[{"type": "function", "function": {"name": "f"}}])
    body = json.loads(json.dumps(await registry.describe(agent.id)))
    assert body["messages"] == agent.messages and body["num_turns"] == 3
    shapes = [r["routed_experts_shape"] for r in body["records"]]
    assert shapes[0] is None and body["records"][0]["routed_experts_dropped"]
    assert shapes[-1] == [body["num_tokens"] - 1, 2, 2]
    assert body["records"][-1]["params"]["logprobs"] == 0  # the registry asks for logprobs


def test_per_turn_samples_are_refused(tok):
    with pytest.raises(ValueError, match="every turn's routed-expert blob"):
        SessionRegistry(None, None, SessionConfig(sample_mode="per_turn"))


async def test_no_drift_when_turns_end_normally(tok):
    registry, _ = make_registry(tok)
    agent = await Agent.start(registry)
    await agent.say(SYSTEM, user("What is the capital of France?"))
    await agent.say({"role": "tool", "content": '{"city": "Paris"}'})
    await agent.user("Thanks, and Germany?")
    tokens = (await registry.sample(agent.id)).tokens
    whole = rendered(tok, agent.messages, generation_prompt=False)
    # the template closes the last reply with "\n" after its <|im_end|>; the session stops there
    assert whole[: len(tokens)] == tokens
    assert tok.decode(whole[len(tokens) :]) == "\n"


async def test_no_drift_where_naive_retokenization_would_differ(tok):
    # replies in ids the tokenizer would never produce for their text (one id per character)
    registry, gen = make_registry(tok, canonical=False)
    agent = await Agent.start(registry)
    await agent.say(SYSTEM, user("What is the capital of France?"))
    await agent.user("And Germany?")
    sample = await registry.sample(agent.id)
    naive = rendered(tok, agent.messages, generation_prompt=False)
    assert naive[: len(sample.tokens)] != sample.tokens  # re-tokenizing would drift
    assert tok.decode(naive).startswith(tok.decode(sample.tokens))  # same text, other ids
    # the session holds exactly what the model saw and produced
    assert sample.tokens[: len(gen.seen[1])] == gen.seen[1]
    records = (await registry.get(agent.id)).trajectory.records
    generated = [t for t, m in zip(sample.tokens, sample.loss_mask) if m]
    assert generated == records[0].output_ids + records[1].output_ids
