"""OperationLog: the consolidation_operations table (status, stats, per-batch perf, cancel)."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from .pool import CountingPool

FINAL_STATUSES = ("completed", "failed", "cancelled", "interrupted")

# Only called under the bank lock: then any other 'running' op of the bank belongs to a process
# that died (its lock went with its connection), so it is marked interrupted, not left running.
START_SQL = """
WITH stale AS (
    UPDATE consolidation_operations
    SET status = 'interrupted', finished_at = now(),
        error = 'the process running it stopped before it finished'
    WHERE bank_id = $2 AND status = 'running' AND id <> $1)
UPDATE consolidation_operations SET status = 'running', started_at = now()
WHERE id = $1 AND bank_id = $2 AND status = 'pending'
"""


class OperationLog:
    """Rows of consolidation_operations; op ids are uuid strings."""

    def __init__(self, pool: CountingPool) -> None:
        self._pool = pool

    async def create(self, bank_id: str) -> str:
        op_id = await self._pool.fetchval(
            "INSERT INTO consolidation_operations (bank_id) VALUES ($1) RETURNING id", bank_id
        )
        return str(op_id)

    async def start(self, op_id: str, bank_id: str) -> None:
        result = await self._pool.execute(START_SQL, op_id, bank_id)
        if result != "UPDATE 1":
            raise ValueError(f"operation {op_id} of bank {bank_id!r} is not pending")

    async def finish(
        self,
        op_id: str,
        status: str,
        stats: dict[str, Any],
        perf: list[dict[str, Any]],
        error: str | None = None,
    ) -> None:
        if status not in FINAL_STATUSES:
            raise ValueError(f"status must be one of {FINAL_STATUSES}, got {status!r}")
        await self._pool.execute(
            """UPDATE consolidation_operations
               SET status = $2, stats = $3, perf = $4, error = $5, finished_at = now()
               WHERE id = $1""",
            op_id,
            status,
            stats,
            perf,
            error,
        )

    async def request_cancel(self, op_id: str) -> bool:
        """Flag a pending or running operation; False if it is unknown or already finished."""
        if _as_uuid(op_id) is None:
            return False
        row = await self._pool.fetchval(
            """UPDATE consolidation_operations SET cancel_requested = true
               WHERE id = $1 AND status IN ('pending', 'running') RETURNING id""",
            op_id,
        )
        return row is not None

    async def get(self, op_id: str) -> dict[str, Any] | None:
        """The operation as a plain dict (JSON-safe values), or None if unknown."""
        if _as_uuid(op_id) is None:
            return None
        row = await self._pool.fetchrow(
            "SELECT * FROM consolidation_operations WHERE id = $1", op_id
        )
        return None if row is None else _as_dict(row)

    async def for_bank(self, bank_id: str) -> list[dict[str, Any]]:
        """A bank's operations, oldest first."""
        rows = await self._pool.fetch(
            "SELECT * FROM consolidation_operations WHERE bank_id = $1 ORDER BY created_at", bank_id
        )
        return [_as_dict(r) for r in rows]


def _as_dict(row: asyncpg.Record) -> dict[str, Any]:
    out = dict(row)
    out["id"] = str(out["id"])
    for key in ("created_at", "started_at", "finished_at"):
        out[key] = out[key].isoformat() if out[key] else None
    return out


def _as_uuid(op_id: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(op_id))
    except ValueError:
        return None
