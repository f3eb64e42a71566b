"""The control plane's own state without Ray or a model: serialization, idempotence, the update
transaction's bookkeeping when replicas fail, and version-aware routing.

The replicas here only record the calls they get (no model output is checked: the e2e and Ray
tests run the real engines); each can be told to fail a method or to block in it.
"""

from __future__ import annotations

import asyncio
import functools

import pytest
from raylane.router.control import ControlPlane
from raylane.router.errors import ControlConflict, ReplicasFailed, UpdateNotFound
from raylane.router.policy import RoutingPolicy

SPECS = [
    {"name": "a.weight", "shape": [2, 2], "dtype": "float32"},
    {"name": "b.weight", "shape": [2], "dtype": "float32"},
]


class Table:
    """A `ReplicaTable` over a RoutingPolicy, as the Router's."""

    def __init__(self, *ids: str):
        self.policy = RoutingPolicy()
        for rid in ids:
            self.policy.add(rid)
            self.policy.set_version(rid, 0)
        self.failures: list[str] = []

    def reachable(self) -> list[str]:
        return [r.replica_id for r in self.policy.healthy()]

    def weight_version(self) -> int:
        return self.policy.weight_version

    def set_version(self, replica_id: str, version: int) -> None:
        self.policy.set_version(replica_id, version)

    def report_failure(self, replica_id: str) -> None:
        self.failures.append(replica_id)
        self.policy.set_healthy(replica_id, False)


class Recorder:
    """`ReplicaCalls` that logs (replica, method, phase) and answers like a replica would."""

    def replica(self, replica_id: str) -> On:
        return On(self, replica_id)

    def __init__(self):
        self.log: list[tuple[str, str, str]] = []
        self.fail: dict[tuple[str, str], Exception] = {}  # (replica, method) -> error
        self.gates: dict[str, asyncio.Event] = {}  # method -> event it waits for

    async def pause(self, replica_id: str, mode: str):
        return await self._record(replica_id, "pause", mode)

    async def resume(self, replica_id: str):
        return await self._record(replica_id, "resume")

    async def begin_weight_update(self, replica_id: str, spec_dicts: list[dict]):
        return await self._record(replica_id, "begin_weight_update", spec_dicts)

    async def load_weight_bucket(self, replica_id: str, bucket):
        return await self._record(replica_id, "load_weight_bucket", bucket)

    async def finish_weight_update(self, replica_id: str, version: int):
        return await self._record(replica_id, "finish_weight_update", version)

    async def abort(self, replica_id: str, request_ids: list[str]):
        return await self._record(replica_id, "abort", request_ids)

    async def flush_cache(self, replica_id: str):
        return await self._record(replica_id, "flush_cache")

    async def _record(self, replica_id: str, method: str, *args):
        self.log.append((replica_id, method, "start"))
        if method in self.gates:
            await self.gates[method].wait()
        self.log.append((replica_id, method, "end"))
        error = self.fail.get((replica_id, method))
        if error is not None:
            raise error
        return {
            "load_weight_bucket": 2,
            "finish_weight_update": args[0] if args else None,
            "abort": [f"out-{replica_id}"],
        }.get(method)

    def methods(self) -> list[str]:
        return [m for _, m, phase in self.log if phase == "start"]


class On:
    """One replica's `ReplicaControl` methods, as the Recorder's (each takes the replica id)."""

    def __init__(self, calls: Recorder, replica_id: str):
        self.calls, self.replica_id = calls, replica_id

    def __getattr__(self, method: str):
        return functools.partial(getattr(self.calls, method), self.replica_id)


def run(coro):
    return asyncio.run(coro)


async def full_update(plane: ControlPlane, version: int) -> int:
    update_id = await plane.begin_update(version, SPECS)
    await plane.load_bucket(update_id, b"bucket")
    return await plane.commit_update(update_id)


def test_update_pauses_applies_everywhere_and_resumes():
    table, calls = Table("r1", "r2"), Recorder()
    plane = ControlPlane(table, calls)
    assert run(full_update(plane, 3)) == 3
    assert (
        calls.methods()
        == ["pause"] * 2
        + ["begin_weight_update"] * 2
        + ["load_weight_bucket"] * 2
        + ["finish_weight_update"] * 2
        + ["resume"] * 2
    )
    assert plane.state()["weight_version"] == 3 and plane.paused_mode is None
    assert {r.weight_version for r in table.policy.replicas.values()} == {3}


