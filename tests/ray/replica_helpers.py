"""The engine replicas the Router owns, as the Ray tests look at them."""

from __future__ import annotations

import pytest

from tests.ray.conftest import wait_for


def routed_counts(ray) -> dict[str, int]:
    """Requests each healthy replica admitted, as its heartbeats report them to the Router."""
    from raylane.router.names import NAMESPACE, ROUTER_NAME

    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    return {r["replica_id"]: r["routed"] for r in ray.get(router.replicas.remote()) if r["healthy"]}


def counts_after(ray, before: dict[str, int], sent: int) -> dict[str, int]:
    """`routed_counts` once the replicas' heartbeats (every second) carry `sent` more."""
    wait_for(
        lambda: sum(routed_counts(ray).values()) - sum(before.values()) >= sent,
        30,
        f"the replicas to report {sent} more requests",
    )
    return routed_counts(ray)


def replica_actor(ray, replica_id: str):
    """The engine replica's actor (the Router names each after its id)."""
    from raylane.router.actor import NAMESPACE
    from raylane.router.replica_set import REPLICA_PREFIX

    try:
        return ray.get_actor(REPLICA_PREFIX + replica_id, namespace=NAMESPACE)
    except ValueError:
        pytest.fail(f"no actor for replica {replica_id}")
