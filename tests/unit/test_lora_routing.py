"""Routing keeps an adapter's requests where the adapter is held, when that costs nothing: among
the least loaded replicas one holding the request's adapter in a slot (as its heartbeat said)
goes first; load and routing keys still decide first. Plain Python: the Router's class and a
`ReplicaView` fed its table, no Ray."""

from __future__ import annotations

import asyncio

from raylane.router.actor import Router
from raylane.router.policy import RoutingPolicy
from raylane.router.replica_view import ReplicaView


def policy_with(adapters: dict[str, list[str]]) -> RoutingPolicy:
    policy = RoutingPolicy(capacity=8)
    for rid, names in adapters.items():
        policy.add(rid)
        policy.replicas[rid].adapters = frozenset(names)
    return policy


def test_equally_loaded_the_replica_holding_the_adapter_wins():
    policy = policy_with({"r1": [], "r2": ["a"], "r3": ["b"]})
    assert {policy.choose(lora="a") for _ in range(6)} == {"r2"}
    assert {policy.choose(lora="b") for _ in range(6)} == {"r3"}
    # no replica holds it, or the base model: rotate among all the equals, as before
    assert {policy.choose(lora="c") for _ in range(6)} == {"r1", "r2", "r3"}
    assert {policy.choose() for _ in range(6)} == {"r1", "r2", "r3"}


def test_load_and_routing_keys_come_first():
    policy = policy_with({"r1": [], "r2": ["a"]})
    policy.started("r2")  # r2 busier: the adapter does not outweigh a request in flight
    assert policy.choose(lora="a") == "r1"
    owner = policy.choose(routing_key="session-7")
    assert policy.choose(routing_key="session-7", lora="a") == owner


def test_the_heartbeat_carries_the_adapters_to_every_view():
    router = Router(capacity=8)  # the plain class: Ray wraps it only when it is started
    for rid in ("r1", "r2"):
        router.replica_set.handles[rid] = f"{rid}'s handle"
        router.register(rid)
    router.heartbeat("r2", 0, held=0, admitted=0, held_on={}, adapters=["a"])

    async def fetch(known):
        return await router.table(None, known)

    async def main() -> set[str | None]:
        view = ReplicaView(fetch, 8, router.report_failure, refresh_s=3600)
        picks = set()
        for _ in range(4):
            picks.add(rid := await view.choose(lora="a"))
            view.done(rid)
        return picks

    assert asyncio.run(main()) == {"r2"}
    assert {r["replica_id"]: r["adapters"] for r in router.replicas()} == {"r1": [], "r2": ["a"]}
