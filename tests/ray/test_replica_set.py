"""The engine replicas the Router owns, across redeploys and a shutdown: a redeploy with the same
engine keeps its replicas (scaling only), one whose engine options changed replaces them all,
and shutting the cluster's apps down leaves no replica actor behind (they are detached)."""

from __future__ import annotations

import dataclasses

import httpx
from raylane.router.replica_set import REPLICA_PREFIX

from tests.ray.conftest import free_port, wait_for, wait_healthy


def replica_names(ray) -> set[str]:
    return {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(REPLICA_PREFIX)
    }


def redeploy(config) -> None:
    """What a RayService does with a new config: run the app built from it in place."""
    from ray import serve
    from raylane.launch import APP_NAME
    from raylane.serve import build_application

    serve.run(build_application(config), name=APP_NAME, route_prefix="/", blocking=False)


def completes(url: str) -> bool:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    try:
        return httpx.post(f"{url}/generate", json=body, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def test_redeploys_keep_or_replace_replicas_and_shutdown_leaves_none(ray_cluster, tiny_llama_dir):
    from raylane import launch
    from raylane.config import ClusterConfig

    from tests.support import ray_cluster as shared_ray

    ray = ray_cluster
    config = ClusterConfig(
        model=tiny_llama_dir,
        served_model_name="tiny",
        replicas=2,
        port=free_port(),
        torch_threads=1,
        engine={"num_kv_blocks": 128, "max_model_len": 256},
    )
    url = launch.deploy(config)
    config = config.resolved()  # as deployed (the ingress answers on the port itself)
    first = set(wait_healthy(ray, 2))
    assert {REPLICA_PREFIX + rid for rid in first} == replica_names(ray)

    # the same engine, one replica fewer: one of the running two stays, nothing new starts
    redeploy(dataclasses.replace(config, replicas=1))
    wait_for(lambda: len(replica_names(ray)) == 1, 60, "the scale-down to one replica")
    (kept,) = wait_healthy(ray, 1)
    assert kept in first

    # another engine option: every replica is replaced by one of the new engine
    redeploy(dataclasses.replace(config, replicas=1, engine={**config.engine, "max_num_seqs": 8}))
    wait_for(
        lambda: (names := replica_names(ray)) and REPLICA_PREFIX + kept not in names,
        120,
        "the replica of the old engine to be replaced",
    )
    (new,) = wait_healthy(ray, 1)
    assert new != kept and new.split("-")[0] != kept.split("-")[0]  # another spec key
    wait_for(lambda: completes(url), 60, "the redeployed app to serve")

    shared_ray.stop_apps()  # launch.shutdown, Ray itself left up
    assert replica_names(ray) == set()
