"""MemoryStore, TagScope and OperationLog against a real PostgreSQL."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from raylane.actors.consolidation import BankBusy, CommitConflict, MemoryStore
from raylane.actors.consolidation.migrations import MIGRATIONS
from raylane.actors.consolidation.records import Action, ObservationView


async def test_migrations_apply_once_even_when_started_together(fresh_dsn: str) -> None:
    stores = await asyncio.gather(*(MemoryStore.connect(fresh_dsn) for _ in range(3)))
    await asyncio.gather(*(s.close() for s in stores))
    again = await MemoryStore.connect(fresh_dsn)
    await again.close()
    conn = await asyncpg.connect(fresh_dsn)
    try:
        versions = [
            r["version"]
            for r in await conn.fetch("SELECT version FROM schema_migrations ORDER BY version")
        ]
    finally:
        await conn.close()
    assert versions == [m.version for m in MIGRATIONS]


async def test_retain_normalizes_tags_and_keeps_order(store: MemoryStore, bank: str) -> None:
    ids = await store.retain_many(bank, [("a", ["z", "a", "z"]), ("b", []), ("c", ["m"])])
    one = await store.retain(bank, "d", ["b", "a"])
    memories = await store.memories(bank)
    assert [m.id for m in memories] == ids + [one]
    assert [m.content for m in memories] == ["a", "b", "c", "d"]
    assert [m.tags for m in memories] == [("a", "z"), (), ("m",), ("a", "b")]
    with pytest.raises(ValueError, match="tags"):
        await store.retain(bank, "e", [""])


async def test_pending_skips_consolidated_and_failed(store: MemoryStore, bank: str) -> None:
    ids = await store.retain_many(bank, [(f"m{i}", ["t"]) for i in range(5)])
    scope = store.scope(bank, ("t",))
    await scope.commit(ids[:2], [Action("skip", tuple(ids[:2]))])
    await scope.mark_failed(ids[2])
    assert [m.id for m in await store.pending(bank, 10)] == ids[3:]
    assert [m.id for m in await store.pending(bank, 1)] == ids[3:4]


async def test_commit_writes_observations_and_history(store: MemoryStore, bank: str) -> None:
    ids = await store.retain_many(bank, [(f"m{i}", ["t"]) for i in range(3)])
    scope = store.scope(bank, ("t",))
    first = await scope.commit(ids[:1], [Action("create", (ids[0],), text="v1")])
    assert (first.created, first.updated) == (1, 0)
    (obs,) = await store.observations(bank, ["t"])
    update = Action("update", (ids[1], ids[2]), text="v2", observation_id=obs.id)
    second = await scope.commit(ids[1:], [update])
    assert (second.created, second.updated) == (0, 1)
    assert second.snapshot.observations == [ObservationView(obs.id, "v2")]
    (obs,) = await store.observations(bank, ["t"])
    assert obs.content == "v2" and obs.proof_count == 3
    assert obs.source_memory_ids == tuple(ids)
    assert [h["action"] for h in obs.history] == ["create", "update"]
    assert obs.history[1]["previous_text"] == "v1"
    assert await store.observations(bank, ["t", "other"]) == []


async def test_commit_of_stamped_memory_rolls_back(store: MemoryStore, bank: str) -> None:
    ids = await store.retain_many(bank, [("m0", ["t"]), ("m1", ["t"])])
    scope = store.scope(bank, ("t",))
    await scope.commit(ids[:1], [Action("skip", (ids[0],))])
    with pytest.raises(CommitConflict):
        await scope.commit(ids, [Action("create", tuple(ids), text="dup")])
    assert await store.observations(bank, ["t"]) == []
    assert [m.id for m in await store.pending(bank, 10)] == ids[1:]


async def test_update_outside_scope_rolls_back(store: MemoryStore, bank: str) -> None:
    a = await store.retain(bank, "secret", ["alice"])
    b = await store.retain(bank, "other", ["bob"])
    await store.scope(bank, ("alice",)).commit([a], [Action("create", (a,), text="s")])
    (secret,) = await store.observations(bank, ["alice"])
    bad = Action("update", (b,), text="leak", observation_id=secret.id)
    with pytest.raises(CommitConflict):
        await store.scope(bank, ("bob",)).commit([b], [bad])
    assert (await store.observations(bank, ["alice"]))[0].content == "s"
    assert [m.id for m in await store.pending(bank, 10)] == [b]


async def test_commit_is_one_statement_whatever_the_batch_size(
    store: MemoryStore, bank: str
) -> None:
    for size in (1, 4, 32):
        ids = await store.retain_many(bank, [(f"m{i}", [f"s{size}"]) for i in range(size)])
        scope = store.scope(bank, (f"s{size}",))
        before = store.statements
        await scope.commit(ids, [Action("create", (i,), text=f"o{i}") for i in ids])
        assert store.statements - before == scope.round_trips == 1
        assert len(await store.observations(bank, [f"s{size}"])) == size


async def test_snapshots_keep_each_scope_to_its_own(store: MemoryStore, bank: str) -> None:
    scopes = [(), ("a",), ("a", "b"), ("b",)]
    for tags in scopes[:3]:  # ("b",) has no observation
        (i,) = await store.retain_many(bank, [("m", tags)])
        await store.scope(bank, tags).commit([i], [Action("create", (i,), text=f"{tags}")])
        (j,) = await store.retain_many(bank + "-other", [("m", tags)])
        await store.scope(bank + "-other", tags).commit([j], [Action("create", (j,), text="x")])
    op = await store.operations.create(bank)
    await store.operations.request_cancel(op)
    before = store.statements
    snapshots = await store.snapshots(bank, scopes, op)
    assert store.statements - before == 1
    assert {t: [o.text for o in s.observations] for t, s in snapshots.items()} == {
        (): ["()"],
        ("a",): ["('a',)"],
        ("a", "b"): ["('a', 'b')"],
        ("b",): [],
    }
    assert all(s.cancelled for s in snapshots.values())
    assert not any(s.cancelled for s in (await store.snapshots(bank, scopes)).values())


async def test_bank_lock_is_exclusive_and_released(
    store: MemoryStore, pg_dsn: str, bank: str
) -> None:
    other = await MemoryStore.connect(pg_dsn)
    try:
        async with store.bank_lock(bank):
            with pytest.raises(BankBusy):
                async with other.bank_lock(bank):
                    pass
            async with other.bank_lock(bank + "-x"):  # other banks are free
                pass
        async with other.bank_lock(bank):
            pass
    finally:
        await other.close()


async def test_operation_lifecycle(store: MemoryStore, bank: str) -> None:
    ops = store.operations
    stale = await ops.create(bank)
    await ops.start(stale, bank)
    op = await ops.create(bank)
    assert (await ops.get(op))["status"] == "pending"
    await ops.start(op, bank)
    assert (await ops.get(stale))["status"] == "interrupted"
    assert await ops.request_cancel(op)
    assert (await ops.get(op))["cancel_requested"] is True
    await ops.finish(op, "cancelled", {"created": 1}, [{"memories": 2}])
    row = await ops.get(op)
    assert (row["status"], row["stats"], row["perf"]) == (
        "cancelled",
        {"created": 1},
        [{"memories": 2}],
    )
    assert not await ops.request_cancel(op)
    assert await ops.get("not-a-uuid") is None
    with pytest.raises(ValueError, match="status"):
        await ops.finish(op, "weird", {}, [])
