"""`RolloutClient.in_cluster()` on a local Ray cluster with two tiny-Llama replicas: generation
through the Router and the deployment handle (no HTTP), a weight update through the object
store to both replicas (reference: HF `generate` on the weights sent), abort, pause, sessions
and fan-out; the HTTP client against the same cluster agrees with it."""

from __future__ import annotations

import asyncio

import pytest
from raylane.client import RolloutClient
from raylane.router.actor import NAMESPACE, ROUTER_NAME

from tests.hf_reference import hf_greedy, perturbed_model
from tests.ray.conftest import free_port

ADMIN_KEY = "admin-client"
PROMPT = [5, 17, 42, 99, 7, 150, 33]
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(ray_cluster, tiny_llama_dir):
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


@pytest.fixture
def client(url, tiny_llama_dir) -> RolloutClient:
    return RolloutClient.in_cluster(model=tiny_llama_dir)


def versions(ray_cluster) -> list[int]:
    router = ray_cluster.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    return [r["weight_version"] for r in ray_cluster.get(router.replicas.remote()) if r["healthy"]]


async def test_generate_in_cluster_equals_http_and_hf(client, url, tiny_llama_dir):
    (got,) = await client.generate(PROMPT, **GREEDY)
    want, want_logprobs = hf_greedy(tiny_llama_dir, PROMPT, 8)
    assert got.token_ids == want and got.prompt_token_ids == PROMPT
    assert got.logprobs == pytest.approx(want_logprobs, abs=1e-4)
    assert got.weight_versions == [0] * 8
    async with RolloutClient(url, admin_key=ADMIN_KEY) as http:
        (over_http,) = await http.generate(PROMPT, **GREEDY)
        assert await http.weight_version() == await client.weight_version() == 0
    assert over_http.token_ids == got.token_ids
    (text,) = await client.generate("Hello, world!", **GREEDY)
    assert text.prompt_token_ids == await client.tokenize("Hello, world!")


async def test_verls_replica_serves_from_inside_the_cluster(url, ray_cluster, tiny_llama_dir):
    """verl's replica without an address (raylane.integrations.verl): its server actor reaches
    the Router over Ray handles; before the update below, so HF's weights are served."""
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.replica import RolloutReplicaRegistry, TokenOutput

    config = RolloutConfig(
        name="raylane", tensor_model_parallel_size=1, response_length=8, prompt_length=64
    )
    replica = RolloutReplicaRegistry.get("raylane")(
        replica_rank=0, config=config, model_config=None, gpus_per_node=1
    )
    await replica.init_standalone()
    try:
        assert replica.server_address == "raylane_server_0_0"  # no HTTP address given
        sampling = {"temperature": 0.0, "ignore_eos": True, "logprobs": True}
        out = await replica.server_handle.generate.remote(
            prompt_ids=PROMPT, sampling_params=sampling, request_id="verl-in-cluster"
        )
        want, want_logprobs = hf_greedy(tiny_llama_dir, PROMPT, 8)
        assert type(out) is TokenOutput and out.token_ids == want
        assert out.log_probs == pytest.approx(want_logprobs, abs=1e-4)
        await replica.abort_all_requests()
        await replica.resume_generation()
        await replica.clear_kv_cache()
    finally:
        ray_cluster.kill(replica.server_handle)


async def test_sleep_then_wake_up_in_cluster(client, tiny_llama_dir):
    """Both replicas free their KV caches (level 2: and weights) and restore them; before the
    update below, so HF's weights are served."""
    want, want_logprobs = hf_greedy(tiny_llama_dir, PROMPT, 8)
    await client.sleep(2)
    waiting = asyncio.ensure_future(client.generate(PROMPT, **GREEDY))
    await asyncio.sleep(0.5)
    assert not waiting.done()  # held while the replicas sleep
    await client.wake_up()
    (held,) = await asyncio.wait_for(waiting, 60)
    assert held.token_ids == want
    for key in ("a", "b", "c", "d"):  # spread over both replicas
        (got,) = await client.generate(PROMPT, routing_key=key, **GREEDY)
        assert got.token_ids == want
        assert got.logprobs == pytest.approx(want_logprobs, abs=1e-4)


async def test_update_reaches_both_replicas_through_the_object_store(
    client, ray_cluster, tiny_llama_dir, tmp_path
):
    v1_dir, named = perturbed_model(tiny_llama_dir, str(tmp_path), 3)
    assert await client.update_weights(named, 1, bucket_bytes=64 << 10) == 1
    assert await client.weight_version() == 1 and versions(ray_cluster) == [1, 1]
    want, _ = hf_greedy(v1_dir, PROMPT, 8)
    for key in ("a", "b", "c", "d"):  # spread over both replicas
        (got,) = await client.generate(PROMPT, routing_key=key, **GREEDY)
        assert got.token_ids == want and got.weight_versions == [1] * 8


async def test_abort_and_pause_in_cluster(client):
    rid = "ray-abort"
    running = asyncio.ensure_future(
        client.generate(PROMPT, request_id=rid, routing_key="k", max_tokens=200, ignore_eos=True)
    )
    partial = []
    for _ in range(200):  # until it is running on its replica
        await asyncio.sleep(0.05)
        partial = await client.abort([rid])
        if partial:
            break
    assert partial and partial[0].finish_reason == "abort"
    (ended,) = await running
    assert ended.finish_reason == "abort" and len(ended.token_ids) < 200

    await client.pause("keep")
    waiting = asyncio.ensure_future(client.generate(PROMPT, **GREEDY))
    await asyncio.sleep(0.5)
    assert not waiting.done()  # queued while paused
    await client.resume()
    (got,) = await asyncio.wait_for(waiting, 60)
    assert got.finish_reason == "length"


async def test_session_and_fork_in_cluster(client):
    session = await client.session()
    turn = await session.chat(
        [{"role": "user", "content": "Hello, world!"}], max_tokens=4, temperature=0.0
    )
    sample = await session.sample()
    await session.delete()
    assert [t for t, m in zip(sample.tokens, sample.loss_mask) if m] == turn.token_ids

    prefix = [(7 * i) % 200 + 3 for i in range(40)]
    suffixes = [[11, 12], [21, 22], [31, 32]]
    fanned = await client.gather(await client.fork(prefix, 3, suffixes=suffixes, **GREEDY))
    one_by_one = [(await client.generate(prefix + s, **GREEDY))[0] for s in suffixes]
    assert [r.token_ids for r in fanned] == [r.token_ids for r in one_by_one]
