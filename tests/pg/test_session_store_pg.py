"""PgSessionStore against a private PostgreSQL: the schema, one row per session written through
on every change, a new store (a restarted Router) carrying a conversation on, the TTL purge, a
database that is down answering 503 instead of losing or corrupting anything, and a stored
session's model: refused (409) by a Router serving another one, rows from before it still load."""

from __future__ import annotations

import json
import uuid

import asyncpg
import numpy as np
import pytest
from raylane.launch import free_port
from raylane.router.errors import SessionModelMismatch, SessionNotFound, SessionStoreUnavailable
from raylane.router.session import Session
from raylane.router.session_store import open_session_store
from raylane.router.session_store_pg import PgSessionStore, migrate

from tests.tiny_models import make_tokenizer
from tests.unit.session_store_helpers import TURNS, agent_over, registry_over, same_sample
from tests.unit.sessions_helpers import user


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture
async def pg_store(pg_dsn: str):
    store = PgSessionStore(pg_dsn)
    yield store
    await store.close()


async def row(dsn: str, session_id: str) -> asyncpg.Record | None:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchrow("SELECT * FROM raylane_sessions WHERE id = $1", session_id)
    finally:
        await conn.close()


async def test_migrations_apply_once(fresh_dsn: str):
    conn = await asyncpg.connect(fresh_dsn)
    try:
        assert await migrate(conn) == [1]
        assert await migrate(conn) == []
        columns = {
            r["column_name"]: r["data_type"]
            for r in await conn.fetch(
                "SELECT column_name, data_type FROM information_schema.columns "
                "WHERE table_name = 'raylane_sessions'"
            )
        }
    finally:
        await conn.close()
    assert columns["record"] == "json" and columns["last_used"] == "double precision"


async def test_a_restarted_router_carries_the_conversation_on(tok, pg_dsn, pg_store):
    agent = await agent_over(registry_over(tok, pg_store))
    await agent.say({"role": "system", "content": "nul \x00 kept"}, user(TURNS[0]))
    await agent.user(TURNS[1])
    restarted = PgSessionStore(pg_dsn)  # a new process: its own pool, nothing in memory
    try:
        agent.registry = registry_over(tok, restarted)
        await agent.user(TURNS[2])
        reference = await agent_over(registry_over(tok, pg_store))
        await reference.say({"role": "system", "content": "nul \x00 kept"}, user(TURNS[0]))
        for text in TURNS[1:]:
            await reference.user(text)
        same_sample(
            await agent.registry.sample(agent.id), await reference.registry.sample(reference.id)
        )
    finally:
        await restarted.close()


async def test_one_row_per_session_without_superseded_blobs(tok, pg_dsn, pg_store):
    agent = await agent_over(registry_over(tok, pg_store, max_rollback_steps=1))
    stored = await row(pg_dsn, agent.id)
    assert stored is not None and json.loads(stored["record"])["records"] == []
    for turn in range(4):
        await agent.user(f"turn {turn}")
    stored = await row(pg_dsn, agent.id)
    records = json.loads(stored["record"])["records"]
    assert [r["routed_experts"] is not None for r in records] == [False, False, True, True]
    live = await agent.registry.get(agent.id)
    assert stored["last_used"] == live.last_used and stored["format"] == 1
    loaded = await pg_store.load(agent.id)
    np.testing.assert_array_equal(
        loaded.trajectory.records[-1].routed_experts, live.trajectory.records[-1].routed_experts
    )


async def test_delete_and_purge(tok, fresh_dsn):
    store = PgSessionStore(fresh_dsn)
    try:
        registry = registry_over(tok, store)
        deleted, idle, fresh = [await registry.create() for _ in range(3)]
        await registry.delete(deleted)
        assert await row(fresh_dsn, deleted) is None
        with pytest.raises(SessionNotFound):
            await registry_over(tok, store).describe(deleted)
        live = await registry.get(fresh)
        live.last_used += 100
        await store.save(live)
        assert await store.purge(live.last_used - 50) == 1  # `idle` only
        assert await store.load(idle) is None and await store.load(fresh) is not None
    finally:
        await store.close()


async def test_a_database_that_is_down_is_a_503(tok):
    down = open_session_store(f"postgresql://postgres:pw@127.0.0.1:{free_port()}/none")
    try:
        registry = registry_over(tok, down)
        with pytest.raises(SessionStoreUnavailable) as err:
            await registry.create()
        assert err.value.status == 503 and "pw" not in str(err.value)
        assert len(registry) == 0
        with pytest.raises(SessionStoreUnavailable):
            await registry.describe("sess-" + uuid.uuid4().hex)  # not a 404: it may exist
    finally:
        await down.close()


async def test_an_unreadable_row_is_an_error_not_a_crash(pg_dsn, pg_store):
    session = Session("sess-" + uuid.uuid4().hex, {})
    await pg_store.save(session)
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(
            "UPDATE raylane_sessions SET record = '{\"format\": 99}' WHERE id = $1", session.id
        )
    finally:
        await conn.close()
    with pytest.raises(SessionStoreUnavailable, match="cannot be read"):
        await pg_store.load(session.id)


async def test_a_router_serving_another_model_refuses_the_session(tok, pg_dsn, pg_store):
    agent = await agent_over(registry_over(tok, pg_store, model="/models/a"))
    await agent.user(TURNS[0])
    assert json.loads((await row(pg_dsn, agent.id))["record"])["model"] == "/models/a"
    redeployed = PgSessionStore(pg_dsn)  # a restarted Router, now serving another model
    try:
        other = registry_over(tok, redeployed, model="/models/b")
        with pytest.raises(SessionModelMismatch) as err:
            await other.chat(agent.id, agent.messages + [user(TURNS[1])])
        assert err.value.status == 409 and "'/models/a'" in str(err.value)
        stored = await row(pg_dsn, agent.id)
        assert len(json.loads(stored["record"])["records"]) == 1  # kept, and unchanged
        agent.registry = registry_over(tok, redeployed, model="/models/a")
        await agent.user(TURNS[1])
        assert (await agent.registry.describe(agent.id))["num_turns"] == 2
    finally:
        await redeployed.close()


async def test_a_row_written_before_models_were_recorded_loads(tok, pg_dsn, pg_store):
    agent = await agent_over(registry_over(tok, pg_store))
    await agent.user(TURNS[0])
    conn = await asyncpg.connect(pg_dsn)
    try:  # the row as a Router before this change wrote it: no "model" key at all
        await conn.execute(
            "UPDATE raylane_sessions SET record = (record::jsonb - 'model')::json WHERE id = $1",
            agent.id,
        )
    finally:
        await conn.close()
    assert "model" not in json.loads((await row(pg_dsn, agent.id))["record"])
    restarted = PgSessionStore(pg_dsn)
    try:
        agent.registry = registry_over(tok, restarted, model="/models/a")
        await agent.user(TURNS[1])
        assert json.loads((await row(pg_dsn, agent.id))["record"])["model"] == "/models/a"
        assert (await agent.registry.describe(agent.id))["num_turns"] == 2
    finally:
        await restarted.close()