def test_an_update_under_an_explicit_pause_leaves_the_cluster_paused():
    table, calls = Table("r1"), Recorder()
    plane = ControlPlane(table, calls)

    async def go():
        await plane.pause("retract")
        await full_update(plane, 1)

    run(go())
    assert "resume" not in calls.methods() and plane.paused_mode == "retract"
    assert plane.state() == {"paused": True, "mode": "retract", "weight_version": 1}


def test_pause_resume_and_update_steps_never_interleave():
    calls = Recorder()
    plane = ControlPlane(Table("r1", "r2"), calls)

    async def go():
        calls.gates["pause"] = asyncio.Event()
        pausing = asyncio.create_task(plane.pause("wait"))
        resuming = asyncio.create_task(plane.resume())
        begin = asyncio.create_task(plane.begin_update(1, SPECS))
        await asyncio.sleep(0.01)
        assert calls.methods() == ["pause", "pause"]  # the others wait for the lock
        calls.gates["pause"].set()
        await asyncio.gather(pausing, resuming, begin)

    run(go())
    ends = [m for _, m, phase in calls.log if phase == "end"]
    starts = calls.methods()
    assert starts == ends  # each broadcast finished before the next began
    assert starts == ["pause"] * 2 + ["resume"] * 2 + ["pause"] * 2 + ["begin_weight_update"] * 2


def test_bad_manifest_anywhere_fails_the_update_and_undoes_its_pause():
    table, calls = Table("r1", "r2"), Recorder()
    calls.fail[("r2", "begin_weight_update")] = ValueError("tensors: 'a.weight' has shape ...")
    plane = ControlPlane(table, calls)
    with pytest.raises(ValueError, match="a.weight"):
        run(plane.begin_update(1, SPECS))
    assert calls.methods()[-2:] == ["resume", "resume"] and plane.paused_mode is None
    assert plane.state()["weight_version"] == 0 and not table.failures  # a bad input, not a failure
    with pytest.raises(UpdateNotFound):
        run(plane.load_bucket("upd-anything", b""))


@pytest.mark.parametrize(
    "specs, message",
    [
        ([], "non-empty"),
        ([{"name": "a", "shape": [2]}], "name"),
        ([SPECS[0], SPECS[0]], "more than once"),
        ([{"name": "a", "shape": [2], "dtype": "int8"}], "dtype"),
    ],
)
def test_malformed_manifest_is_refused_before_any_call(specs, message):
    calls = Recorder()
    with pytest.raises(ValueError, match=message):
        run(ControlPlane(Table("r1"), calls).begin_update(1, specs))
    assert calls.log == []


def test_versions_must_grow():
    calls = Recorder()
    plane = ControlPlane(Table("r1"), calls)
    run(full_update(plane, 5))
    for version in (5, 4, True):
        with pytest.raises(ValueError, match="version"):
            run(plane.begin_update(version, SPECS))


def test_a_replica_failing_mid_update_leaves_it_at_the_old_version():
    table, calls = Table("r1", "r2"), Recorder()
    calls.fail[("r2", "load_weight_bucket")] = RuntimeError("replica died")
    plane = ControlPlane(table, calls)
    assert run(full_update(plane, 1)) == 1
    assert table.failures == ["r2"]
    finished = [r for r, m, phase in calls.log if m == "finish_weight_update" and phase == "end"]
    assert finished == ["r1"]
    versions = {r.replica_id: r.weight_version for r in table.policy.replicas.values()}
    assert versions == {"r1": 1, "r2": 0}
    table.policy.set_healthy("r2", True)  # it heartbeats again: still not routed to
    assert [r.replica_id for r in table.policy.routable()] == ["r1"]


def test_every_replica_failing_is_an_error():
    calls = Recorder()
    plane = ControlPlane(Table("r1", "r2"), calls)
    for rid in ("r1", "r2"):
        calls.fail[(rid, "pause")] = RuntimeError("down")
    with pytest.raises(ReplicasFailed, match="pause failed on every engine replica"):
        run(plane.pause("keep"))
    with pytest.raises(ReplicasFailed, match="no engine replica is ready"):
        run(ControlPlane(Table(), calls).pause("keep"))


def test_commit_needs_every_tensor_and_is_idempotent():
    calls = Recorder()
    plane = ControlPlane(Table("r1"), calls)

    async def go():
        update_id = await plane.begin_update(
            1, SPECS + [{"name": "c.weight", "shape": [1], "dtype": "float32"}]
        )
        await plane.load_bucket(update_id, b"two tensors")
        with pytest.raises(ValueError, match="only 2 of the update's 3 tensors"):
            await plane.commit_update(update_id)
        with pytest.raises(ControlConflict, match="half loaded"):
            await plane.resume()
        await plane.load_bucket(update_id, b"two more")
        assert await plane.commit_update(update_id) == 1
        assert await plane.commit_update(update_id) == 1  # a retried commit
        assert calls.methods().count("finish_weight_update") == 1

    run(go())


