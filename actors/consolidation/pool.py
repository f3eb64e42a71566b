"""CountingPool: the store's asyncpg pool, counting every statement sent through it."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Pool reset hook that sends nothing.

    Pooled connections never keep session state (no SET, LISTEN or cursors; the bank lock
    unlocks, or terminates its connection), so asyncpg's default reset query would only add a
    round trip to every release. asyncpg still rolls back an open transaction.
    """


class CountingPool:
    """Each `fetch`/`fetchrow`/`fetchval`/`execute` is one statement and one round trip;
    `statements` counts them, so a benchmark can see what a run cost the database."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self.statements = 0

    @classmethod
    async def create(cls, dsn: str, *, min_size: int, max_size: int) -> CountingPool:
        pool = await asyncpg.create_pool(
            dsn, min_size=min_size, max_size=max_size, init=_init_connection, reset=_keep_session
        )
        return cls(pool)

    def acquire(self) -> Any:
        """A raw connection (for multi-statement work such as migrations; not counted)."""
        return self._pool.acquire()

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        return await self._send(self._pool.fetch, sql, args)

    async def fetchrow(self, sql: str, *args: Any) -> asyncpg.Record | None:
        return await self._send(self._pool.fetchrow, sql, args)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        return await self._send(self._pool.fetchval, sql, args)

    async def execute(self, sql: str, *args: Any) -> str:
        return await self._send(self._pool.execute, sql, args)

    async def close(self) -> None:
        await self._pool.close()

    async def _send(
        self, method: Callable[..., Awaitable[Any]], sql: str, args: tuple[Any, ...]
    ) -> Any:
        self.statements += 1
        return await method(sql, *args)
