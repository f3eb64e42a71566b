"""PgSessionStore: sessions in PostgreSQL through asyncpg, one row per session.

The row holds the session serialized as JSON (router/session_codec.py) in a `json` column —
kept as sent, where `jsonb` would reparse it and reject a NUL character in a message — beside
`last_used` for the TTL purge. Every write is one statement, hence one transaction: a session is
replaced whole or not at all. Encoding and decoding run in a worker thread, so a long session
does not stall the Router's event loop (which answers every routing call).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import asyncpg
from raylane.router.errors import SessionStoreUnavailable
from raylane.router.session_codec import FORMAT, decode_session, encode_session

if TYPE_CHECKING:
    from raylane.router.session import Session

log = logging.getLogger(__name__)

# pg_advisory_xact_lock key: Routers that start at once migrate one at a time ("rl-sesss").
MIGRATION_LOCK_KEY = 0x726C2D7365737373
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (
        1,
        """
CREATE TABLE raylane_sessions (
    id text PRIMARY KEY,
    format integer NOT NULL,             -- router/session_codec.py FORMAT
    last_used double precision NOT NULL, -- the registry's clock (unix seconds) at the last write
    record json NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX raylane_sessions_last_used_idx ON raylane_sessions (last_used);
""",
    ),
)

SAVE_SQL = """INSERT INTO raylane_sessions (id, format, last_used, record)
              VALUES ($1, $2, $3, $4::json)
              ON CONFLICT (id) DO UPDATE SET format = EXCLUDED.format,
                  last_used = EXCLUDED.last_used, record = EXCLUDED.record, updated_at = now()"""
# connection failures, server errors, a pool that closed under us
_DOWN = (OSError, asyncio.TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)


class PgSessionStore:
    """`SessionStore` over PostgreSQL; connects (and migrates) on first use, so a Router
    starts, and serves its replica table, while the database is still coming up."""

    durable = True

    def __init__(self, dsn: str, *, max_size: int = 4, timeout_s: float = 10.0) -> None:
        self._dsn = dsn
        self._max_size = max_size
        self._timeout_s = timeout_s
        self._pool: asyncpg.Pool | None = None
        self._lock = asyncio.Lock()

    async def save(self, session: Session) -> None:
        text = await asyncio.to_thread(_dumps, session)
        async with self._connection() as conn:
            await conn.execute(SAVE_SQL, session.id, FORMAT, session.last_used, text)

    async def load(self, session_id: str) -> Session | None:
        async with self._connection() as conn:
            text = await conn.fetchval(
                "SELECT record FROM raylane_sessions WHERE id = $1", session_id
            )
        if text is None:
            return None
        try:
            return await asyncio.to_thread(_loads, text)
        except (ValueError, KeyError, TypeError) as e:  # a newer Router's format, or damage
            raise SessionStoreUnavailable(
                f"the stored session {session_id!r} cannot be read: {type(e).__name__}: {e}"
            ) from e

    async def delete(self, session_ids: list[str]) -> None:
        async with self._connection() as conn:
            await conn.execute(
                "DELETE FROM raylane_sessions WHERE id = ANY($1::text[])", list(session_ids)
            )

    async def purge(self, idle_before: float) -> int:
        async with self._connection() as conn:
            status = await conn.execute(
                "DELETE FROM raylane_sessions WHERE last_used < $1", idle_before
            )
        return int(status.split()[-1])  # "DELETE <count>"

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        try:
            pool = await self._connect()
            async with pool.acquire(timeout=self._timeout_s) as conn:
                yield conn
        except _DOWN as e:
            # NOTE: never the DSN in the message: it may hold a password
            raise SessionStoreUnavailable(
                f"the session store (PostgreSQL) failed: {type(e).__name__}: {e}; retry"
            ) from e

    async def _connect(self) -> asyncpg.Pool:
        async with self._lock:  # every session call of a fresh Router may arrive at once
            if self._pool is None:
                pool = await asyncpg.create_pool(
                    self._dsn,
                    min_size=1,
                    max_size=self._max_size,
                    timeout=self._timeout_s,
                    command_timeout=self._timeout_s * 6,
                )
                try:
                    async with pool.acquire() as conn:
                        await migrate(conn)
                except BaseException:
                    await pool.close()
                    raise
                self._pool = pool
        return self._pool


async def migrate(conn: asyncpg.Connection) -> list[int]:
    """Apply the session-store migrations this database lacks; the versions applied now.

    Its own version table: the consolidation store's `schema_migrations` counts its own
    versions, and both may share one database."""
    applied: list[int] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK_KEY)
        await conn.execute("""CREATE TABLE IF NOT EXISTS raylane_sessions_migrations (
            version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())""")
        done = {
            r["version"]
            for r in await conn.fetch("SELECT version FROM raylane_sessions_migrations")
        }
        for version, sql in MIGRATIONS:
            if version not in done:
                await conn.execute(sql)
                await conn.execute(
                    "INSERT INTO raylane_sessions_migrations (version) VALUES ($1)", version
                )
                applied.append(version)
    return applied


def _dumps(session: Session) -> str:
    return json.dumps(encode_session(session), allow_nan=False, separators=(",", ":"))


def _loads(text: str) -> Session:
    return decode_session(json.loads(text))
