"""ConsolidationActor on a real local Ray cluster and a real PostgreSQL."""

from __future__ import annotations

import asyncio
import functools

import pytest
from raylane.actors.consolidation import BankBusy, ConsolidationConfig, MemoryStore

from tests.pg.checks import assert_each_memory_once, assert_one_observation_per_scope
from tests.support.fake_llm import FakeLLM

ray = pytest.importorskip("ray")

SLOW_LLM = functools.partial(FakeLLM, latency=0.03)
CONFIG = ConsolidationConfig(llm_batch_size=2, max_parallel_groups=2)


@pytest.fixture
def actor_class(ray_cluster):
    from raylane.actors.consolidation.actor import ConsolidationActor

    return ConsolidationActor


async def _retain(actor, bank: str, groups: int, per_group: int) -> None:
    for i in range(per_group):
        for g in range(groups):
            await actor.retain.remote(bank, f"g{g} m{i}", [f"g{g}"])


async def _until_consolidated(store: MemoryStore, bank: str, at_least: int) -> int:
    for _ in range(1000):
        done = sum(m.consolidated_at is not None for m in await store.memories(bank))
        if done >= at_least:
            return done
        await asyncio.sleep(0.01)
    raise AssertionError(f"fewer than {at_least} memories consolidated in time")


async def test_submit_runs_in_background_one_run_per_bank(actor_class, store, pg_dsn, bank) -> None:
    actor = actor_class.remote(pg_dsn, SLOW_LLM, CONFIG)
    try:
        await _retain(actor, bank, groups=4, per_group=4)
        op = await actor.submit.remote(bank)
        assert await actor.submit.remote(bank) == op  # the running op, not a second run
        status = await actor.wait.remote(op)
        assert status["status"] == "completed" and status["stats"]["consolidated"] == 16
        assert len(status["perf"]) == status["stats"]["batches"] == 8
        (obs,) = await actor.observations.remote(bank, ["g1"])
        assert obs["proof_count"] == 4
        await assert_each_memory_once(store, bank)
        again = await actor.submit.remote(bank)
        assert again != op and (await actor.wait.remote(again))["stats"]["consolidated"] == 0
        assert await actor.status.remote("no-such-op") is None
        assert "raylane:consolidation_batch_latency_seconds" in await actor.metrics_text.remote()
    finally:
        ray.kill(actor)


async def test_cancel_through_actor(actor_class, store, pg_dsn, bank) -> None:
    actor = actor_class.remote(pg_dsn, SLOW_LLM, CONFIG)
    try:
        await _retain(actor, bank, groups=6, per_group=4)
        op = await actor.submit.remote(bank)
        await _until_consolidated(store, bank, 1)
        assert await actor.cancel.remote(op)
        status = await actor.wait.remote(op)
        assert status["status"] == "cancelled"
        assert 0 < status["stats"]["consolidated"] < 24
        assert len(await store.pending(bank, 100)) == 24 - status["stats"]["consolidated"]
    finally:
        ray.kill(actor)


async def test_killed_actor_then_rerun_loses_and_duplicates_nothing(
    actor_class, store, pg_dsn, bank
) -> None:
    total = 36
    first = actor_class.remote(pg_dsn, SLOW_LLM, CONFIG)
    await _retain(first, bank, groups=6, per_group=6)  # 9 waves of 30 ms
    killed_op = await first.submit.remote(bank)
    await _until_consolidated(store, bank, 2)
    ray.kill(first)
    await _until_lock_free(store, bank)  # PostgreSQL drops the dead actor's connection
    done_before = sum(m.consolidated_at is not None for m in await store.memories(bank))
    assert done_before < total

    second = actor_class.remote(pg_dsn, SLOW_LLM, CONFIG)
    try:
        status = await second.wait.remote(await second.submit.remote(bank))
        assert status["status"] == "completed"
        assert status["stats"]["consolidated"] == total - done_before
        assert (await second.status.remote(killed_op))["status"] == "interrupted"
        await assert_each_memory_once(store, bank)
        await assert_one_observation_per_scope(store, bank)
    finally:
        ray.kill(second)


async def _until_lock_free(store: MemoryStore, bank: str) -> None:
    for _ in range(500):
        try:
            async with store.bank_lock(bank):
                return
        except BankBusy:
            await asyncio.sleep(0.01)
    raise AssertionError("the killed actor's bank lock was never released")


async def test_periodic_schedule(actor_class, store, pg_dsn, bank) -> None:
    actor = actor_class.remote(pg_dsn, FakeLLM, CONFIG)
    try:
        await actor.schedule.remote(bank, 0.05)
        await _retain(actor, bank, groups=2, per_group=2)
        await _until_consolidated(store, bank, 4)
        await actor.unschedule.remote(bank)
        await assert_each_memory_once(store, bank)
        with pytest.raises(ValueError, match="every_s"):
            await actor.schedule.remote(bank, 0)
    finally:
        ray.kill(actor)
