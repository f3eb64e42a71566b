"""Consolidator behaviour with a scripted fake LLM and a real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from raylane.actors.consolidation import (
    BankBusy,
    ConsolidationConfig,
    ConsolidationMetrics,
    Consolidator,
    MemoryStore,
)

from tests.pg.checks import assert_each_memory_once, assert_one_observation_per_scope
from tests.support.fake_llm import FakeLLM


def consolidator(
    store: MemoryStore, llm: FakeLLM, metrics: ConsolidationMetrics, **config: int
) -> Consolidator:
    return Consolidator(store, llm, ConsolidationConfig(**config), metrics=metrics)


def metric(metrics: ConsolidationMetrics, counter, label: str) -> float:
    return counter.labels(label)._value.get()


async def test_run_consolidates_everything_once(store, bank, metrics) -> None:
    items = [(f"fact {i}", [f"t{i % 3}"]) for i in range(10)] + [("skip: chatter", ["t0"])]
    ids = await store.retain_many(bank, items)
    llm = FakeLLM()
    result = await consolidator(store, llm, metrics, batch_size=4, llm_batch_size=2).run(bank)

    assert result.status == "completed"
    await assert_each_memory_once(store, bank, skipped={ids[-1]})
    await assert_one_observation_per_scope(store, bank)
    assert (result.total.consolidated, result.total.skipped, result.total.failed) == (11, 1, 0)
    assert (result.total.created, result.total.updated) == (3, result.total.llm_calls - 3)
    assert result.total.llm_calls == len(llm.calls) == len(result.batches)
    for call in llm.calls:  # each call carries the schema of its own batch's answer
        schema = call.response_format["json_schema"]["schema"]
        assert call.response_format["type"] == "json_schema"
        assert schema["required"] == [str(i) for i in call.memory_ids]
    row = await store.operations.get(result.op_id)
    assert row["status"] == "completed" and row["error"] is None
    assert row["stats"]["created"] == 3 and len(row["perf"]) == len(result.batches)
    assert metric(metrics, metrics.observations, "create") == 3
    assert metric(metrics, metrics.memories, "skipped") == 1
    assert metrics.batch_latency._sum.get() > 0


async def test_rounds_fetch_oldest_first(store, bank, metrics) -> None:
    ids = await store.retain_many(bank, [(f"m{i}", [f"t{i}"]) for i in range(6)])
    llm = FakeLLM()
    await consolidator(store, llm, metrics, batch_size=2, max_parallel_groups=1).run(bank)
    assert [c.memory_ids for c in llm.calls] == [[i] for i in ids]


async def test_nothing_pending_means_no_llm_call(store, bank, metrics) -> None:
    llm = FakeLLM()
    result = await consolidator(store, llm, metrics).run(bank)
    assert (result.status, result.total.llm_calls, llm.calls) == ("completed", 0, [])


async def test_parallelism_is_bounded_and_groups_are_serial(store, bank, metrics) -> None:
    groups, per_group, parallel = 7, 4, 3
    await store.retain_many(
        bank, [(f"g{g} m{i}", [f"g{g}"]) for i in range(per_group) for g in range(groups)]
    )
    llm = FakeLLM(latency=0.04)
    await consolidator(
        store, llm, metrics, batch_size=100, llm_batch_size=2, max_parallel_groups=parallel
    ).run(bank)

    assert llm.max_in_flight == parallel
    by_group: dict[tuple, list] = {}
    for call in llm.calls:
        (tags,) = call.tag_sets
        by_group.setdefault(tags, []).append(call)
    assert len(by_group) == groups
    for calls in by_group.values():
        assert len(calls) == per_group // 2
        first, second = sorted(calls, key=lambda c: c.started)
        assert second.started >= first.finished  # same group never overlaps
        assert first.request["observations"] == []
        created = json.loads(first.answer)["actions"][0]["text"]
        assert [o["text"] for o in second.request["observations"]] == [created]
    await assert_one_observation_per_scope(store, bank)


async def test_poisoned_memory_alone_is_marked_failed(store, bank, metrics) -> None:
    ids = await store.retain_many(bank, [(f"m{i}", ["t"]) for i in range(8)])
    poison = ids[5]

    def behaviour(request):
        return "I refuse" if any(int(m["id"]) == poison for m in request["memories"]) else None

    llm = FakeLLM(behaviour=behaviour)
    result = await consolidator(store, llm, metrics, llm_batch_size=8).run(bank)

    assert (result.status, result.total.failed, result.total.consolidated) == ("completed", 1, 7)
    await assert_each_memory_once(store, bank, failed={poison})
    # 8 -> 4 -> 2 -> 1: each level has one failing call containing the poison.
    assert sum(c.answer == "I refuse" for c in llm.calls) == 4
    assert result.total.failed_calls == 4
    rerun = FakeLLM()
    assert (await consolidator(store, rerun, metrics).run(bank)).total.llm_calls == 0


async def test_error_in_one_group_stops_run_and_rerun_finishes(store, bank, metrics) -> None:
    await store.retain_many(bank, [(f"g{g} m{i}", [f"g{g}"]) for i in range(4) for g in range(6)])

    def behaviour(request):
        if request["memories"][0]["tags"] == ["g2"] and request["observations"]:
            raise RuntimeError("model crashed")  # the second batch of group g2

    llm = FakeLLM(latency=0.02, behaviour=behaviour)
    op_id = await store.operations.create(bank)
    runner = consolidator(
        store, llm, metrics, batch_size=100, llm_batch_size=2, max_parallel_groups=2
    )
    with pytest.raises(RuntimeError, match="model crashed"):
        await runner.run(bank, op_id)

    memories = await store.memories(bank)
    done = {m.id for m in memories if m.consolidated_at}
    answered = {i for c in llm.calls if c.error is None for i in c.memory_ids}
    assert done == answered and 0 < len(done) < len(memories)
    failed_at = next(c.finished for c in llm.calls if c.error)  # when the error was raised
    assert all(c.started <= failed_at for c in llm.calls), "work went on after the error"
    op = await store.operations.get(op_id)
    assert op["status"] == "failed" and "model crashed" in op["error"]

    result = await consolidator(store, FakeLLM(), metrics, llm_batch_size=2).run(bank)
    assert result.total.consolidated == len(memories) - len(done)
    await assert_each_memory_once(store, bank)
    await assert_one_observation_per_scope(store, bank)


async def _start_and_wait_for_calls(
    runner: Consolidator, llm: FakeLLM, store: MemoryStore, bank: str, calls: int
) -> tuple[str, asyncio.Task]:
    op_id = await store.operations.create(bank)
    task = asyncio.create_task(runner.run(bank, op_id))
    while len(llm.calls) < calls:
        await asyncio.sleep(0.002)
    return op_id, task


async def _retain_groups(store: MemoryStore, bank: str, groups: int, per_group: int) -> None:
    await store.retain_many(
        bank, [(f"g{g} m{i}", [f"g{g}"]) for i in range(per_group) for g in range(groups)]
    )


async def test_cancel_mid_run_stops_before_the_next_call(store, bank, metrics) -> None:
    await _retain_groups(store, bank, groups=8, per_group=4)
    llm = FakeLLM(latency=0.03)
    runner = consolidator(
        store, llm, metrics, batch_size=100, llm_batch_size=2, max_parallel_groups=2
    )
    op_id, task = await _start_and_wait_for_calls(runner, llm, store, bank, calls=3)
    assert await runner.cancel(op_id)
    cancelled_at = asyncio.get_running_loop().time()
    result = await task

    assert result.status == "cancelled"
    assert all(c.started < cancelled_at for c in llm.calls), "an LLM call started after cancel"
    done = {m.id for m in await store.memories(bank) if m.consolidated_at}
    assert done == {i for c in llm.calls for i in c.memory_ids}  # in-flight batches committed
    assert (await store.operations.get(op_id))["status"] == "cancelled"
    assert not await runner.cancel(op_id)

    rest = await consolidator(store, FakeLLM(), metrics, llm_batch_size=2).run(bank)
    assert rest.total.consolidated == 32 - len(done)
    await assert_each_memory_once(store, bank)
    await assert_one_observation_per_scope(store, bank)


async def test_cancel_is_checked_before_split_retries(store, bank, metrics) -> None:
    await store.retain_many(bank, [(f"m{i}", ["t"]) for i in range(8)])
    llm = FakeLLM(latency=0.03, behaviour=lambda request: "garbage")
    runner = consolidator(store, llm, metrics, llm_batch_size=8)
    op_id, task = await _start_and_wait_for_calls(runner, llm, store, bank, calls=1)
    await runner.cancel(op_id)  # while the first call is in flight; its answer fails
    result = await task
    assert (result.status, len(llm.calls), result.total.failed) == ("cancelled", 1, 0)
    assert len(await store.pending(bank, 100)) == 8


async def test_cancel_from_another_process_is_seen(store, pg_dsn, bank, metrics) -> None:
    await _retain_groups(store, bank, groups=8, per_group=4)
    llm = FakeLLM(latency=0.03)
    runner = consolidator(
        store, llm, metrics, batch_size=100, llm_batch_size=2, max_parallel_groups=2
    )
    op_id, task = await _start_and_wait_for_calls(runner, llm, store, bank, calls=3)
    other = await MemoryStore.connect(pg_dsn)  # another process's view of the database
    try:
        assert await other.operations.request_cancel(op_id)
    finally:
        await other.close()
    calls_at_cancel = len(llm.calls)
    result = await task
    assert result.status == "cancelled"
    # A batch that read the flag just before it was set may still start its call.
    assert len(llm.calls) - calls_at_cancel <= 2
    assert len(await store.pending(bank, 100)) > 0


async def test_round_trips_per_batch_do_not_grow_with_batch_size(store, metrics) -> None:
    overheads = set()
    for llm_batch_size in (1, 2, 8):
        bank = f"rt-{llm_batch_size}-{uuid.uuid4().hex}"
        await _retain_groups(store, bank, groups=3, per_group=8)
        before = store.statements
        result = await consolidator(store, FakeLLM(), metrics, llm_batch_size=llm_batch_size).run(
            bank
        )
        assert len(result.batches) == 3 * 8 // llm_batch_size
        assert [b.db_round_trips for b in result.batches] == [1] * len(result.batches)
        # The rest is per run and per round (fetch, scope read), not per batch or memory.
        overheads.add(store.statements - before - len(result.batches))
    assert len(overheads) == 1, overheads


async def test_busy_bank_fails_the_op_and_foreign_op_is_refused(store, bank, metrics) -> None:
    await store.retain(bank, "m", ["t"])
    runner = consolidator(store, FakeLLM(), metrics)
    op_id = await store.operations.create(bank)
    async with store.bank_lock(bank):  # as if another process were consolidating the bank
        with pytest.raises(BankBusy):
            await runner.run(bank, op_id)
    op = await store.operations.get(op_id)
    assert op["status"] == "failed" and "already running" in op["error"]

    other = await store.operations.create(bank + "-other")
    with pytest.raises(ValueError, match="not pending"):
        await runner.run(bank, other)
    assert (await store.operations.get(other))["status"] == "pending"
    assert len(await store.pending(bank, 10)) == 1
