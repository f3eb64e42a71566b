"""The Router's replica supervision without Ray: `ReplicaSet`'s decisions (start what is missing,
replace what fails its health check, scale down, retire another engine's replicas only once the
new ones serve, stop when no app asks any more), with starting and killing an actor stubbed.
tests/ray/test_replica_set.py runs the real actors."""

from __future__ import annotations

import asyncio
import time

import pytest
from raylane.router.replica_set import ReplicaSet, ReplicaSpec


class Replica:
    """An actor handle as the health check calls it."""

    def __init__(self) -> None:
        self.healthy = True

        async def check():
            if not self.healthy:
                raise RuntimeError("engine dead")

        class CheckHealth:
            @staticmethod
            def remote():
                return check()

        self.check_health = CheckHealth


@pytest.fixture
def replicas(monkeypatch) -> ReplicaSet:
    forgotten: list[str] = []
    replica_set = ReplicaSet(lambda: None, forgotten.append, "raylane", check_s=3600)
    replica_set.forgotten = forgotten  # type: ignore[attr-defined]
    replica_set.killed = []  # type: ignore[attr-defined]

    async def start(spec: ReplicaSpec, rid: str) -> None:
        replica_set._starting.pop(rid, None)
        replica_set.handles[rid] = Replica()

    def kill(rid: str) -> None:
        replica_set.handles.pop(rid)
        replica_set.killed.append(rid)  # type: ignore[attr-defined]

    monkeypatch.setattr(replica_set, "_start", start)
    monkeypatch.setattr(replica_set, "_kill", kill)
    return replica_set


def spec(count: int, stamp: float, **engine) -> ReplicaSpec:
    return ReplicaSpec({"model": "m", **engine}, count, 1, None, stamp=stamp)


async def settle() -> None:
    """Let the supervising round (and the starts it spawned) run."""
    await asyncio.sleep(0.05)


async def test_starts_replaces_and_scales(replicas):
    replicas.deploy(spec(2, 1.0))
    await settle()
    first = sorted(replicas.handles)
    assert len(first) == 2
    replicas.handles[first[0]].healthy = False
    await replicas._reconcile()
    await settle()
    assert replicas.killed == [first[0]] and len(replicas.handles) == 2
    assert first[1] in replicas.handles
    before = set(replicas.handles)
    replicas.deploy(spec(1, 2.0))  # the same engine, one fewer: one is kept, none started
    await settle()
    assert len(replicas.handles) == 1 and set(replicas.handles) < before
    assert not replicas.deploy(spec(3, 0.5))  # an older app's ingress: ignored
    replicas.stop()


async def test_another_engine_replaces_only_once_the_new_ones_serve(replicas):
    replicas.deploy(spec(1, 1.0))
    await settle()
    (old,) = replicas.handles
    replicas.deploy(spec(1, 2.0, max_num_seqs=8))
    await settle()  # the first round starts the new replica; the old one serves meanwhile
    assert old in replicas.handles and len(replicas.handles) == 2 and not replicas.killed
    await replicas._reconcile()  # the next round sees the new one serving: the old one goes
    (new,) = replicas.handles
    assert new != old and new.split("-")[0] == spec(1, 2.0, max_num_seqs=8).key
    assert replicas.killed == [old]
    replicas.stop()


async def test_replicas_stop_when_no_app_sends_its_spec(replicas):
    replicas.deploy(spec(2, 1.0))
    await settle()
    replicas._deployed_at -= replicas.spec_lease_s + 1  # no ingress asked for that long
    await replicas._reconcile()
    assert replicas.handles == {} and replicas.spec is None and len(replicas.killed) == 2


async def test_a_replica_that_cannot_start_backs_off(monkeypatch):
    import ray
    import raylane.router.replica_set as replica_set_module

    def no_actor(cls):
        raise ValueError("engine_options: no such field 'max_num_seq'")

    monkeypatch.setattr(ray, "remote", no_actor)
    monkeypatch.setattr(replica_set_module, "_kill_actor", lambda name, namespace: None)
    replicas = ReplicaSet(lambda: None, lambda rid: None, "raylane", check_s=3600)
    replicas.spec = spec(1, 1.0)
    await replicas._start(replicas.spec, f"{replicas.spec.key}-a")
    await replicas._start(replicas.spec, f"{replicas.spec.key}-b")
    assert replicas._backoff == 2 * replica_set_module.START_BACKOFF_S
    assert replicas.handles == {} and replicas._next_start > 0
    replicas._deployed_at = time.monotonic()  # its app is asking
    await replicas._reconcile()  # within the backoff: no new start
    assert replicas._starting == {} and replicas.spec is not None
    replicas.deploy(spec(1, 2.0, max_num_seqs=8))  # another spec starts at once
    assert replicas._backoff == 0.0
    replicas.stop()
