"""A process killed mid-run loses nothing and duplicates nothing when the bank is rerun."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from raylane.actors.consolidation import ConsolidationConfig, Consolidator, MemoryStore

from tests.pg.checks import assert_each_memory_once, assert_one_observation_per_scope
from tests.support.fake_llm import FakeLLM

ROOT = Path(__file__).resolve().parents[2]


async def _consolidated(store: MemoryStore, bank: str) -> int:
    return sum(m.consolidated_at is not None for m in await store.memories(bank))


async def _run_and_kill(store: MemoryStore, dsn: str, bank: str) -> int:
    """Start a worker, SIGKILL it once it has committed a new batch; returns the count then."""
    before = await _consolidated(store, bank)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.pg.crash_worker",
        dsn,
        bank,
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        for _ in range(1500):
            if child.returncode is not None:
                raise AssertionError(f"worker exited early: {await child.stderr.read()!r}")
            if await _consolidated(store, bank) > before:
                break
            await asyncio.sleep(0.01)
    finally:
        child.kill()  # SIGKILL: no cleanup, no goodbye to PostgreSQL
        await child.wait()
    await _until_backend_gone(dsn)
    return await _consolidated(store, bank)


async def _until_backend_gone(dsn: str, timeout_s: float = 10.0) -> None:
    """PostgreSQL drops a dead client's session (and its advisory lock) once its backend sees
    the socket closed, which can lag the kill by a moment on a loaded machine: a rerun before
    that finds the bank busy, as it should."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        for _ in range(int(timeout_s / 0.02)):
            if not await conn.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"):
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the killed worker's advisory lock was never released")
    finally:
        await conn.close()


async def test_killed_runs_lose_and_duplicate_nothing(store, pg_dsn, bank, metrics) -> None:
    total = 40
    await store.retain_many(bank, [(f"g{g} m{i}", [f"g{g}"]) for i in range(8) for g in range(5)])
    progress = [await _run_and_kill(store, pg_dsn, bank) for _ in range(3)]
    assert 0 < progress[0] < progress[1] < progress[2] < total, progress

    pending = {m.id for m in await store.pending(bank, total)}
    llm = FakeLLM()
    config = ConsolidationConfig(llm_batch_size=2)
    result = await Consolidator(store, llm, config, metrics=metrics).run(bank)
    assert result.total.consolidated == total - progress[-1] == len(pending)
    assert sorted(i for c in llm.calls for i in c.memory_ids) == sorted(pending)
    await assert_each_memory_once(store, bank)
    await assert_one_observation_per_scope(store, bank)
    statuses = [op["status"] for op in await store.operations.for_bank(bank)]
    assert statuses == ["interrupted"] * 3 + ["completed"]
