"""The verl adapter (`raylane.integrations.verl`) against verl 0.9's own classes (installed
`--no-deps` by the Makefile): the server answers verl's `TokenOutput` with Hugging Face's greedy
tokens and logprobs, aborts and parks as verl's vLLM server does around a weight sync, sleeps
and wakes the engine; verl's `RolloutReplicaRegistry` (through raylane's `verl.plugins` entry
point) builds a `RolloutReplica` whose server actor serves the same over HTTP from Ray."""

from __future__ import annotations

import asyncio
import importlib.metadata

import pytest
from raylane.client import RolloutClient
from raylane.integrations import verl as adapter
from verl.workers.config import RolloutConfig
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

from tests.e2e.admin_helpers import PROMPT
from tests.e2e.conftest import API_KEY
from tests.hf_reference import hf_greedy

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture
async def rollout(trainer_server, trainer):
    # the control goes over HTTP too: the engine runs on the server's thread, and a
    # PlaneControl over its backend would drive it from this test's thread
    client = RolloutClient(trainer_server.url)
    control = adapter.RoutesControl(trainer_server.url)
    defaults = adapter.ServerDefaults(response_length=6)
    yield adapter.RaylaneRolloutServer(client, control, defaults)
    await control.close()
    await client.close()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir) -> tuple[list[int], list[float]]:
    return hf_greedy(tiny_llama_dir, PROMPT, 6)


async def started(rollout, trainer_engine, request_id: str) -> asyncio.Task:
    """A long request, once the engine runs it."""
    params = {**GREEDY, "max_tokens": 200}
    task = asyncio.create_task(rollout.generate(PROMPT, params, request_id))
    while not trainer_engine.has_unfinished_requests():
        await asyncio.sleep(0.01)
    return task


def test_sampling_defaults_follow_verls_vllm_server():
    defaults = adapter.ServerDefaults(response_length=8, prompt_length=10, seed=42)
    params = defaults.sampling({"logprobs": True, "top_k": -1}, 15)
    assert params["max_tokens"] == 3 and params["logprobs"] == 0 and params["seed"] == 42
    assert defaults.sampling({}, 40)["max_tokens"] == 1  # at least one token, as verl
    assert defaults.sampling({"max_new_tokens": 5}, 15)["max_tokens"] == 5
    assert defaults.sampling({"logprobs": False}, 1)["logprobs"] is None
    assert adapter.ServerDefaults(routed_experts=True).sampling({}, 1)["return_routed_experts"]


async def test_generate_answers_verls_token_output_with_hf_greedy(rollout, hf):
    ids, logprobs = hf
    out = await rollout.generate(PROMPT, {**GREEDY, "logprobs": True}, "verl-1")
    assert type(out) is TokenOutput and out.token_ids == ids  # max_tokens: response_length
    assert out.log_probs == pytest.approx(logprobs, abs=1e-4)
    assert out.stop_reason == "completed" and out.routed_experts is None
    assert out.extra_fields["global_steps"] is None
    await rollout.set_global_steps(3)
    plain = await rollout.generate(PROMPT, {**GREEDY, "max_new_tokens": 2}, "verl-2")
    assert plain.log_probs is None and plain.token_ids == ids[:2]
    assert plain.extra_fields["global_steps"] == 3
    with pytest.raises(ValueError, match="bogus"):
        await rollout.generate(PROMPT, {"bogus": 1}, "verl-3")
    with pytest.raises(ValueError, match="image_data"):
        await rollout.generate(PROMPT, {}, "verl-4", image_data=[b"png"])


async def test_abort_all_requests_parks_or_rejects_until_resume_generation(
    rollout, trainer_engine, hf
):
    running = await started(rollout, trainer_engine, "verl-long")
    summary = await rollout.abort_all_requests()
    assert summary == {"aborted_count": 1, "request_ids": ["verl-long"]}
    out = await running
    assert out.stop_reason == "aborted" and len(out.token_ids) < 200
    parked = asyncio.create_task(rollout.generate(PROMPT, {**GREEDY, "max_tokens": 2}, "verl-p"))
    await asyncio.sleep(0.3)
    assert not parked.done()  # held while generation is aborted
    await rollout.resume_generation()
    assert (await parked).token_ids == hf[0][:2]
    await rollout.abort_all_requests(reject_request=True)
    rejected = await rollout.generate(PROMPT, GREEDY, "verl-rejected")
    assert rejected.token_ids == [] and rejected.stop_reason == "aborted"
    await rollout.resume_generation()
    assert (await rollout.generate(PROMPT, GREEDY, "verl-back")).token_ids == hf[0]
    running = await started(rollout, trainer_engine, "verl-one")
    assert await rollout.abort_request("verl-one") == {"aborted": True, "request_id": "verl-one"}
    assert (await running).stop_reason == "aborted"
    assert (await rollout.abort_request("verl-nobody"))["aborted"] is False


async def test_sleep_and_release_free_the_kv_cache_until_woken(rollout, trainer_engine, hf):
    await rollout.sleep()
    assert trainer_engine.upkeep.sleeping
    await rollout.wake_up()
    assert not trainer_engine.upkeep.sleeping
    await rollout.release_kv_cache()
    assert trainer_engine.upkeep.sleeping
    await rollout.resume_kv_cache()
    assert not trainer_engine.upkeep.sleeping
    await rollout.clear_kv_cache()
    assert (await rollout.generate(PROMPT, GREEDY, "verl-5")).token_ids == hf[0]


async def test_verls_registry_builds_a_replica_served_by_a_ray_actor(
    ray_cluster, trainer_server, trainer, hf
):
    plugins = {p.name: p.value for p in importlib.metadata.entry_points(group="verl.plugins")}
    assert plugins["raylane"] == "raylane.integrations.verl"  # what verl imports at its import
    replica_class = RolloutReplicaRegistry.get("raylane")
    assert issubclass(replica_class, RolloutReplica)
    config = RolloutConfig(
        name="raylane",
        tensor_model_parallel_size=1,
        response_length=4,
        prompt_length=64,
        engine_kwargs={"raylane": {"address": trainer_server.url}},
    )
    replica = replica_class(replica_rank=7, config=config, model_config=None, gpus_per_node=1)
    with pytest.raises(NotImplementedError, match="standalone"):
        await replica.init_hybrid(None)
    await replica.init_standalone()
    try:
        host_port = trainer_server.url.removeprefix("http://")
        assert replica.server_address == host_port
        assert await replica.server_handle.get_server_address.remote() == (
            "127.0.0.1",
            int(host_port.rsplit(":", 1)[1]),
        )
        out = await replica.server_handle.generate.remote(
            prompt_ids=PROMPT, sampling_params={**GREEDY, "logprobs": True}, request_id="r"
        )
        assert type(out) is TokenOutput and out.token_ids == hf[0][:4]
        assert out.log_probs == pytest.approx(hf[1][:4], abs=1e-4)
        await replica.abort_all_requests()
        await replica.resume_generation()
        await replica.sleep()
        await replica.wake_up()
        await replica.clear_kv_cache()
        assert (await replica.abort_request("nobody"))["aborted"] is False
    finally:
        ray_cluster.kill(replica.server_handle)


async def test_over_http_a_cluster_without_the_trainer_routes_is_refused(server):
    control = adapter.RoutesControl(server.url, API_KEY)
    try:
        with pytest.raises(ValueError, match="--trainer-api"):
            await control.ready()
    finally:
        await control.close()
