"""One process's copy of the Router's replica table, and the routing choice made on it.

The HTTP ingress, the in-cluster rollout client and the Router's own session turns each keep a
`ReplicaView`: refreshed in the background (`REFRESH_S`), never per request, so choosing a
replica is a local call and a request's only crossings are to its replica and back. The view
counts the requests this process has in flight on each replica itself, and adds the others'
as the replica reported them at its last heartbeat: its count less those on this process's own
output channel (`channel_of`; `ReplicaState`). The `RoutingPolicy` picks: sticky by routing
key, else least loaded, only among healthy replicas at the cluster's weight version.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from raylane.router.policy import RoutingPolicy

log = logging.getLogger(__name__)

REFRESH_S = 0.5


class ReplicaView:
    """`fetch(known)` returns the Router's table rows (`Router.table`), with the handles of the
    replicas not in `known` (those this view holds already); `report` tells the Router
    a replica failed a request; `channel_of(replica_id)` is the id of this process's output
    channel to that replica, if one is open (`ReplicaRequests` sets it)."""

    def __init__(
        self,
        fetch: Callable[[list[str]], Awaitable[list[dict]]],
        capacity: int,
        report: Callable[[str], Any],
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.fetch = fetch
        self.report = report
        self.refresh_s = refresh_s
        self.policy = RoutingPolicy(capacity)
        self.handles: dict[str, Any] = {}
        self.channel_of: Callable[[str], str | None] = lambda replica_id: None
        self._beats: dict[str, int] = {}  # the heartbeat each replica's count came from
        self._first: asyncio.Task | None = None
        self._loop_task: asyncio.Task | None = None

    def apply(self, rows: list[dict]) -> None:
        """Take the Router's table: replicas, their handles (only those new to this view),
        health, versions and load."""
        for rid in set(self.policy.replicas) - {r["replica_id"] for r in rows}:
            self.policy.remove(rid)
            self.handles.pop(rid, None)
            self._beats.pop(rid, None)
        for row in rows:
            rid = row["replica_id"]
            if row["handle"] is not None:
                self.handles[rid] = row["handle"]
            elif rid not in self.handles:  # listed without one: the next table brings it
                continue
            self.policy.add(rid)
            state = self.policy.replicas[rid]
            state.healthy = row["healthy"]
            state.adapters = frozenset(row.get("adapters", ()))
            state.set_lora_versions(row.get("lora_versions", {}))
            if row["weight_version"] is not None:
                self.policy.set_version(rid, row["weight_version"])
            if self._beats.get(rid) != row["beat"]:  # a new heartbeat: the replica's own count
                self._beats[rid] = row["beat"]
                channel = self.channel_of(rid)
                state.report(row["held"], row["held_on"].get(channel, 0) if channel else 0)

    async def choose(self, routing_key: str | None = None, lora: str | None = None) -> str | None:
        """A replica for one request (on adapter `lora`, if any), counted in flight until
        `done`; None when every replica is full or down."""
        await self._fresh()
        replica_id = self.policy.choose(routing_key, lora)
        if replica_id is not None:
            self.policy.started(replica_id)
        return replica_id

    def handle(self, replica_id: str) -> Any:
        return self.handles[replica_id]

    def done(self, replica_id: str) -> None:
        self.policy.finished(replica_id)

    def report_failure(self, replica_id: str) -> None:
        """Skip the replica here until the Router's table says it is healthy again."""
        self.policy.set_healthy(replica_id, False)
        self.report(replica_id)

    async def ready(self) -> bool:
        await self._fresh()
        return bool(self.policy.routable())

    def close(self) -> None:
        """Stop the background refresh (a later choice starts it again)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            self._loop_task = None

    async def _fresh(self) -> None:
        """The first table, fetched once; then the background refresh keeps it current
        (`refresh_s` 0: fetched before every choice, for a table in this process)."""
        if self.refresh_s == 0:
            self.apply(await self.fetch(list(self.handles)))
            return
        loop = asyncio.get_running_loop()
        # tasks belong to one event loop: a caller on another loop starts its own
        first = self._first
        if first is None or self._loop_task is None or self._loop_task.get_loop() is not loop:
            first = self._first = loop.create_task(self._refresh())
            self._loop_task = loop.create_task(self._refresh_forever(first))
        await asyncio.shield(first)

    async def _refresh(self) -> None:
        try:
            self.apply(await self.fetch(list(self.handles)))
        except Exception as e:  # the Router restarts: keep routing on the last table
            log.warning("could not refresh the replica table: %r", e)

    async def _refresh_forever(self, first: asyncio.Task) -> None:
        await first
        while True:
            await asyncio.sleep(self.refresh_s)
            await self._refresh()
