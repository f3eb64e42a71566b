"""`ReplicaBroadcast`: one control call on many engine replicas at once, the base of the control
plane (`ControlPlane`, and its part `WeightGroups`): which replicas a call reaches, and what a
replica that fails it means (reported to the table, and out of the update in progress)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from raylane.actors.replica_control import ReplicaControl
from raylane.router.control_parts import ReplicaCalls, ReplicaTable, Update
from raylane.router.errors import ReplicasFailed

log = logging.getLogger(__name__)


class ReplicaBroadcast:
    def __init__(self, table: ReplicaTable, calls: ReplicaCalls) -> None:
        self.table = table
        self.calls = calls

    def _reachable(self) -> list[str]:
        ids = self.table.reachable()
        if not ids:
            raise ReplicasFailed("no engine replica is ready")
        return ids

    async def _call_all(self, method: str, *args: Any) -> dict[str, Any]:
        return await self._everywhere(
            self._reachable(),
            method,
            lambda r: r.control_call(method, *args),
        )

    async def _everywhere(
        self,
        ids: list[str],
        method: str,
        call: Callable[[ReplicaControl], Awaitable[Any]],
        update: Update | None = None,
    ) -> dict[str, Any]:
        """`call(replica)` (the replica's `method`) on every replica in `ids` at once;
        their results by replica id.

        A `ValueError` (the input's fault) raised anywhere is raised here. A replica that
        failed otherwise is reported, and leaves `update`; only when none succeeded is it an
        error (`ReplicasFailed`)."""
        if not ids:
            raise ReplicasFailed(f"{method}: no engine replica is left to call")
        calls = (call(self.calls.replica(rid)) for rid in ids)
        results = await asyncio.gather(*calls, return_exceptions=True)
        ok = {rid: r for rid, r in zip(ids, results) if not isinstance(r, BaseException)}
        failed = {rid: r for rid, r in zip(ids, results) if isinstance(r, BaseException)}
        bad_input = next((e for e in failed.values() if isinstance(e, ValueError)), None)
        if bad_input is not None:
            raise bad_input
        for rid, error in failed.items():
            log.warning("%s failed on engine replica %s: %r", method, rid, error)
            self.table.report_failure(rid)
            if update is not None:
                update.replica_ids.remove(rid)
                update.failed.append(rid)
        if not ok:
            first = next(iter(failed.values()))
            raise ReplicasFailed(
                f"{method} failed on every engine replica: {type(first).__name__}: {first}"
            ) from first
        return ok
