"""The Router actor killed mid-conversation (Ray restarts it): with sessions written through to
PostgreSQL, the next turn of the session succeeds and the merged trajectory — tokens, loss mask,
logprobs, routed experts — equals that of a session that ran the same turns uninterrupted
(tiny Qwen3-MoE, greedy, one engine replica on a local Ray cluster)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from raylane.router.names import NAMESPACE, ROUTER_NAME

from tests.ray.conftest import free_port, wait_for

MODEL = "tiny-moe"
ENGINE = {
    "num_kv_blocks": 128,
    "max_num_seqs": 8,
    "max_model_len": 1024,
    "enable_return_routed_experts": True,
}
TURNS = ["Weather in Berlin?", "And tomorrow?", "Thanks. Anything else?"]


@pytest.fixture(scope="module")
def served(ray_cluster, pg_dsn, tiny_moe_dir):
    from raylane import launch
    from raylane.config import ClusterConfig

    config = ClusterConfig(
        model=tiny_moe_dir,
        served_model_name=MODEL,
        replicas=1,
        port=free_port(),
        torch_threads=1,
        engine=ENGINE,
        sessions_dsn=pg_dsn,
    )
    yield launch.deploy(config)  # stopped after the module, with the Router (ray_cluster)


class Conversation:
    def __init__(self, url: str) -> None:
        self.url = url
        resp = httpx.post(f"{url}/sessions", json={"metadata": {"run": 1}}, timeout=30)
        assert resp.status_code == 200, resp.text
        self.id = resp.json()["session_id"]
        self.messages: list[dict] = []

    def turn(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        resp = httpx.post(
            f"{self.url}/sessions/{self.id}/v1/chat/completions",
            timeout=60,
            json={"model": MODEL, "messages": self.messages, "temperature": 0, "max_tokens": 6},
        )
        assert resp.status_code == 200, resp.text
        self.messages.append(resp.json()["choices"][0]["message"])

    def sample(self) -> dict:
        resp = httpx.post(f"{self.url}/sessions/{self.id}/samples", timeout=30)
        assert resp.status_code == 200, resp.text
        return resp.json()


def router_pid(ray) -> int:
    from ray._private.state import actors

    (pid,) = [
        a["Pid"] for a in actors().values() if a["Name"] == ROUTER_NAME and a["State"] == "ALIVE"
    ]
    return pid


def router_ready(ray, router) -> bool:
    try:
        return bool(ray.get(router.ready.remote(), timeout=30))
    except ray.exceptions.ActorUnavailableError:  # still restarting
        return False


def restart_router(ray, url: str, session_id: str) -> None:
    """Kill the Router (Ray restarts it: max_restarts=-1) and wait until it serves again;
    meanwhile a request gets its answer or a 503, never a 500."""
    before = router_pid(ray)
    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    ray.kill(router, no_restart=False)
    during = httpx.get(f"{url}/sessions/{session_id}", timeout=60)
    assert during.status_code in (200, 503), during.text
    wait_for(lambda: router_ready(ray, router), 90, "the Router back")
    assert router_pid(ray) != before  # a new process: nothing of the old one's memory


def test_a_session_survives_a_router_restart(served):
    import ray

    url = served
    interrupted = Conversation(url)
    interrupted.turn(TURNS[0])
    restart_router(ray, url, interrupted.id)
    for text in TURNS[1:]:
        interrupted.turn(text)

    reference = Conversation(url)
    for text in TURNS:
        reference.turn(text)
    got, want = interrupted.sample(), reference.sample()
    assert got["tokens"] == want["tokens"] and got["loss_mask"] == want["loss_mask"]
    assert got["weight_versions"] == want["weight_versions"] and got["status"] == want["status"]
    np.testing.assert_allclose(got["rollout_logprobs"], want["rollout_logprobs"], atol=1e-4)
    assert got["routed_experts"] == want["routed_experts"]
    assert interrupted.messages[1::2] == reference.messages[1::2]
