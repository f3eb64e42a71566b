"""LoRA adapters on a local Ray cluster: two engine replicas started with `lora_modules` (each
loads the adapter at start), requests on the adapter spread over both by routing key; an
adapter-only update (`RolloutClient.update_lora`, over HTTP and in the cluster) is one
transaction: every replica reaches the new version together and serves PEFT's outputs for the
new adapter; a mismatched update changes no replica. Reference: PEFT's `PeftModel`.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from safetensors.torch import load_file

from tests.lora_adapters import make_adapter, peft_greedy, peft_models
from tests.ray.conftest import keys_owned, wait_healthy
from tests.ray.replica_helpers import (
    counts_after,
    deploy_lora_cluster,
    replica_actor,
    routed_counts,
)

pytest.importorskip("peft")

ADMIN_KEY = "admin-lora-ray"
PROMPTS = [[5, 17, 42, 99, 7], [9, 8, 7, 6, 5, 4], [100, 200, 30, 12]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_ray")
    return {
        "v1": make_adapter(tiny_llama_dir, root / "v1", seed=21, r=4),
        "v2": make_adapter(tiny_llama_dir, root / "v2", seed=22, r=4),
        "other": make_adapter(tiny_llama_dir, root / "other", seed=23, r=8),
    }


@pytest.fixture(scope="module")
def peft(tiny_llama_dir, adapters):
    return peft_models(tiny_llama_dir, adapters)


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_llama_dir, adapters) -> str:
    modules = {"policy": adapters["v1"]}
    return deploy_lora_cluster(tiny_llama_dir, 2, ADMIN_KEY, modules)


def replica_adapters(ray, ids: list[str]) -> dict[str, dict]:
    """Replica id -> its "policy" adapter as the replica itself lists it."""
    return {
        rid: next(
            a for a in ray.get(replica_actor(ray, rid).list_loras.remote()) if a["name"] == "policy"
        )
        for rid in ids
    }


def greedy(url: str, prompt: list[int], key: str) -> list[int]:
    body = {
        "input_ids": prompt,
        "lora_path": "policy",
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    answer = httpx.post(f"{url}/generate", json=body, headers={"x-routing-key": key}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["output_ids"]


def outputs_on_both(ray, url: str, ids: list[str]) -> list[list[int]]:
    """Each prompt on each replica (routing keys owned by each), checked to land on both."""
    keys = keys_owned(ids, len(PROMPTS))
    before = routed_counts(ray)
    outs = [greedy(url, PROMPTS[i % len(PROMPTS)], key) for i, key in enumerate(keys)]
    after = counts_after(ray, before, len(keys))
    assert {rid: after[rid] - before[rid] for rid in ids} == dict.fromkeys(ids, len(PROMPTS))
    return outs


def expected(peft, adapter: str, ids: list[str]) -> list[list[int]]:
    per_prompt = [peft_greedy(peft, adapter, p, MAX_TOKENS)[0] for p in PROMPTS]
    return [per_prompt[i % len(PROMPTS)] for i in range(len(ids) * len(PROMPTS))]


def tensors(adapter_dir: str) -> list:
    return sorted(load_file(f"{adapter_dir}/adapter_model.safetensors").items())


def test_an_adapter_update_reaches_both_replicas_together(cluster, ray_cluster, adapters, peft):
    from raylane.client import RolloutClient

    url = cluster
    ids = wait_healthy(ray_cluster, 2)
    start = replica_adapters(ray_cluster, ids)
    assert {a["path"] for a in start.values()} == {adapters["v1"]}  # lora_modules, at start
    assert outputs_on_both(ray_cluster, url, ids) == expected(peft, "v1", ids)

    async def update(make, named) -> int:
        async with make() as client:
            return await client.update_lora("policy", named, version="step-1")

    version = asyncio.run(
        update(lambda: RolloutClient(url, admin_key=ADMIN_KEY), tensors(adapters["v2"]))
    )
    now = replica_adapters(ray_cluster, ids)
    assert {a["version"] for a in now.values()} == {version}
    assert {a["version_label"] for a in now.values()} == {"step-1"}
    assert outputs_on_both(ray_cluster, url, ids) == expected(peft, "v2", ids)
    # a rank-8 adapter's tensors do not fit "policy" (rank 4): refused on every replica
    with pytest.raises(ValueError):
        asyncio.run(update(RolloutClient.in_cluster, tensors(adapters["other"])))
    kept = ("path", "version", "version_label", "rank")
    after = replica_adapters(ray_cluster, ids)
    assert {rid: [a[k] for k in kept] for rid, a in after.items()} == {
        rid: [a[k] for k in kept] for rid, a in now.items()
    }
    assert outputs_on_both(ray_cluster, url, ids) == expected(peft, "v2", ids)

    async def in_cluster_greedy() -> list[int]:
        async with RolloutClient.in_cluster() as client:
            (out,) = await client.generate(
                PROMPTS[0], lora="policy", temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True
            )
            return list(out.token_ids)

    assert asyncio.run(in_cluster_greedy()) == expected(peft, "v2", ids)[0]
