"""MemoryStore: the PostgreSQL side of consolidation (asyncpg pool, no ORM)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager

import asyncpg

from .errors import BankBusy
from .migrations import migrate
from .operations import OperationLog
from .pool import CountingPool
from .records import Memory, Observation, Tags, normalize_tags
from .scope import ScopeSnapshot, TagScope, read_snapshots

# First key of the two-key advisory lock that makes one consolidation per bank run at a time.
BANK_LOCK_NAMESPACE = 0x636F6E73  # "cons"
LOCK_SQL = "SELECT pg_try_advisory_lock($1, hashtext($2))"
UNLOCK_SQL = "SELECT pg_advisory_unlock($1, hashtext($2))"

MEMORY_COLUMNS = "id, bank_id, content, tags, created_at, consolidated_at, consolidation_failed_at"
OBSERVATION_COLUMNS = (
    "id, bank_id, content, tags, source_memory_ids, proof_count, created_at, updated_at, history"
)


class MemoryStore:
    """Memories, observations and consolidation operations of many banks.

    `await MemoryStore.connect(dsn)` opens a pool and applies the schema migrations.
    """

    def __init__(self, pool: CountingPool) -> None:
        self._pool = pool
        self.operations = OperationLog(pool)

    @classmethod
    async def connect(cls, dsn: str, *, min_size: int = 1, max_size: int = 16) -> MemoryStore:
        pool = await CountingPool.create(dsn, min_size=min_size, max_size=max_size)
        async with pool.acquire() as conn:
            await migrate(conn)
        return cls(pool)

    @property
    def statements(self) -> int:
        """Statements (round trips) sent through the pool so far."""
        return self._pool.statements

    async def close(self) -> None:
        await self._pool.close()

    async def retain(self, bank_id: str, content: str, tags: Iterable[str] = ()) -> int:
        """Store one memory; returns its id."""
        (memory_id,) = await self.retain_many(bank_id, [(content, tags)])
        return memory_id

    async def retain_many(
        self, bank_id: str, items: Sequence[tuple[str, Iterable[str]]]
    ) -> list[int]:
        """Store many memories in one statement, in order; returns their ids in that order."""
        rows = [{"content": c, "tags": list(normalize_tags(t))} for c, t in items]
        records = await self._pool.fetch(
            """INSERT INTO memories (bank_id, content, tags)
               SELECT $1, e.item->>'content',
                      ARRAY(SELECT jsonb_array_elements_text(e.item->'tags'))
               FROM jsonb_array_elements($2::jsonb) WITH ORDINALITY AS e(item, n)
               ORDER BY e.n RETURNING id""",
            bank_id,
            rows,
        )
        # Rows are inserted in item order, so bigserial ids ascend in that order too.
        return sorted(r["id"] for r in records)

    async def observations(self, bank_id: str, tags: Iterable[str] = ()) -> list[Observation]:
        """The observations of one scope: exactly this bank and this tag set."""
        rows = await self._pool.fetch(
            f"SELECT {OBSERVATION_COLUMNS} FROM observations WHERE bank_id = $1 AND tags = $2 "
            "ORDER BY id",
            bank_id,
            list(normalize_tags(tags)),
        )
        return [_observation(r) for r in rows]

    async def all_observations(self, bank_id: str) -> list[Observation]:
        """Every observation of a bank, all scopes (for operators and tests)."""
        rows = await self._pool.fetch(
            f"SELECT {OBSERVATION_COLUMNS} FROM observations WHERE bank_id = $1 ORDER BY id",
            bank_id,
        )
        return [_observation(r) for r in rows]

    async def memories(self, bank_id: str) -> list[Memory]:
        """Every memory of a bank, oldest first."""
        rows = await self._pool.fetch(
            f"SELECT {MEMORY_COLUMNS} FROM memories WHERE bank_id = $1 ORDER BY created_at, id",
            bank_id,
        )
        return [_memory(r) for r in rows]

    async def pending(self, bank_id: str, limit: int) -> list[Memory]:
        """Up to `limit` memories neither consolidated nor failed, oldest first."""
        rows = await self._pool.fetch(
            f"""SELECT {MEMORY_COLUMNS} FROM memories
                WHERE bank_id = $1 AND consolidated_at IS NULL AND consolidation_failed_at IS NULL
                ORDER BY created_at, id LIMIT $2""",
            bank_id,
            limit,
        )
        return [_memory(r) for r in rows]

    async def pending_banks(self, among: Sequence[str] | None = None) -> list[str]:
        """The banks (of `among`, or all) with at least one pending memory, sorted."""
        # Only the pending rows are read: the partial index memories_pending_idx covers them.
        rows = await self._pool.fetch(
            """SELECT DISTINCT bank_id FROM memories
               WHERE consolidated_at IS NULL AND consolidation_failed_at IS NULL
                 AND ($1::text[] IS NULL OR bank_id = ANY($1::text[]))
               ORDER BY bank_id""",
            None if among is None else list(among),
        )
        return [r["bank_id"] for r in rows]

    def scope(self, bank_id: str, tags: Tags, op_id: str | None = None) -> TagScope:
        """A handle that reads and writes only the observations of (bank_id, tags), on
        behalf of operation `op_id` (whose cancel flag it reports)."""
        return TagScope(self._pool, bank_id, tags, op_id)

    async def snapshots(
        self, bank_id: str, tag_sets: Sequence[Tags], op_id: str | None = None
    ) -> dict[Tags, ScopeSnapshot]:
        """The observations of several scopes of a bank, each kept to its own, in one query."""
        return await read_snapshots(self._pool, bank_id, tag_sets, op_id)

    @asynccontextmanager
    async def bank_lock(self, bank_id: str) -> AsyncIterator[None]:
        """Hold the bank's consolidation lock for the block, or raise BankBusy.

        A session-level advisory lock on a pooled connection held for the run: if the process
        dies, PostgreSQL drops the connection and the lock with it, so a rerun never waits on
        a ghost.
        """
        async with self._pool.acquire() as conn:
            if not await conn.fetchval(LOCK_SQL, BANK_LOCK_NAMESPACE, bank_id):
                raise BankBusy(bank_id)
            try:
                yield
            finally:
                await _unlock(conn, bank_id)


async def _unlock(conn: asyncpg.Connection, bank_id: str) -> None:
    try:
        await conn.execute(UNLOCK_SQL, BANK_LOCK_NAMESPACE, bank_id)
    except BaseException:
        # The pool does not reset connections, so a lock must never go back with one:
        # closing the connection is what frees it then.
        conn.terminate()
        raise


def _memory(r: asyncpg.Record) -> Memory:
    return Memory(
        id=r["id"],
        bank_id=r["bank_id"],
        content=r["content"],
        tags=tuple(r["tags"]),
        created_at=r["created_at"],
        consolidated_at=r["consolidated_at"],
        consolidation_failed_at=r["consolidation_failed_at"],
    )


def _observation(r: asyncpg.Record) -> Observation:
    return Observation(
        id=r["id"],
        bank_id=r["bank_id"],
        content=r["content"],
        tags=tuple(r["tags"]),
        source_memory_ids=tuple(r["source_memory_ids"]),
        proof_count=r["proof_count"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        history=tuple(r["history"]),
    )