def test_resume_drops_an_update_with_nothing_loaded():
    calls = Recorder()
    plane = ControlPlane(Table("r1"), calls)

    async def go():
        update_id = await plane.begin_update(1, SPECS)
        await plane.resume()
        with pytest.raises(UpdateNotFound):
            await plane.load_bucket(update_id, b"")

    run(go())
    assert plane.paused_mode is None and plane.state()["weight_version"] == 0


def test_a_newer_begin_replaces_an_open_update():
    calls = Recorder()
    plane = ControlPlane(Table("r1"), calls)

    async def go():
        first = await plane.begin_update(1, SPECS)
        second = await plane.begin_update(2, SPECS)
        with pytest.raises(UpdateNotFound):
            await plane.load_bucket(first, b"")
        await plane.load_bucket(second, b"")
        return await plane.commit_update(second)

    assert run(go()) == 2
    assert calls.methods().count("pause") == 1 and calls.methods()[-1] == "resume"


def test_labels_sit_beside_the_integer_which_every_commit_increments():
    """A trainer protocol's label ("step-42") is kept for the version its commit made; the
    integer grows by one however the labels read (the same label twice: two versions)."""
    calls = Recorder()
    plane = ControlPlane(Table("r1"), calls)

    async def go():
        await plane.begin_update(None, SPECS, "step-42")
        await plane.load_bucket(None, b"")
        assert await plane.commit_update(None) == 1  # the begin's label
        await plane.begin_update(None, None)
        assert await plane.commit_update(None, None, "v2") == 2  # the commit's label
        assert await plane.set_weight_version(None, "v2") == 3
        assert await plane.set_weight_version(None) == 4  # unlabelled
        return [await plane.weight_label(v) for v in range(5)]

    assert run(go()) == [None, "step-42", "v2", "v2", None]
    assert plane.state() == {"paused": False, "weight_version": 4}
    run(plane.set_weight_version(None, "7"))
    assert plane.state() == {"paused": False, "weight_version": 5, "weight_label": "7"}
    assert run(plane.weight_label()) == "7"
    with pytest.raises(ValueError, match="label"):
        run(plane.set_weight_version(None, 8))  # the HTTP edge turns peers' ints into text


def test_a_commit_that_fails_everywhere_leaves_no_label():
    """Version 1 is still free after it: a later commit to it must not inherit the label."""
    calls, table = Recorder(), Table("r1")
    plane = ControlPlane(table, calls)
    calls.fail[("r1", "finish_weight_update")] = RuntimeError("replica died")
    with pytest.raises(ReplicasFailed):
        run(plane.set_weight_version(None, "lost"))
    calls.fail.clear()
    table.policy.set_healthy("r1", True)  # it heartbeats again
    assert run(plane.set_weight_version(None)) == 1
    assert run(plane.weight_label(1)) is None and "weight_label" not in plane.state()


def test_abort_broadcasts_and_gathers_outputs():
    calls = Recorder()
    plane = ControlPlane(Table("r1", "r2"), calls)
    assert sorted(run(plane.abort(["x"]))) == ["out-r1", "out-r2"]
    assert run(ControlPlane(Table(), calls).abort(["x"])) == []


def test_bad_pause_mode_is_refused():
    calls = Recorder()
    with pytest.raises(ValueError, match="mode"):
        run(ControlPlane(Table("r1"), calls).pause("sleep"))
    assert calls.log == []


# --- routing by weight version -----------------------------------------------------------------


def test_routing_skips_replicas_behind_the_cluster_version():
    policy = RoutingPolicy()
    for rid in ("a", "b", "c"):
        policy.add(rid)
    policy.set_version("a", 2)
    policy.set_version("b", 1)  # missed the update
    # "c" never said its version (an old heartbeat): treated as current
    assert policy.weight_version == 2
    assert {policy.choose() for _ in range(6)} == {"a", "c"}
    assert all(policy.choose(f"k{i}") in {"a", "c"} for i in range(50))
    policy.set_version("a", 1)  # an older report (sent before the update finished): ignored
    assert policy.replicas["a"].weight_version == 2
    policy.remove("a")  # the only replica at 2 is gone: the cluster is at 1
    assert policy.weight_version == 1 and {policy.choose() for _ in range(4)} == {"b", "c"}
