"""Concurrency contracts: one turn at a time per session, sessions in parallel, delete waits."""

from __future__ import annotations

import asyncio
import gc
import weakref
from contextlib import aclosing

import pytest
from raylane.router.errors import SessionNotFound

from tests.tiny_models import make_tokenizer
from tests.unit.sessions_helpers import Agent, make_registry, user


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


async def settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def test_turns_of_one_session_run_one_at_a_time(tok):
    gate = asyncio.Event()
    registry, gen = make_registry(tok, gate=gate)
    sid = await registry.create()
    first = asyncio.create_task(registry.chat(sid, [user("hello")]))
    retry = asyncio.create_task(registry.chat(sid, [user("hello")]))
    await settle()
    assert gen.in_flight == 1  # the second waits for the session, not for the generator
    gate.set()
    a, b = await asyncio.gather(first, retry)
    # the second ran after the first committed: it saw the first turn and retried it
    assert (a.rolled_back, b.rolled_back) == (0, 1)
    assert len((await registry.get(sid)).trajectory) == 1


async def test_different_sessions_run_in_parallel(tok):
    gate = asyncio.Event()
    registry, gen = make_registry(tok, gate=gate)
    ids = [await registry.create() for _ in range(3)]
    tasks = [asyncio.create_task(registry.chat(sid, [user("hello")])) for sid in ids]
    await settle()
    assert gen.in_flight == 3
    gate.set()
    await asyncio.gather(*tasks)
    assert all([len((await registry.get(sid)).trajectory) == 1 for sid in ids])


async def held_turn_then_delete(tok):
    """A session with a turn held in flight by the gate and a delete waiting behind it."""
    gate = asyncio.Event()
    registry, gen = make_registry(tok, gate=gate)
    sid = await registry.create()
    turn = asyncio.create_task(registry.chat(sid, [user("hello")]))
    await settle()
    delete = asyncio.create_task(registry.delete(sid))
    return registry, gen, gate, sid, turn, delete


async def test_delete_waits_for_the_in_flight_turn(tok):
    registry, gen, gate, sid, turn, delete = await held_turn_then_delete(tok)
    await settle()
    assert not delete.done() and sid in registry and gen.in_flight == 1
    gate.set()
    result = await turn  # the turn completes normally
    await delete
    assert result.message is not None and sid not in registry


async def test_everything_after_delete_is_not_found(tok):
    registry, _, gate, sid, turn, delete = await held_turn_then_delete(tok)
    queued = asyncio.create_task(registry.chat(sid, [user("queued behind the delete")]))
    await settle()
    gate.set()
    await turn
    await delete
    with pytest.raises(SessionNotFound) as err:
        await queued
    assert err.value.status == 404
    for call in (registry.chat(sid, [user("x")]), registry.delete(sid)):
        with pytest.raises(SessionNotFound):
            await call
    for call in (registry.get(sid), registry.describe(sid), registry.sample(sid)):
        with pytest.raises(SessionNotFound):
            await call


async def test_rapid_create_chat_delete_leaves_nothing_behind(tok):
    registry, gen = make_registry(tok)
    refs = []

    async def cycle(i: int) -> None:
        agent = await Agent.start(registry)
        refs.append(weakref.ref(await registry.get(agent.id)))
        await agent.user(f"hello {i}")
        await agent.user("again")
        await registry.delete(agent.id)

    await asyncio.gather(*(cycle(i) for i in range(40)))
    gc.collect()
    assert len(registry) == 0 and gen.in_flight == 0 and registry.retained_blob_bytes() == 0
    assert all(ref() is None for ref in refs)


async def test_a_turn_abandoned_mid_stream_leaves_no_trace(tok):
    registry, gen = make_registry(tok)
    agent = await Agent.start(registry)
    await agent.user("hello")
    before = await registry.describe(agent.id)
    async with aclosing(registry.chat_stream(agent.id, agent.messages + [user("more")])) as s:
        async for progress in s:
            assert progress.message is None  # still in flight
            break  # the client went away
    assert await registry.describe(agent.id) == before and gen.in_flight == 0
    await agent.user("more")  # the lock was released
    assert len((await registry.get(agent.id)).trajectory) == 2


async def test_a_failing_generator_leaves_no_trace(tok):
    registry, gen = make_registry(tok)
    agent = await Agent.start(registry)
    await agent.user("hello")
    before = await registry.describe(agent.id)

    def broken(prompt_ids):
        raise ValueError("prompt: too long for max_model_len")

    gen.reply = broken
    with pytest.raises(ValueError, match="max_model_len"):
        await registry.chat(agent.id, agent.messages + [user("more")])
    assert await registry.describe(agent.id) == before


async def test_session_ids_are_unguessable(tok):
    registry, _ = make_registry(tok)
    ids = {await registry.create() for _ in range(200)}
    assert len(ids) == 200 and all(len(i) >= 24 for i in ids)
