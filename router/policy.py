"""Replica choice: sticky by routing key (consistent hashing), otherwise least loaded, only
among replicas at the cluster's weight version.

Plain Python, no Ray: the Router actor feeds it the replica table and asks it to pick.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass
class ReplicaState:
    """What one process knows of one replica.

    `in_flight` is what the replica held at its last heartbeat, less the requests this process
    had on it then (`report`), plus this process's own requests on it now (`own`, counted
    exactly as they start and finish). Only other processes' requests are stale, by at most a
    heartbeat: a heartbeat sent while this process's request ran does not keep counting that
    request once it finished. A process that dies takes its own count with it, and the replica
    aborts its requests when their channel lapses, so no count outlives its request.
    """

    replica_id: str
    reported: int = 0  # the others' requests the replica held at its last heartbeat
    own: int = 0  # this process's requests on it now: started and not yet finished
    routed: int = 0  # requests routed to it since it registered
    healthy: bool = True
    last_seen: float = 0.0  # monotonic time of its last heartbeat
    weight_version: int | None = None  # None: it never said (treated as current)
    adapters: frozenset[str] = frozenset()  # LoRA adapters it holds in a slot (last heartbeat)
    # per adapter, the versions it holds (last heartbeat): where a request for one can run
    lora_versions: dict[str, frozenset[int]] = field(default_factory=dict)

    @property
    def in_flight(self) -> int:
        return self.reported + self.own

    def set_lora_versions(self, held: Mapping[str, list[int]]) -> None:
        self.lora_versions = {name: frozenset(versions) for name, versions in held.items()}

    def report(self, held: int, own_held: int = 0) -> None:
        """The replica's own count, as its heartbeat carried it: `held` requests, `own_held` of
        them this process's."""
        self.reported = max(0, held - own_held)


class HashRing:
    """Consistent hashing with virtual nodes: adding or removing a replica moves ~1/N of keys."""

    def __init__(self, virtual_nodes: int = 64):
        self.virtual_nodes = virtual_nodes
        self._points: list[int] = []
        self._owners: list[str] = []

    def rebuild(self, replica_ids: list[str]) -> None:
        points = sorted(
            (_hash(f"{rid}#{i}"), rid) for rid in replica_ids for i in range(self.virtual_nodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [rid for _, rid in points]

    def walk(self, key: str):
        """Replica ids in ring order starting at the key's point (each once)."""
        if not self._points:
            return
        start = bisect.bisect(self._points, _hash(key)) % len(self._points)
        seen: set[str] = set()
        for i in range(len(self._points)):
            owner = self._owners[(start + i) % len(self._points)]
            if owner not in seen:
                seen.add(owner)
                yield owner


class RoutingPolicy:
    """Picks a replica for a request; `None` when no healthy replica has room.

    `capacity` bounds the requests in flight per replica (queued included): beyond it the
    caller should answer 429 rather than queue without bound. A keyed request stays on its
    ring owner even when that one is busier than others, so its prefix cache is reused.

    The cluster's weight version is the highest any known replica reports: one behind it (it
    missed an update, or Serve restarted it from the checkpoint at version 0) is skipped like
    an unhealthy one, so no request is served by weights older than the others'. Deriving the
    version from the replicas, not storing it, lets a restarted Router re-learn it from the
    heartbeats, and a redeployed app (every replica new, at 0) start over once the old
    replicas are forgotten.
    """

    def __init__(self, capacity: int = 256, virtual_nodes: int = 64):
        self.capacity = capacity
        self.replicas: dict[str, ReplicaState] = {}
        self.ring = HashRing(virtual_nodes)
        self._tiebreak = itertools.count()

    def add(self, replica_id: str, now: float = 0.0) -> None:
        if replica_id not in self.replicas:
            self.replicas[replica_id] = ReplicaState(replica_id, last_seen=now)
            self.ring.rebuild(sorted(self.replicas))

    def remove(self, replica_id: str) -> None:
        if self.replicas.pop(replica_id, None) is not None:
            self.ring.rebuild(sorted(self.replicas))

    def set_healthy(self, replica_id: str, healthy: bool) -> None:
        if replica_id in self.replicas:
            self.replicas[replica_id].healthy = healthy

    def set_version(self, replica_id: str, version: int) -> None:
        """Record a replica's weight version. A replica id never goes back (a restarted
        replica has a new id), so an older report — a heartbeat sent before an update
        finished — is ignored."""
        state = self.replicas.get(replica_id)
        if state is not None and (state.weight_version is None or version > state.weight_version):
            state.weight_version = version

    @property
    def weight_version(self) -> int:
        known = [r.weight_version for r in self.replicas.values() if r.weight_version is not None]
        return max(known, default=0)

    def healthy(self) -> list[ReplicaState]:
        return [r for r in self.replicas.values() if r.healthy]

    def routable(self) -> list[ReplicaState]:
        """Healthy replicas at the cluster's weight version."""
        version = self.weight_version
        return [r for r in self.healthy() if r.weight_version in (None, version)]

    def choose(self, routing_key: str | None = None, lora: str | None = None) -> str | None:
        """`lora`: the request's adapter; among the least loaded, a replica that holds it in
        a slot goes first (it costs nothing; it never outweighs load or a routing key). One
        that asks for a version of it (a `LoRAName`) goes only where that version is held
        (`_holding`), before load and routing keys decide."""
        routable = _holding(self.routable(), lora)
        if routing_key is not None:
            ids = {r.replica_id for r in routable}
            for rid in self.ring.walk(routing_key):
                state = self.replicas[rid]
                if rid in ids:  # skip a failed or stale owner until it recovers
                    return rid if state.in_flight < self.capacity else None
            return None
        open_ = [r for r in routable if r.in_flight < self.capacity]
        if not open_:
            return None
        least = min(r.in_flight for r in open_)
        ties = [r for r in open_ if r.in_flight == least]
        ties = [r for r in ties if lora in r.adapters] or ties
        return ties[next(self._tiebreak) % len(ties)].replica_id  # rotate among equals

    def started(self, replica_id: str) -> None:
        if replica_id in self.replicas:
            self.replicas[replica_id].own += 1
            self.replicas[replica_id].routed += 1

    def finished(self, replica_id: str) -> None:
        state = self.replicas.get(replica_id)
        if state is not None and state.own > 0:
            state.own -= 1


def _holding(replicas: list[ReplicaState], lora: str | None) -> list[ReplicaState]:
    """`replicas`, narrowed to those that hold the version `lora` asks for (by their last
    heartbeat), when any does. A replica keeps an adapter's older version only while requests
    started on it run, and one started after it was replaced never held it: there, the request
    would be a 409 while another replica could still serve it (a rollout that finishes on the
    policy it started with). When none is known to hold it (a version just committed, not yet
    in a heartbeat), every replica may: it answers, or says the version is gone."""
    version = getattr(lora, "version", None)
    if lora is None or version is None:
        return replicas
    holders = [r for r in replicas if version in r.lora_versions.get(lora, ())]
    return holders or replicas
