"""The raylane Serve application on a free loopback port, deployed on the session's shared Ray
cluster (`ray_cluster`, tests/conftest.py), and helpers the Ray tests share."""

from __future__ import annotations

import pytest
from raylane.launch import free_port  # noqa: F401 - the tests import it from here


@pytest.fixture(scope="module")
def served(ray_cluster, tiny_llama_dir):
    """Two engine replicas of the tiny Llama behind the HTTP ingress; yields (url, config)."""
    from raylane import launch
    from raylane.config import ClusterConfig

    config = ClusterConfig(
        model=tiny_llama_dir,
        served_model_name="tiny",
        replicas=2,
        port=free_port(),
        torch_threads=1,
        engine={"num_kv_blocks": 256, "max_num_seqs": 32},
    )
    url = launch.deploy(config)
    yield url, config


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    """Poll `predicate` until it holds; fail the test, naming `what`, after `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


def wait_healthy(ray, count: int, timeout_s: float = 120.0) -> list[str]:
    """The ids of `count` healthy replicas, once the Router sees them all: on 2 cores, while the
    test driver computes a reference, a replica's heartbeats can lag long enough for the Router
    to skip it for a moment."""
    return _wait_replicas(ray, count, timeout_s, healthy_only=True)


def wait_registered(ray, count: int, timeout_s: float = 600.0) -> list[str]:
    """The ids of `count` replicas that started (loaded their engine and registered with the
    Router), healthy or not at this moment: for a test about where replicas run, not whether
    their heartbeats keep up on a loaded machine. The deadline is a safety net only."""
    return _wait_replicas(ray, count, timeout_s, healthy_only=False)


def _wait_replicas(ray, count: int, timeout_s: float, healthy_only: bool) -> list[str]:
    import time

    from raylane.router.actor import NAMESPACE, ROUTER_NAME

    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    deadline = time.monotonic() + timeout_s
    while True:
        rows = ray.get(router.replicas.remote())
        ids = sorted(r["replica_id"] for r in rows if r["healthy"] or not healthy_only)
        if len(ids) == count:
            return ids
        state = "healthy" if healthy_only else "registered"
        assert time.monotonic() < deadline, f"{len(ids)} of {count} replicas {state}"
        time.sleep(0.1)


def keys_owned(replica_ids: list[str], per_replica: int) -> list[str]:
    """Routing keys, `per_replica` owned by each replica in turn, by the Router's own hash ring
    (so a test spreads requests over replicas on purpose, not by luck)."""
    from raylane.router.policy import HashRing

    ring = HashRing()
    ring.rebuild(sorted(replica_ids))
    owned: dict[str, list[str]] = {rid: [] for rid in replica_ids}
    i = 0
    while min(map(len, owned.values())) < per_replica:
        key = f"key-{i}"
        owned[next(ring.walk(key))].append(key)
        i += 1
    return [owned[rid][k] for k in range(per_replica) for rid in replica_ids]


def streamed_and_whole_chat(client, content: str, max_tokens: int):
    """The same greedy chat through an `openai` client, streamed and not: (streamed text, the
    whole response)."""
    messages = [{"role": "user", "content": content}]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0
    )
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices), whole
