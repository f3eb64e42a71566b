"""The engine replicas the Router owns, as the Ray tests look at them."""

from __future__ import annotations

import pytest

from tests.ray.conftest import free_port, wait_for


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


def deploy_lora_cluster(model_dir: str, replicas: int, admin_key: str, modules: dict) -> str:
    """A cluster of `replicas` tiny engine replicas with LoRA on, each loading `modules`
    ({name: path}) before it serves; returns its URL."""
    from raylane import launch
    from raylane.config import ClusterConfig

    config = ClusterConfig(
        model=model_dir,
        served_model_name="tiny",
        replicas=replicas,
        port=free_port(),
        torch_threads=1,
        admin_api_key=admin_key,
        engine={"num_kv_blocks": 128, "max_model_len": 256, "enable_lora": True},
        lora_modules=tuple({"name": name, "path": path} for name, path in modules.items()),
    )
    return launch.deploy(config)
