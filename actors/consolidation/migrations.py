"""Versioned schema migrations, applied idempotently when a store connects."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

# pg_advisory_xact_lock key: serializes stores that start at the same time ("raylane-m").
MIGRATION_LOCK_KEY = 0x7261796C616E65


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


V1_SQL = """
CREATE TABLE memories (
    id bigserial PRIMARY KEY,
    bank_id text NOT NULL,
    content text NOT NULL,
    tags text[] NOT NULL DEFAULT '{}',   -- sorted, distinct (normalized by the store)
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    consolidated_at timestamptz,
    consolidation_failed_at timestamptz
);
-- The consolidator's only scan: a bank's pending memories, oldest first.
CREATE INDEX memories_pending_idx ON memories (bank_id, created_at, id)
    WHERE consolidated_at IS NULL AND consolidation_failed_at IS NULL;

CREATE TABLE observations (
    id bigserial PRIMARY KEY,
    bank_id text NOT NULL,
    content text NOT NULL,
    tags text[] NOT NULL,
    source_memory_ids bigint[] NOT NULL,
    proof_count integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    history jsonb NOT NULL DEFAULT '[]'   -- one entry per create/update, oldest first
);
-- Every read and write of observations is by exact scope (bank, tag set).
CREATE INDEX observations_scope_idx ON observations (bank_id, tags);

CREATE TABLE consolidation_operations (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    bank_id text NOT NULL,
    status text NOT NULL DEFAULT 'pending' CHECK (status IN
        ('pending', 'running', 'completed', 'failed', 'cancelled', 'interrupted')),
    stats jsonb NOT NULL DEFAULT '{}',
    perf jsonb NOT NULL DEFAULT '[]',     -- one record per LLM batch
    error text,
    cancel_requested boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now(),
    started_at timestamptz,
    finished_at timestamptz
);
CREATE INDEX consolidation_operations_bank_idx ON consolidation_operations (bank_id, created_at);
"""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "memories, observations, consolidation operations", V1_SQL),
)


async def migrate(conn: asyncpg.Connection) -> list[int]:
    """Apply the migrations this database lacks, in order; returns the versions applied now."""
    applied_now: list[int] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK_KEY)
        await conn.execute("""CREATE TABLE IF NOT EXISTS schema_migrations (
            version integer PRIMARY KEY, name text NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT now())""")
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        for m in MIGRATIONS:
            if m.version not in done:
                await conn.execute(m.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)",
                    m.version,
                    m.name,
                )
                applied_now.append(m.version)
    return applied_now
