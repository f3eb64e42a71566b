"""The control plane on a local Ray cluster: two Serve engine replicas, updated over the admin
routes through the Router (bucket bytes put once in the object store, the Router forwarding the
refs), in one transaction; a failed update changes no replica. The trainer protocols' routes
reach the same control plane through the Router.

Reference: Hugging Face `generate` on the weights sent (seeded noise on the checkpoint).
"""

from __future__ import annotations

import httpx
import pytest
import torch
from raylane.actors.models.weights import encode_bucket, iter_buckets, specs_of
from raylane.router.names import NAMESPACE, ROUTER_NAME

from tests.hf_reference import hf_greedy, perturbed_model
from tests.ray.conftest import free_port, keys_owned, wait_healthy
from tests.ray.replica_helpers import counts_after, routed_counts

ADMIN_KEY = "admin-ray"
PROMPTS = [[5, 17, 42, 99, 7, 150, 33], [9, 8, 7, 6, 5, 4], [100, 200, 300, 12]]


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_llama_dir):
    """(base URL, Router handle) of two tiny-Llama replicas with the admin routes on."""
    from raylane import launch
    from raylane.config import ClusterConfig

    config = ClusterConfig(
        model=tiny_llama_dir,
        served_model_name="tiny",
        replicas=2,
        port=free_port(),
        torch_threads=1,
        admin_api_key=ADMIN_KEY,
        trainer_api=True,
        engine={"num_kv_blocks": 128, "max_model_len": 256},
    )
    url = launch.deploy(config)
    yield url, ray_cluster.get_actor(ROUTER_NAME, namespace=NAMESPACE)


@pytest.fixture(scope="module")
def perturbed(tiny_llama_dir, tmp_path_factory) -> tuple[str, list]:
    return perturbed_model(tiny_llama_dir, str(tmp_path_factory.mktemp("tiny_llama_ray_v1")), 5)


@pytest.fixture
def admin(cluster):
    url, _ = cluster
    with httpx.Client(
        base_url=url, timeout=120, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ) as client:
        yield client


def call(router, method: str, *args):
    import ray

    return ray.get(getattr(router, method).remote(*args))


def replica_versions(router) -> dict[str, int]:
    return {r["replica_id"]: r["weight_version"] for r in call(router, "replicas") if r["healthy"]}


def greedy(url: str, prompt: list[int], key: str) -> dict:
    response = httpx.post(
        f"{url}/generate",
        timeout=120,
        headers={"x-routing-key": key},
        json={
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        },
    )
    assert response.status_code == 200, response.text
    return response.json()


def begin(admin: httpx.Client, named: list, version: int) -> httpx.Response:
    return admin.post(
        "/admin/update_weights/begin",
        json={"version": version, "tensors": [s.to_dict() for s in specs_of(named)]},
    )


def test_an_update_reaches_both_replicas_at_one_version(
    cluster, admin, perturbed, tiny_llama_dir, ray_cluster
):
    url, router = cluster
    v1_dir, v1 = perturbed
    assert set(replica_versions(router).values()) == {0} and len(replica_versions(router)) == 2
    update_id = begin(admin, v1, 1).json()["update_id"]
    for bucket in iter_buckets(v1, 50_000):
        response = admin.post(
            f"/admin/update_weights/{update_id}/bucket", content=encode_bucket(bucket)
        )
        assert response.json() == {"tensors": len(bucket)}, response.text
    assert admin.post(f"/admin/update_weights/{update_id}/commit").json() == {"weight_version": 1}
    assert set(replica_versions(router).values()) == {1}
    ids = wait_healthy(ray_cluster, 2)
    keys = keys_owned(ids, 4)  # spread over both replicas by key
    before = routed_counts(ray_cluster)
    outs = [greedy(url, PROMPTS[i % len(PROMPTS)], key) for i, key in enumerate(keys)]
    after = counts_after(ray_cluster, before, len(keys))
    routed = {rid: after[rid] - before[rid] for rid in after}
    assert routed == dict.fromkeys(ids, 4), routed
    for i, out in enumerate(outs):  # the references after: they starve the replicas meanwhile
        assert out["output_ids"] == hf_greedy(v1_dir, PROMPTS[i % len(PROMPTS)], 8)[0]
        assert out["meta_info"]["weight_versions"] == [1] * 8
    assert admin.get("/admin/weight_version").json() == {"weight_version": 1}
    assert "raylane:weight_version" in httpx.get(f"{url}/metrics", timeout=30).text


