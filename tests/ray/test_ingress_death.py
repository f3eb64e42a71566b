"""An ingress that dies mid-request must leave no orphans: its requests stop counting against
the replica, or a full replica answers 429 forever, and stop running, or they burn its steps.

One replica with room for two requests, paused ("keep") so two streams are held there; the
ingress process is SIGKILLed. Ray does not end the dead caller's output channel, so the replica
closes it once its caller stops renewing it (CHANNEL_LEASE_S), and the held requests, resumed,
are aborted at admission instead of generating. This is `raylane serve`'s default path, where
the ingress replica holds the port itself: its replacement must get the port back.
"""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
from raylane.router.actor import NAMESPACE, ROUTER_NAME

from tests.ray.conftest import free_port, wait_for

INGRESS_CLASS = "ServeReplica:raylane:Ingress"


@pytest.fixture(scope="module")
def url(ray_cluster, tiny_llama_dir) -> str:
    from raylane import launch
    from raylane.config import ClusterConfig

    config = ClusterConfig(
        model=tiny_llama_dir,
        served_model_name="tiny",
        replicas=1,
        port=free_port(),
        torch_threads=1,
        max_queue_per_replica=2,
        engine={"num_kv_blocks": 128, "max_model_len": 256},
    )
    return launch.deploy(config)


def body(max_new: int) -> dict:
    return {
        "input_ids": [5, 6, 7, 8],
        "stream": max_new > 8,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }


def in_flight(ray) -> int:
    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    return sum(r["in_flight"] for r in ray.get(router.replicas.remote()))


def ingress_pids() -> list[int]:
    import ray

    return [
        a["Pid"]
        for a in ray._private.state.actors().values()
        if a["ActorClassName"] == INGRESS_CLASS and a["State"] == "ALIVE" and a.get("Pid")
    ]


def stream_until_broken(url: str) -> None:
    try:
        with httpx.stream("POST", f"{url}/generate", json=body(240), timeout=120) as response:
            for _ in response.iter_lines():
                pass
    except httpx.HTTPError:
        pass  # the ingress died under it


def generated_tokens(ray) -> int:
    from raylane.router.replica_set import REPLICA_PREFIX

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(REPLICA_PREFIX)
    ]
    stats = [ray.get(ray.get_actor(n, namespace=NAMESPACE).stats.remote()) for n in names]
    return sum(s["counters"]["generation_tokens"] for s in stats)


def test_an_ingress_that_dies_mid_request_leaves_no_orphans(url, ray_cluster):
    import time

    from raylane.actors.replica import CHANNEL_LEASE_S
    from raylane.router.replica_view import REFRESH_S

    ray = ray_cluster
    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    assert httpx.post(f"{url}/generate", json=body(4), timeout=60).status_code == 200
    ray.get(router.control.remote("pause", "keep"))
    streams = [threading.Thread(target=stream_until_broken, args=(url,)) for _ in range(2)]
    for t in streams:
        t.start()
    wait_for(lambda: in_flight(ray) == 2, 60, "two requests held")
    time.sleep(3 * REFRESH_S)  # the ingress's replica view refreshes on its own time
    assert httpx.post(f"{url}/generate", json=body(4), timeout=60).status_code == 429  # full
    before = generated_tokens(ray)
    (pid,) = ingress_pids()
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert b"Ingress" in f.read(), "not the ingress process"
    os.kill(pid, signal.SIGKILL)
    for t in streams:
        t.join(timeout=120)
    time.sleep(CHANNEL_LEASE_S + 3)  # the replica notices the dead caller's channel lapse
    ray.get(router.control.remote("resume"))

    def serves() -> bool:
        try:
            return httpx.post(f"{url}/generate", json=body(4), timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(serves, 120, "the endpoint to serve again after the ingress died")
    wait_for(lambda: in_flight(ray) == 0, 30, "the replica to let the orphans go")
    # the orphans were aborted, not run: far fewer tokens than one 240-token request
    assert generated_tokens(ray) - before < 240
