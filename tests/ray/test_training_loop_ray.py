"""A training loop against a local Ray cluster with two engine replicas: each round starts a
group of long greedy rollouts spread over both replicas, pauses mid-rollout in one mode, updates
the weights to a new version through `RolloutClient` (admin routes), resumes, and checks every
token against Hugging Face `generate` on the weights that produced it.

Rounds alternate between the checkpoint (v0 and even versions) and seeded noise on it (odd
versions), so every round is a real change of weights. References: HF greedy on each weight
set, saved as its own model; for "retract", HF greedy on prompt + the partial output under the
new weights (the KV was dropped, so the continuation is what fresh new weights give).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from raylane.client import RolloutClient
from raylane.router.actor import NAMESPACE, ROUTER_NAME

from tests.hf_reference import hf_greedy, hf_model, perturbed_model
from tests.ray.conftest import free_port, keys_owned, wait_for, wait_healthy

ADMIN_KEY = "admin-loop"
LONG = 160  # tokens: long enough to pause a group while it runs
PROMPTS = [[5 + (7 * i + 3 * j) % 240 for j in range(9 + 3 * i)] for i in range(4)]
CHECKED = 12  # tokens compared with HF on each side of the switch (HF runs are the slow part)


@pytest.fixture(scope="module")
def url(ray_cluster, tiny_llama_dir) -> str:
    from raylane import launch
    from raylane.config import ClusterConfig

    config = ClusterConfig(
        model=tiny_llama_dir,
        served_model_name="tiny",
        replicas=2,
        port=free_port(),
        torch_threads=1,
        admin_api_key=ADMIN_KEY,
        engine={"num_kv_blocks": 128, "max_model_len": 256},
    )
    return launch.deploy(config)


@pytest.fixture(scope="module")
def weight_sets(tiny_llama_dir, tmp_path_factory) -> list[tuple[str, list]]:
    """[(HF dir, named tensors)] for even and odd versions."""
    v0 = [(n, p.detach().clone()) for n, p in hf_model(tiny_llama_dir).named_parameters()]
    odd = perturbed_model(tiny_llama_dir, str(tmp_path_factory.mktemp("loop_odd")), 31)
    return [(tiny_llama_dir, v0), odd]


async def stream_rollout(
    http: httpx.AsyncClient,
    i: int,
    key: str,
    started: asyncio.Event,
) -> dict:
    """One streamed greedy /generate on its own routing key; its last item. `started` is
    set once three tokens are out."""
    body = {
        "input_ids": PROMPTS[i],
        "rid": f"loop-{i}-{id(started)}",
        "stream": True,
        "sampling_params": {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True},
    }
    last, seen = None, 0
    async with http.stream(
        "POST", "/generate", json=body, headers={"x-routing-key": key}
    ) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                last, seen = json.loads(line[len("data: ") :]), seen + 1
                if seen == 3:
                    started.set()
    started.set()
    return last


@pytest.fixture(scope="module")
def keys(url, ray_cluster) -> list[str]:
    """One routing key per prompt, alternating between the two replicas' own keys."""
    return keys_owned(wait_healthy(ray_cluster, 2), len(PROMPTS) // 2)


def replica_versions(ray_cluster) -> list[int]:
    router = ray_cluster.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    return [r["weight_version"] for r in ray_cluster.get(router.replicas.remote()) if r["healthy"]]


def routed_counts(ray_cluster) -> list[int]:
    router = ray_cluster.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    return [r["routed"] for r in ray_cluster.get(router.replicas.remote())]


async def run_round(
    url: str, client: RolloutClient, mode: str, named: list, version: int, keys: list[str]
) -> list[dict]:
    """Start the group, pause in `mode` once every rollout has tokens out, update to
    `version`, resume; the group's last items."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        started = [asyncio.Event() for _ in PROMPTS]
        group = [
            asyncio.ensure_future(stream_rollout(http, i, keys[i], e))
            for i, e in enumerate(started)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        await client.pause(mode)
        assert await client.update_weights(named, version, bucket_bytes=32 << 10) == version
        await client.resume()
        return await asyncio.wait_for(asyncio.gather(*group), 300)


@pytest.mark.parametrize("mode", ["wait", "abort", "keep", "retract"])
async def test_pause_update_resume_round(mode, url, keys, weight_sets, ray_cluster):
    async with RolloutClient(url, admin_key=ADMIN_KEY) as client:
        wait_healthy(ray_cluster, 2)
        old = await client.weight_version()
        new = old + 1
        (old_dir, _), (new_dir, named) = weight_sets[old % 2], weight_sets[new % 2]
        lasts = await run_round(url, client, mode, named, new, keys)
        assert replica_versions(ray_cluster) == [new, new]  # both switched, together
        for prompt, last in zip(PROMPTS, lasts):
            ids, versions = last["output_ids"], last["meta_info"]["weight_versions"]
            reason = last["meta_info"]["finish_reason"]["type"]
            done = versions.count(old)
            assert versions == [old] * done + [new] * (len(ids) - done)  # one switch
            head = min(done, CHECKED)
            assert ids[:head] == hf_greedy(old_dir, prompt, head)[0]
            if mode == "wait":  # ran to the end under the old weights
                assert reason == "length" and done == LONG
            elif mode == "abort":  # ended at the pause with its partial output
                assert reason == "abort" and 0 < done == len(ids) < LONG
            else:  # frozen mid-rollout, finished under the new weights
                assert reason == "length" and len(ids) == LONG and 0 < done < LONG
            if mode == "retract":
                tail = ids[done : done + CHECKED]
                assert tail == hf_greedy(new_dir, prompt + ids[:done], len(tail))[0]
        # after the update: greedy equals HF on the new weights on both replicas, also for
        # the group's prompts, whose prefixes were cached under the old version
        for i, prompt in enumerate(PROMPTS):
            (got,) = await client.generate(
                prompt, routing_key=keys[i], max_tokens=8, temperature=0.0, ignore_eos=True
            )
            assert got.token_ids == hf_greedy(new_dir, prompt, 8)[0]
            assert got.weight_versions == [new] * 8
    # the group used both replicas
    wait_for(lambda: all(n > 0 for n in routed_counts(ray_cluster)), 30, "both replicas used")