def test_a_failed_update_leaves_every_replica_as_it_was(cluster, admin, perturbed):
    url, router = cluster
    v1_dir, v1 = perturbed
    version = admin.get("/admin/weight_version").json()["weight_version"]
    before = [greedy(url, p, key=f"b{i}")["output_ids"] for i, p in enumerate(PROMPTS)]
    name, tensor = v1[1]
    wrong = [*v1[:1], (name, torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:])), *v1[2:]]
    response = begin(admin, wrong, version + 1)
    assert response.status_code == 400, response.text
    assert set(replica_versions(router).values()) == {version}
    after = [greedy(url, p, key=f"b{i}")["output_ids"] for i, p in enumerate(PROMPTS)]
    assert after == before  # and not paused: the failed begin resumed what it paused
    assert call(router, "control", "control_state")["paused"] is False


def test_pause_abort_and_resume_across_replicas(cluster, admin):
    url, _ = cluster
    body = {
        "input_ids": PROMPTS[0],
        "rid": "long-one",
        "stream": True,
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0},
    }
    aborted = {}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        pause = admin.post("/admin/pause", json={"mode": "keep"}).json()
        assert pause["paused"] is True and pause["mode"] == "keep"
        aborted = admin.post("/admin/abort", json={"request_ids": ["long-one"]}).json()
        rest = [line for line in lines if line.startswith("data: {")]
    [item] = aborted["outputs"]
    assert item["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(item["output_ids"]) < 200
    assert '"abort"' in rest[-1]
    assert admin.post("/admin/resume").json()["paused"] is False
    assert len(greedy(url, PROMPTS[1], key="after")["output_ids"]) == 8


def test_trainer_routes_reach_every_replica_through_the_router(cluster, admin):
    url, router = cluster
    anyone = httpx.Client(base_url=url, timeout=120)
    assert anyone.get("/get_world_size").json() == {"world_size": 2}  # replicas x TP
    info = anyone.get("/server_info").json()
    assert (info["dp_size"], info["tp_size"]) == (2, 1)
    assert anyone.get("/v1/loads").json()["dp_rank_count"] == 2
    assert anyone.post("/pause", params={"mode": "keep"}).status_code == 401  # the admin key
    version = int(anyone.get("/weight_info").json()["weight_version"])
    assert admin.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert anyone.get("/is_paused").json() == {"is_paused": True}
    # a label travels through the Router beside raylane's integer, which grows by one
    answer = admin.post("/update_weight_version", json={"new_version": "step-ray"})
    assert answer.json()["new_version"] == "step-ray", answer.text
    assert set(replica_versions(router).values()) == {version + 1}
    assert admin.post("/abort_requests", json={}).json()["status"] == "aborted"
    assert admin.post("/resume").json() == {"status": "resumed"}
    assert anyone.get("/is_paused").json() == {"is_paused": False}
    assert anyone.get("/get_weight_version").json() == {"weight_version": "step-ray"}
    assert greedy(url, PROMPTS[0], key="label")["meta_info"]["weight_version"] == "step-ray"
    own = admin.get("/admin/weight_version").json()
    assert own == {"weight_version": version + 1, "weight_label": "step-ray"}
    # the generic replica calls: both replicas hash the same weights; sleep reaches both
    checksums = admin.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
    assert "lm_head.weight" in checksums
    assert admin.post("/sleep", params={"level": 2}).status_code == 200
    assert anyone.get("/is_sleeping").json() == {"is_sleeping": True}
    assert admin.post("/wake_up").status_code == 200
    assert anyone.get("/is_sleeping").json() == {"is_sleeping": False}
    assert len(greedy(url, PROMPTS[2], key="woken")["output_ids"]) == 8
    anyone.close()
