"""The routing policy without Ray: stickiness, spread, health and capacity."""

from __future__ import annotations

from collections import Counter

from raylane.router.policy import RoutingPolicy


def policy_with(*ids: str, capacity: int = 8) -> RoutingPolicy:
    policy = RoutingPolicy(capacity=capacity)
    for rid in ids:
        policy.add(rid)
    return policy


def test_keyed_requests_stick_to_one_replica():
    policy = policy_with("a", "b", "c")
    for key in (f"session-{i}" for i in range(50)):
        first = policy.choose(key)
        assert all(policy.choose(key) == first for _ in range(5))


def test_adding_a_replica_moves_few_keys():
    keys = [f"k{i}" for i in range(2000)]
    policy = policy_with("a", "b", "c", "d")
    before = {k: policy.choose(k) for k in keys}
    policy.add("e")
    after = {k: policy.choose(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "e" for k in moved)  # keys only move to the new replica
    assert 0.1 < len(moved) / len(keys) < 0.35  # about 1/5, far from a full reshuffle


def test_keys_spread_over_replicas():
    policy = policy_with("a", "b")
    owners = Counter(policy.choose(f"user-{i}") for i in range(1000))
    assert set(owners) == {"a", "b"} and min(owners.values()) > 300


def test_unkeyed_requests_go_least_loaded_and_rotate_on_ties():
    policy = policy_with("a", "b")
    picks = [policy.choose() for _ in range(4)]
    assert Counter(picks) == Counter({"a": 2, "b": 2})
    policy.started("a")
    policy.started("a")
    assert policy.choose() == "b"


def test_unhealthy_replica_is_skipped_until_it_recovers():
    policy = policy_with("a", "b")
    key = next(k for k in (f"s{i}" for i in range(100)) if policy.choose(k) == "a")
    policy.set_healthy("a", False)
    assert policy.choose(key) == "b"
    assert {policy.choose() for _ in range(6)} == {"b"}
    policy.set_healthy("a", True)
    assert policy.choose(key) == "a"


def test_full_replicas_refuse_instead_of_queueing():
    policy = policy_with("a", "b", capacity=2)
    for _ in range(4):
        rid = policy.choose()
        policy.started(rid)
    assert policy.choose() is None
    policy.finished("b")
    assert policy.choose() == "b"


def test_no_replica_means_no_choice():
    policy = RoutingPolicy()
    assert policy.choose() is None and policy.choose("key") is None


def test_a_report_counts_the_others_requests_and_this_process_counts_its_own():
    policy = policy_with("a", capacity=3)
    policy.started(policy.choose())  # this process's request
    policy.replicas["a"].report(3, own_held=1)  # the replica holds it and 2 of others
    assert policy.replicas["a"].in_flight == 3 and policy.choose() is None
    policy.finished("a")  # ours ends: its slot frees at once, not at the next heartbeat
    assert policy.replicas["a"].in_flight == 2 and policy.choose() == "a"
    policy.replicas["a"].report(0)  # the others' ended too
    policy.finished("a")  # a done with nothing of ours in flight: never below zero
    assert policy.replicas["a"].in_flight == 0


def test_a_view_takes_the_count_from_the_routers_heartbeats():
    import asyncio

    from raylane.router.actor import Router
    from raylane.router.replica_view import ReplicaView

    router = Router(capacity=1)  # the plain class: Ray wraps it only when it is started
    router.replica_set.handles["r1"] = "r1's handle"  # as if it had started r1
    router.register("r1")

    fetched = []  # the table rows each refresh received

    async def fetch(known):
        fetched.append(await router.table(None, known))
        return fetched[-1]

    async def main():
        view = ReplicaView(fetch, 1, router.report_failure, refresh_s=3600)  # by hand below
        assert await view.choose() == "r1" and view.handle("r1") == "r1's handle"
        assert await view.choose() is None  # full with this process's request
        view.done("r1")
        assert await view.choose() == "r1"  # its slot frees at once
        view.done("r1")
        router.heartbeat("r1", 0, held=1)  # another process's request
        view.apply(await router.table())
        assert await view.choose() is None
        view.apply(await router.table())  # the same heartbeat again: counts stay
        assert await view.choose() is None
        router.heartbeat("r1", 0, held=0)  # it ended
        view.apply(await router.table())
        assert await view.choose() == "r1"
        view.done("r1")
        # a refresh ships only the handles the view lacks: r1's came with the first table
        router.replica_set.handles["r2"] = "r2's handle"
        router.register("r2")
        await view._refresh()
        assert [r["handle"] for r in fetched[0]] == ["r1's handle"]
        assert {r["replica_id"]: r["handle"] for r in fetched[-1]} == {
            "r1": None,
            "r2": "r2's handle",
        }
        assert view.handle("r1") == "r1's handle" and view.handle("r2") == "r2's handle"
        picks = {await view.choose(), await view.choose()}
        assert picks == {"r1", "r2"}  # both routable, each with its own handle

    asyncio.run(main())


def test_a_heartbeat_sent_while_this_process_ran_a_request_forgets_it_once_it_ended():
    """The race that sent sequential requests all to one replica: the replica's heartbeat
    counts the request, it finishes, then the view applies that heartbeat. The request held on
    this process's own channel is this process's count, not the report's."""
    import asyncio

    from raylane.router.actor import Router
    from raylane.router.replica_view import ReplicaView

    router = Router(capacity=4)
    for rid in ("r1", "r2"):
        router.replica_set.handles[rid] = f"{rid}'s handle"
        router.register(rid)

    async def main():
        view = ReplicaView(
            lambda known: router.table(None, known), 4, router.report_failure, refresh_s=3600
        )
        view.channel_of = {"r1": "mine-r1", "r2": "mine-r2"}.get
        first = await view.choose()
        other = "r2" if first == "r1" else "r1"
        # its heartbeat while the request runs: one held, on this process's channel, and
        # one of another process's on a channel of its own
        router.heartbeat(first, 0, held=2, held_on={f"mine-{first}": 1, "theirs": 1})
        view.done(first)
        view.apply(await router.table())
        assert view.policy.replicas[first].in_flight == 1  # only the other process's
        router.heartbeat(first, 0, held=1, held_on={"theirs": 1})
        router.heartbeat(other, 0, held=0)
        view.apply(await router.table())
        assert await view.choose() == other  # least loaded: the other process's request
        view.done(other)
        router.heartbeat(first, 0, held=0)
        view.apply(await router.table())
        # both idle now: two sequential requests go one to each
        picks = []
        for _ in range(2):
            picks.append(await view.choose())
            view.done(picks[-1])
        assert sorted(picks) == ["r1", "r2"]

    asyncio.run(main())
