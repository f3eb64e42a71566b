"""SkyRL's own `RemoteInferenceClient` (skyrl 0.3.0, `pip install --no-deps`: its dependency
pins conflict with ours) against the trainer API: generation through `/inference/v1/generate`
and SkyRL's `/skyrl/v1/generate` checked against Hugging Face, pause/resume, sleep/wake-up,
the cache reset, the world size, and SkyRL's broadcast weight sync (`/collective_rpc`
`skyrl_start_weight_update` -> `update_weights_nccl` || the trainer's broadcast ->
`skyrl_finish_weight_update`), after which greedy output equals HF on the new weights.

NOTE: `skyrl/backends/__init__.py` imports its Tinker backend, whose pydantic models fail on
Python 3.11; the client's own modules do not need it, so that one package module is created
bare. The group is initialised with vLLM's route and `backend: "gloo"` (SkyRL's NCCL init
info needs CUDA); every other request is the client's own.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import types
from collections.abc import Iterator

import httpx
import pytest
from raylane.actors.engine import AsyncLLMEngine, LLMEngine
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.conftest import tiny_config
from tests.e2e.server import ServerThread
from tests.hf_reference import hf_greedy, perturbed_model
from tests.schema_checks import answer_problems
from tests.weight_trainer import Trainer, trainer_specs

PROMPT = [(7 * j) % 200 + 5 for j in range(14)]
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}


def client_class():
    spec = importlib.util.find_spec("skyrl")
    if spec is None:
        pytest.skip("skyrl is not installed")
    if "skyrl.backends" not in sys.modules:  # see the NOTE above
        package = types.ModuleType("skyrl.backends")
        package.__path__ = [f"{spec.submodule_search_locations[0]}/backends"]
        sys.modules["skyrl.backends"] = package
    from skyrl.backends.skyrl_train.inference_servers import remote_inference_client

    return remote_inference_client.RemoteInferenceClient


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[ServerThread]:
    backend = local_backend(AsyncLLMEngine(LLMEngine(tiny_config(tiny_llama_dir))), "tiny")
    with ServerThread(build_app(backend, trainer_api=True)) as srv:
        yield srv


def run(server: ServerThread, test, **fields):
    """`test(client)` on a fresh event loop, the client closed after."""
    cls = client_class()
    fields.setdefault("model_name", "tiny")

    async def go():
        client = cls(proxy_url=server.url, server_urls=[server.url], data_parallel_size=1, **fields)
        try:
            return await test(client)
        finally:
            await client.teardown()

    return asyncio.run(go())


def generate(client, prompt=PROMPT):
    return client.generate({"prompt_token_ids": [prompt], "sampling_params": GREEDY})


def test_generate_both_routes_equal_hf(server, tiny_llama_dir):
    ids, logprobs = hf_greedy(tiny_llama_dir, PROMPT, 6)
    for experts in (False, True):  # /inference/v1/generate, then /skyrl/v1/generate
        out = run(server, generate, enable_return_routed_experts=experts)
        assert out["response_ids"] == [ids] and out["stop_reasons"] == ["length"]
        assert out["response_logprobs"][0] == pytest.approx(logprobs, abs=1e-4)
        assert out["rollout_expert_indices"] is None  # a dense model


def test_control_calls(server):
    async def test(client):
        await client.pause("keep")
        paused = httpx.get(f"{server.url}/is_paused").json()
        await client.resume()
        await client.reset_prefix_cache()
        await client.sleep(level=1)
        sleeping = httpx.get(f"{server.url}/is_sleeping").json()
        await client.wake_up()
        return paused, sleeping, await client.get_world_size()

    paused, sleeping, world = run(server, test)
    assert paused == {"is_paused": True} and sleeping == {"is_sleeping": True}
    assert world == (1, 1)
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": False}


def test_broadcast_weight_sync(server, tiny_llama_dir, tmp_path):
    v1_dir, _ = perturbed_model(tiny_llama_dir, str(tmp_path / "v1"), 5)
    specs = trainer_specs(v1_dir)
    info = {
        "names": [s["name"] for s in specs],
        "dtype_names": [s["dtype"] for s in specs],
        "shapes": [s["shape"] for s in specs],
        "packed": True,
    }
    trainer = Trainer(v1_dir, specs, packed=True, buffer=1 << 30)

    async def test(client):
        init = {"init_info": trainer.info()}  # backend "gloo"
        await client._call_server(server.url, "/init_weight_transfer_engine", init)
        await client.pause("keep")
        await client.start_weight_update(is_checkpoint_format=True)
        trainer.send()
        await client.update_weights_nccl(info)
        await client.finish_weight_update()
        await client.resume()
        return await generate(client)

    try:
        out = run(server, test)
    finally:
        trainer.close()
    assert out["response_ids"] == [hf_greedy(v1_dir, PROMPT, 6)[0]]
    assert httpx.get(f"{server.url}/weight_info").json()["weight_version"] == "1"


def test_skyrl_routes_answer_as_their_schema(server):
    """Last here: its empty update moves the server to the next version."""
    answers: list[httpx.Response] = []
    with httpx.Client(
        base_url=server.url, timeout=60, event_hooks={"response": [lambda r: answers.append(r)]}
    ) as http:
        sampling = {**GREEDY, "logprobs": 1}
        body = {"token_ids": PROMPT, "sampling_params": sampling}
        assert http.post("/skyrl/v1/generate", json=body).status_code == 200
        for method in ("skyrl_start_weight_update", "skyrl_finish_weight_update"):
            assert http.post("/collective_rpc", json={"method": method}).status_code == 200
        refused = http.post("/collective_rpc", json={"method": "update_weights_ipc"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "method"
        for answer in answers:
            answer.read()
    assert answer_problems(server.app, answers) == []
