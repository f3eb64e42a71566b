"""TagScope: the per-batch database work of one (bank, tag set), one round trip per batch.

Every statement returns a `ScopeSnapshot` (the scope's observations as they now are, and the
operation's cancel flag), so the next batch of the group needs no read of its own; the first
batches of a round get theirs from `read_snapshots`, one query for all the round's scopes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from .errors import CommitConflict
from .pool import CountingPool
from .records import Action, ObservationView, Tags

# Parameters shared by every statement: $1 bank id, $2 tag set, $3 op id (text or NULL).
CANCELLED = """coalesce((SELECT cancel_requested FROM consolidation_operations
                  WHERE id = ($3::text)::uuid), false) AS cancelled"""


def _observations_of(source: str) -> str:
    return f"""coalesce((SELECT jsonb_agg(jsonb_build_object('id', id, 'text', text) ORDER BY id)
                 FROM {source}), '[]') AS observations"""


SNAPSHOT_SQL = f"""
SELECT {CANCELLED},
       {
    _observations_of(
        "(SELECT id, content AS text FROM observations WHERE bank_id = $1 AND tags = $2) AS scope"
    )
}
"""

# $2 a JSON array of tag sets. Each scope's observations are matched on its exact tag set.
SNAPSHOTS_SQL = f"""
WITH scopes AS (
    SELECT n, ARRAY(SELECT jsonb_array_elements_text(t)) AS tags
    FROM jsonb_array_elements($2::jsonb) WITH ORDINALITY AS s(t, n))
SELECT scopes.n, {CANCELLED},
       coalesce(jsonb_agg(jsonb_build_object('id', o.id, 'text', o.content) ORDER BY o.id)
                FILTER (WHERE o.id IS NOT NULL), '[]') AS observations
FROM scopes LEFT JOIN observations o ON o.bank_id = $1 AND o.tags = scopes.tags
GROUP BY scopes.n
"""

# $4 memory id. Data-modifying CTEs always run to completion, read or not.
MARK_FAILED_SQL = f"""
WITH failed AS (
    UPDATE memories SET consolidation_failed_at = now()
    WHERE id = $4 AND bank_id = $1 AND consolidated_at IS NULL)
{SNAPSHOT_SQL}"""

# A batch's whole effect in ONE atomic statement, whatever the batch size: `guard` checks that
# every memory ($4) is still pending and every updated observation is in the scope (rows locked
# FOR UPDATE), and every write ($5 creates, $6 updates) is conditional on it, so a failed guard
# writes nothing. The statement's own snapshot predates its writes, so the observations it
# returns are the untouched ones plus what `created` and `updated` return.
COMMIT_SQL = f"""
WITH batch AS (
    -- By primary key alone, so no plan can walk the bank's pending index (a planner without
    -- fresh statistics would); `guard` checks the bank and that each memory is pending.
    SELECT id, bank_id = $1 AND consolidated_at IS NULL AND consolidation_failed_at IS NULL
               AS pending
    FROM memories WHERE id = ANY($4::bigint[])
    FOR UPDATE
), upd AS (
    SELECT * FROM jsonb_to_recordset($6::jsonb) AS u(id bigint, text text, memory_ids bigint[])
), targets AS (
    SELECT o.id FROM observations o
    WHERE o.id IN (SELECT id FROM upd) AND o.bank_id = $1 AND o.tags = $2
    FOR UPDATE
), guard AS (
    SELECT (SELECT count(*) FROM batch WHERE pending) = cardinality($4::bigint[]) AS pending,
           (SELECT count(*) FROM targets) = (SELECT count(*) FROM upd) AS in_scope
), stamped AS (
    UPDATE memories m SET consolidated_at = now()
    FROM guard WHERE guard.pending AND guard.in_scope AND m.id IN (SELECT id FROM batch)
), created AS (
    INSERT INTO observations (bank_id, tags, content, source_memory_ids, proof_count, history)
    SELECT $1, $2, c.text, c.memory_ids, cardinality(c.memory_ids),
           jsonb_build_array(jsonb_build_object(
               'at', now(), 'action', 'create', 'op_id', $3::text,
               'text', c.text, 'memory_ids', c.memory_ids))
    FROM jsonb_to_recordset($5::jsonb) AS c(text text, memory_ids bigint[]), guard
    WHERE guard.pending AND guard.in_scope
    RETURNING id, content AS text
), updated AS (
    UPDATE observations o
    SET content = upd.text,
        source_memory_ids = o.source_memory_ids || upd.memory_ids,
        proof_count = o.proof_count + cardinality(upd.memory_ids),
        updated_at = now(),
        history = o.history || jsonb_build_object(
            'at', now(), 'action', 'update', 'op_id', $3::text,
            'previous_text', o.content, 'text', upd.text, 'memory_ids', upd.memory_ids)
    FROM upd, guard
    WHERE guard.pending AND guard.in_scope AND o.id = upd.id AND o.id IN (SELECT id FROM targets)
    RETURNING o.id, o.content AS text
), visible AS (
    SELECT id, content AS text FROM observations
    WHERE bank_id = $1 AND tags = $2 AND id NOT IN (SELECT id FROM updated)
    UNION ALL SELECT * FROM created
    UNION ALL SELECT * FROM updated
)
SELECT guard.pending, guard.in_scope,
       (SELECT count(*) FROM created) AS created, (SELECT count(*) FROM updated) AS updated,
       {CANCELLED},
       {_observations_of("visible")}
