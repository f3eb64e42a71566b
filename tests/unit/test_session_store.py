"""Session stores without a database: the memory-only store keeps nothing past its registry;
a durable store (here a dict of the same JSON a PostgreSQL row holds) gets every change written
through, so a new registry — a restarted Router — carries a conversation on exactly."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
from raylane.actors.engine.sampling_params import SamplingParams, StructuredOutputsParams
from raylane.router.errors import SessionNotFound, SessionStoreUnavailable
from raylane.router.session_codec import decode_session, encode_session
from raylane.router.session_store import MemorySessionStore, open_session_store
from raylane.router.write_through import PURGE_EVERY_S

from tests.tiny_models import make_tokenizer
from tests.unit.session_store_helpers import (
    TURNS,
    Clock,
    JsonStore,
    agent_over,
    registry_over,
    same_sample,
)
from tests.unit.sessions_helpers import user


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


async def test_a_new_registry_carries_the_conversation_on(tok):
    store = JsonStore()
    agent = await agent_over(registry_over(tok, store))
    await agent.user(TURNS[0])
    await agent.user(TURNS[1])
    agent.registry = registry_over(tok, store)  # the Router restarted: memory is empty
    await agent.user(TURNS[2])

    reference = await agent_over(registry_over(tok, JsonStore()))
    for text in TURNS:
        await reference.user(text)
    same_sample(
        await agent.registry.sample(agent.id), await reference.registry.sample(reference.id)
    )
    described = await agent.registry.describe(agent.id)
    assert described["metadata"] == {"run": 7} and described["num_turns"] == 3


async def test_the_memory_store_keeps_nothing(tok):
    store = MemorySessionStore()
    agent = await agent_over(registry_over(tok, store))
    await agent.user(TURNS[0])
    assert await store.load(agent.id) is None and not store.durable
    with pytest.raises(SessionNotFound):
        await registry_over(tok, store).describe(agent.id)
    assert isinstance(open_session_store(None), MemorySessionStore)


async def test_the_stored_copy_drops_superseded_blobs(tok):
    store = JsonStore()
    agent = await agent_over(registry_over(tok, store, max_rollback_steps=1))
    for turn in range(4):
        await agent.user(f"turn {turn}")
    records = store.stored(agent.id)["records"]
    assert [r["routed_experts"] is not None for r in records] == [False, False, True, True]
    assert [r["blobs_dropped"] for r in records] == [True, True, False, False]
    loaded = registry_over(tok, store)
    live = (await agent.registry.get(agent.id)).trajectory.records
    for mine, theirs in zip((await loaded.get(agent.id)).trajectory.records, live):
        assert (mine.routed_experts is None) == (theirs.routed_experts is None)
        if mine.routed_experts is not None:
            np.testing.assert_array_equal(mine.routed_experts, theirs.routed_experts)


async def test_a_rollback_after_a_restart_uses_the_stored_checkpoints(tok):
    store = JsonStore()
    agent = await agent_over(registry_over(tok, store))
    await agent.user(TURNS[0])
    await agent.user(TURNS[1])
    retried = agent.messages[:2] + [user("Or rather: in Paris?")]  # drops the second turn
    restarted = registry_over(tok, store)
    result = await restarted.chat(agent.id, retried)
    assert result.rolled_back == 1 and len((await restarted.get(agent.id)).trajectory) == 2
    assert len(store.stored(agent.id)["records"]) == 2


def test_the_codec_round_trips_what_json_cannot_hold_plainly():
    from raylane.router.session import Session
    from raylane.router.trajectory import TurnRecord

    params = SamplingParams(
        temperature=0.5,
        stop=["\n"],
        logprobs=0,
        structured_outputs=(StructuredOutputsParams(json={"type": "object"})),
    )
    blob = np.arange(2 * 6 * 2 * 2, dtype=np.int32).reshape(2 * 6, 2, 2)
    record = TurnRecord(
        new_messages=[user("nul \x00 and ünïcode")],
        reply={"role": "assistant", "content": "ok"},
        params=params,
        prefix_len=0,
        prompt_ids=[1, 2, 3, 4, 5, 6, 7],
        output_ids=[8, 9, 10, 11, 12, 13],
        logprobs=[-math.inf, -0.1, -1e-30, 0.0, -2.5, -7.0],
        finish_reason="stop",
        weight_version=4,
        routed_experts=blob,
        tools=[{"type": "function"}],
    )
    session = Session("sess-x", {"run": 1}, last_used=12.5)
    session.trajectory.records.append(record)
    text = json.dumps(encode_session(session), allow_nan=False)
    back = decode_session(json.loads(text))
    assert back.describe() == session.describe() and back.last_used == 12.5
    copy = back.trajectory.records[0]
    assert copy.logprobs == record.logprobs and copy.params == params
    np.testing.assert_array_equal(copy.routed_experts, blob)
    assert copy.routed_experts.dtype == np.int32 and copy.routed_experts.flags.writeable
    with pytest.raises(ValueError, match="format"):
        decode_session({**json.loads(text), "format": 99})


async def test_deleted_sessions_are_gone_from_the_store(tok):
    store = JsonStore()
    agent = await agent_over(registry_over(tok, store))
    await agent.user(TURNS[0])
    await agent.registry.delete(agent.id)
    assert agent.id not in store.rows
    with pytest.raises(SessionNotFound):
        await registry_over(tok, store).describe(agent.id)


async def test_the_ttl_and_the_cap_reach_the_store(tok):
    store, clock = JsonStore(), Clock()
    first = registry_over(tok, store, clock, ttl_s=60, max_sessions=2)
    idle, evicted = await first.create(), await first.create()
    clock.now += 30
    await first.get(idle)  # used in memory: `evicted` is now the least recently used
    kept = await first.create()
    assert evicted not in store.rows and set(store.rows) == {idle, kept}

    clock.now += 61  # past the TTL of the last write: a restarted Router finds them expired
    restarted = registry_over(tok, store, clock, ttl_s=60)
    with pytest.raises(SessionNotFound, match="expired"):
        await restarted.describe(idle)
    assert idle not in store.rows


async def test_the_store_is_purged_of_idle_sessions_once_a_minute(tok):
    store, clock = JsonStore(), Clock()
    registry = registry_over(tok, store, clock, ttl_s=60)
    orphan = await registry_over(tok, store, clock).create()  # its Router is gone
    clock.now += 61
    await registry.create()
    assert orphan not in store.rows
    store.rows[orphan] = json.dumps({"last_used": 0})
    clock.now += PURGE_EVERY_S / 2
    await registry.create()
    assert orphan in store.rows  # not yet due again


async def test_a_store_that_fails_is_a_503_and_the_turn_can_be_resent(tok):
    store = JsonStore()
    agent = await agent_over(registry_over(tok, store))
    await agent.user(TURNS[0])
    store.fail = True
    with pytest.raises(SessionStoreUnavailable) as err:
        await agent.registry.chat(agent.id, agent.messages + [user(TURNS[1])])
    assert err.value.status == 503
    with pytest.raises(SessionStoreUnavailable):
        await agent.registry.create()
    assert len(agent.registry) == 1  # the session it could not store is not kept
    store.fail = False
    await agent.user(TURNS[1])  # the client never got the reply: it resends the turn
    assert len(store.stored(agent.id)["records"]) == 2


async def test_concurrent_calls_share_one_loaded_session(tok):
    store = JsonStore()
    agent = await agent_over(registry_over(tok, store))
    await agent.user(TURNS[0])
    restarted = registry_over(tok, store)
    a, b = await asyncio.gather(restarted.get(agent.id), restarted.get(agent.id))
    assert a is b and len(restarted) == 1


def test_the_sessions_dsn_comes_from_the_environment_and_stays_out_of_repr(monkeypatch):
    from raylane.config import ClusterConfig

    monkeypatch.setenv("RAYLANE_SESSIONS_DSN", "postgresql://u:secret@db/sessions")
    config = ClusterConfig.from_env(ClusterConfig())
    assert config.sessions_dsn == "postgresql://u:secret@db/sessions"
    assert "secret" not in repr(config)
    with pytest.raises(ValueError, match="sessions_dsn"):
        ClusterConfig(sessions_dsn=5)
