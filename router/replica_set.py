"""The engine replicas the Router owns: plain Ray actors (`EngineReplica`) that it creates,
health-checks and replaces, to match the `ReplicaSpec` the Serve app deploys.

Each replica is a named, detached actor (`raylane-replica-<spec key>-<id>`), so a Router that
restarts finds its replicas again by name instead of starting new ones, and a redeploy whose
engine options changed (another spec key) replaces them: the old ones serve until as many new
ones do, then go. At tensor_parallel_size > 1 with the
Ray executor, a replica lives in bundle 0 of its own STRICT_PACK placement group (named like the
replica) and its shards take bundles 1..N (actors/executor/placement.py): a replica and its
shards start, fit and die together, on one node. Killing a replica ends its shards too (they
are its children) and its group is removed with it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

REPLICA_PREFIX = "raylane-replica-"
# the Serve app's ingress re-sends its spec with every table refresh (about twice a second);
# replicas whose app stopped asking this long ago (deleted without `raylane serve`'s shutdown)
# are stopped, so a detached replica never outlives its app for good
SPEC_LEASE_S = 300.0
# after a replica fails to start (bad engine options, no room), the next start waits this long,
# doubling up to START_BACKOFF_MAX_S, so a spec that cannot start does not reload in a loop
START_BACKOFF_S = 2.0
START_BACKOFF_MAX_S = 60.0


@dataclass(frozen=True)
class ReplicaSpec:
    """What the Serve app deploys: `count` replicas of one engine."""

    engine_options: dict = field(hash=False)
    count: int
    torch_threads: int | None = None
    bundles: list[dict] | None = field(default=None, hash=False)  # TP>1: the replica's group
    stamp: float = 0.0  # when the app was built: an older spec never replaces a newer one

    @property
    def key(self) -> str:
        """Same for two specs whose replicas are interchangeable (count and stamp aside)."""
        text = json.dumps([self.engine_options, self.torch_threads, self.bundles], sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=5).hexdigest()


class ReplicaSet:
    """The replicas of the current spec, by replica id. `register` / `forget` tell the
    Router's table; `router` is the Router's own handle, which the replicas heartbeat to."""

    def __init__(
        self,
        router: Callable[[], Any],
        forget: Callable[[str], None],
        namespace: str,
        check_s: float = 2.0,
        check_timeout_s: float = 30.0,
        spec_lease_s: float = SPEC_LEASE_S,
    ) -> None:
        self.router = router
        self.forget = forget
        self.namespace = namespace
        self.check_s = check_s
        self.check_timeout_s = check_timeout_s
        self.spec_lease_s = spec_lease_s
        self._deployed_at = 0.0  # monotonic time the current spec was last sent
        self.spec: ReplicaSpec | None = None
        self.handles: dict[str, Any] = {}  # started replicas
        self._starting: dict[str, asyncio.Task] = {}
        self._loop: asyncio.Task | None = None
        self._adopted = False
        self._backoff = 0.0  # seconds to wait after the last failed start (0: none failed)
        self._next_start = 0.0  # monotonic time before which no replica starts

    def deploy(self, spec: ReplicaSpec) -> bool:
        """Make the replicas match `spec` (in the background); False when it is older than
        the current one (an ingress of the app's previous version still asking)."""
        if self.spec is not None and spec.stamp < self.spec.stamp:
            return False
        changed = self.spec != spec
        self.spec, self._deployed_at = spec, time.monotonic()
        if changed:  # a new spec starts without the last one's backoff
            self._backoff = self._next_start = 0.0
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._supervise())
        elif changed:
            self._loop.cancel()  # restart at once, without waiting out the check period
            self._loop = asyncio.get_running_loop().create_task(self._supervise())
        return True

    async def _supervise(self) -> None:
        while True:
            try:
                await self._reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:  # e.g. the GCS busy for a moment; the next round retries
                log.exception("reconciling the engine replicas failed")
            await asyncio.sleep(self.check_s)

    async def _reconcile(self) -> None:
        self.adopt()
        spec = self.spec
        if spec is None:  # stopped
            return
        if time.monotonic() - self._deployed_at > self.spec_lease_s:
            log.warning("no ingress sent the replica spec for %.0f s: stopping", self.spec_lease_s)
            self.stop()
            return
        await self._check_health()
        current = sorted(r for r in self.handles if started_for(spec, r))
        starting = sum(started_for(spec, r) for r in self._starting)
        missing = spec.count - len(current) - starting
        for _ in range(missing if time.monotonic() >= self._next_start else 0):
            rid = f"{spec.key}-{uuid.uuid4().hex[:8]}"
            self._starting[rid] = asyncio.get_running_loop().create_task(self._start(spec, rid))
        for rid in current[: max(-missing, 0)]:
            self._kill(rid)  # scaled down
        if len(current) >= spec.count:
            # a redeploy changed the engine options: the old replicas serve until the new ones
            # do (as a rolling update), then go
            for rid in [r for r in self.handles if not started_for(spec, r)]:
                self._kill(rid)

    def adopt(self) -> None:
        """Once: the replicas a previous incarnation of the Router started (found by name)."""
        import ray

        if self._adopted or not ray.is_initialized():
            return
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"]
            if entry["namespace"] == self.namespace and name.startswith(REPLICA_PREFIX):
                rid = name[len(REPLICA_PREFIX) :]
                try:
                    self.handles[rid] = ray.get_actor(name, namespace=self.namespace)
                except ValueError:  # gone meanwhile
                    continue
        self._adopted = True

    async def _check_health(self) -> None:
        ids = list(self.handles)
        results = await asyncio.gather(
            *(
                asyncio.wait_for(self.handles[r].check_health.remote(), self.check_timeout_s)
                for r in ids
            ),
            return_exceptions=True,
        )
        for rid, result in zip(ids, results):
            if isinstance(result, BaseException):
                log.warning("engine replica %s failed its health check: %r", rid, result)
                self._kill(rid)

    async def _start(self, spec: ReplicaSpec, rid: str) -> None:
        import ray
        from raylane.actors.replica import EngineReplica

        group = None
        options: dict[str, Any] = {
            "name": REPLICA_PREFIX + rid,
            "namespace": self.namespace,
            "lifetime": "detached",
            "num_cpus": 0,
            "max_restarts": 0,  # replaced here, under a new id
        }
        try:
            if spec.bundles:
                group = await self._placement_group(rid, spec.bundles)
                options["scheduling_strategy"] = _in_bundle_0(group)
            else:
                options["scheduling_strategy"] = "DEFAULT"  # never in the Router's group
            actor_class: Any = ray.remote(EngineReplica)
            handle = actor_class.options(**options).remote(
                spec.engine_options, self.router(), spec.torch_threads, rid
            )
            await handle.start.remote()  # after the engine loaded: registers, heartbeats
        except Exception:
            log.exception("engine replica %s did not start", rid)
            _kill_actor(REPLICA_PREFIX + rid, self.namespace)
            _remove_group(group)
            self._backoff = min(max(2 * self._backoff, START_BACKOFF_S), START_BACKOFF_MAX_S)
            self._next_start = time.monotonic() + self._backoff
            return
        finally:
            self._starting.pop(rid, None)
        self._backoff = 0.0
        if self.spec is not None and self.spec.key == spec.key:
            self.handles[rid] = handle
        else:  # the spec changed while it loaded
            _kill_actor(REPLICA_PREFIX + rid, self.namespace)
            _remove_group(group)

    async def _placement_group(self, rid: str, bundles: list[dict]) -> Any:
        from ray.util import placement_group

        group = placement_group(bundles, strategy="STRICT_PACK", name=REPLICA_PREFIX + rid)
        await group.ready()
        return group

    def _kill(self, rid: str) -> None:
        import ray
        from ray.util import get_placement_group

        handle = self.handles.pop(rid, None)
        if handle is not None:
            ray.kill(handle, no_restart=True)
        try:
            _remove_group(get_placement_group(REPLICA_PREFIX + rid))
        except ValueError:  # it had none
            pass
        self.forget(rid)

    def stop(self) -> None:
        """Kill every replica, those of an earlier Router included."""
        if self._loop is not None:
            self._loop.cancel()
        for task in self._starting.values():
            task.cancel()
        self._adopted = False
        self.adopt()
        for rid in list(self.handles):
            self._kill(rid)
        self.spec = None


def started_for(spec: ReplicaSpec, replica_id: str) -> bool:
    """The replica was started for `spec`'s engine."""
    return replica_id.startswith(spec.key + "-")


def _in_bundle_0(group: Any) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # the shards choose their bundles themselves (actors/executor/placement.py)
    return PlacementGroupSchedulingStrategy(
        placement_group=group,
        placement_group_bundle_index=0,
        placement_group_capture_child_tasks=False,
    )


def _kill_actor(name: str, namespace: str) -> None:
    import ray

    try:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    except ValueError:  # never created
        pass


def _remove_group(group: Any) -> None:
    if group is not None:
        from ray.util import remove_placement_group

        remove_placement_group(group)
