"""Rollback: a turn whose messages diverge attaches at the latest generated checkpoint."""

from __future__ import annotations

import pytest
from raylane.router.errors import BadRole, BadSessionRequest, RollbackTooDeep
from raylane.router.sessions import SessionConfig

from tests.tiny_models import make_tokenizer
from tests.unit.sessions_helpers import Agent, make_registry, rendered, user

SYSTEM = {"role": "system", "content": "You answer briefly."}


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


async def snapshot(registry, session_id):
    session = await registry.get(session_id)
    return session.describe(), [r.routed_experts for r in session.trajectory.records]


async def test_retry_the_last_turn(tok):
    registry, gen = make_registry(tok)
    agent = await Agent.start(registry)
    await agent.say(SYSTEM, user("first"))
    await agent.user("second")
    first_record = (await registry.get(agent.id)).trajectory.records[0]
    retry = agent.messages[:-1]  # up to and including "second", without its reply
    result = await registry.chat(agent.id, retry)
    assert result.rolled_back == 1
    assert gen.seen[-1] == gen.seen[1]  # the same prompt ids as the original second turn
    traj = (await registry.get(agent.id)).trajectory
    assert len(traj) == 2 and traj.records[0] is first_record
    assert traj.messages() == retry + [result.message]


async def test_retry_the_last_turn_with_different_words(tok):
    registry, gen = make_registry(tok)
    agent = await Agent.start(registry)
    first = await agent.say(SYSTEM, user("first"))
    await agent.user("second")
    conversation = [SYSTEM, user("first"), first.message, user("second, reworded")]
    result = await registry.chat(agent.id, conversation)
    assert result.rolled_back == 1
    assert gen.seen[-1] == rendered(tok, conversation)  # canonical replies: no drift


async def test_retry_the_first_turn(tok):
    registry, gen = make_registry(tok)
    agent = await Agent.start(registry)
    await agent.say(SYSTEM, user("first"))
    result = await registry.chat(agent.id, [SYSTEM, user("first")])
    assert result.rolled_back == 1
    assert gen.seen == [gen.seen[0], gen.seen[0]]
    assert len((await registry.get(agent.id)).trajectory) == 1


async def test_an_injected_assistant_message_is_not_a_checkpoint(tok):
    registry, gen = make_registry(tok)
    agent = await Agent.start(registry)
    injected = {"role": "assistant", "content": "an answer the client wrote"}
    await agent.say(SYSTEM, user("first"))
    await agent.say(user("second"), injected, user("third"))
    # diverge right after the injected message: the turn must attach after the first reply,
    # not after `injected`, and render `injected` again as prompt text
    conversation = agent.messages[:5] + [user("third, reworded")]
    result = await registry.chat(agent.id, conversation)
    assert result.rolled_back == 1
    traj = (await registry.get(agent.id)).trajectory
    assert [r.new_messages for r in traj.records][1] == conversation[3:]
    assert gen.seen[-1] == rendered(tok, conversation)
    sample = await registry.sample(agent.id)
    generated = [t for t, m in zip(sample.tokens, sample.loss_mask) if m]
    assert generated == traj.records[0].output_ids + traj.records[1].output_ids


async def test_an_edited_reply_becomes_prompt_text(tok):
    registry, gen = make_registry(tok)
    agent = await Agent.start(registry)
    await agent.say(SYSTEM, user("first"))
    await agent.user("second")
    edited = {"role": "assistant", "content": "a better second answer"}
    conversation = agent.messages[:4] + [edited, user("third")]
    result = await registry.chat(agent.id, conversation)
    assert result.rolled_back == 1
    assert gen.seen[-1] == rendered(tok, conversation)
    sample = await registry.sample(agent.id)
    records = (await registry.get(agent.id)).trajectory.records
    assert sum(sample.loss_mask) == sum(len(r.output_ids) for r in records)


async def test_a_two_step_rollback_is_rejected_with_no_state_change(tok):
    registry, gen = make_registry(tok)
    agent = await Agent.start(registry)
    await agent.say(SYSTEM, user("first"))
    await agent.user("second")
    before, blobs = await snapshot(registry, agent.id)
    calls = len(gen.seen)
    with pytest.raises(RollbackTooDeep) as err:
        await registry.chat(agent.id, [SYSTEM, user("first, reworded")])
    assert err.value.status == 400 and err.value.discarded == 2
    after, blobs_after = await snapshot(registry, agent.id)
    assert after == before and all(a is b for a, b in zip(blobs, blobs_after))
    assert len(gen.seen) == calls  # nothing was generated
    await agent.user("third")  # the session still works


async def test_two_steps_allowed_when_configured(tok):
    registry, _ = make_registry(tok, SessionConfig(max_rollback_steps=2))
    agent = await Agent.start(registry)
    await agent.say(SYSTEM, user("first"))
    await agent.user("second")
    result = await registry.chat(agent.id, [SYSTEM, user("first, reworded")])
    assert result.rolled_back == 2 and len((await registry.get(agent.id)).trajectory) == 1


@pytest.mark.parametrize(
    "messages, error",
    [
        ([], BadSessionRequest),
        ([{"role": "wizard", "content": "x"}], BadRole),
        ([{"role": "user", "content": 3}], BadSessionRequest),
        ("resend", BadRole),  # the stored conversation as is: nothing new to answer
        ("resend+assistant", BadRole),  # an assistant message right after the stored reply
        ("system", BadRole),  # the tiny template drops a system message that is not first
    ],
)
async def test_rejected_requests_leave_no_trace(tok, messages, error):
    registry, gen = make_registry(tok)
    agent = await Agent.start(registry)
    await agent.say(SYSTEM, user("first"))
    tail = {
        "resend": [],
        "resend+assistant": [{"role": "assistant", "content": "x"}, user("y")],
        "system": [{"role": "system", "content": "be terse"}],
    }
    if isinstance(messages, str):
        messages = agent.messages + tail[messages]
    before, _ = await snapshot(registry, agent.id)
    with pytest.raises(error) as err:
        await registry.chat(agent.id, messages)
    assert err.value.status == 400
    assert (await snapshot(registry, agent.id))[0] == before and len(gen.seen) == 1


async def test_n_above_one_is_rejected(tok):
    from raylane.actors.engine import SamplingParams

    registry, _ = make_registry(tok)
    sid = await registry.create()
    with pytest.raises(BadSessionRequest, match="n must be 1"):
        await registry.chat(sid, [user("hi")], SamplingParams(n=2))
    assert len((await registry.get(sid)).trajectory) == 0