FROM guard
"""


@dataclass(frozen=True)
class ScopeSnapshot:
    """What the next LLM call of a group needs from the database."""

    cancelled: bool
    observations: list[ObservationView]


@dataclass(frozen=True)
class CommitResult:
    created: int
    updated: int
    snapshot: ScopeSnapshot  # the scope after this commit


class TagScope:
    """Reads and writes the observations of exactly one (bank, tag set) for one operation.

    Every query goes through `_query`, which counts it: `round_trips` is what the scope's
    batches cost the database, one per statement, whatever the batch size.
    """

    def __init__(
        self, pool: CountingPool, bank_id: str, tags: Tags, op_id: str | None = None
    ) -> None:
        self._pool = pool
        self.bank_id = bank_id
        self.tags = tags
        self.op_id = op_id
        self.round_trips = 0

    async def commit(self, memory_ids: Sequence[int], actions: Sequence[Action]) -> CommitResult:
        """Apply a batch's actions and stamp its memories, atomically.

        Raises CommitConflict, having written nothing, when a memory is no longer pending or
        an update names an observation outside the scope.
        """
        creates = [
            {"text": a.text, "memory_ids": list(a.memory_ids)}
            for a in actions
            if a.kind == "create"
        ]
        updates = [
            {"id": a.observation_id, "text": a.text, "memory_ids": list(a.memory_ids)}
            for a in actions
            if a.kind == "update"
        ]
        row = await self._query(COMMIT_SQL, list(memory_ids), creates, updates)
        if not row["pending"]:
            raise CommitConflict(
                "some of the batch's memories are already consolidated or "
                "failed; nothing was written"
            )
        if not row["in_scope"]:
            raise CommitConflict(
                "an update named an observation outside the scope; nothing was written"
            )
        return CommitResult(row["created"], row["updated"], _snapshot(row))

    async def mark_failed(self, memory_id: int) -> ScopeSnapshot:
        """Stamp consolidation_failed_at on one memory that failed alone."""
        return _snapshot(await self._query(MARK_FAILED_SQL, memory_id))

    async def _query(self, sql: str, *args: object) -> asyncpg.Record:
        self.round_trips += 1
        return await self._pool.fetchrow(sql, self.bank_id, list(self.tags), self.op_id, *args)


async def read_snapshots(
    pool: CountingPool, bank_id: str, tag_sets: Sequence[Tags], op_id: str | None
) -> dict[Tags, ScopeSnapshot]:
    """The snapshots of several scopes of a bank, in one query.

    Safe to read ahead of a group's first batch: under the bank lock, only that group ever
    writes its scope, so nothing changes it in between.
    """
    rows = await pool.fetch(SNAPSHOTS_SQL, bank_id, [list(t) for t in tag_sets], op_id)
    return {tag_sets[row["n"] - 1]: _snapshot(row) for row in rows}


def _snapshot(row: asyncpg.Record) -> ScopeSnapshot:
    views = [ObservationView(o["id"], o["text"]) for o in row["observations"]]
    return ScopeSnapshot(cancelled=row["cancelled"], observations=views)
