"""Routed expert ids over HTTP (base64 int32 + shape) equal the MoE engine's own capture."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from raylane.actors.engine import AsyncLLMEngine, LLMEngine, SamplingParams
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.conftest import tiny_config
from tests.e2e.server import ServerThread

PROMPT_IDS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]


@pytest.fixture(scope="module")
def moe_ref(tiny_moe_dir) -> LLMEngine:
    return LLMEngine(tiny_config(tiny_moe_dir, enable_return_routed_experts=True))


@pytest.fixture(scope="module")
def moe_http(tiny_moe_dir) -> Iterator[httpx.Client]:
    engine = LLMEngine(tiny_config(tiny_moe_dir, enable_return_routed_experts=True))
    app = build_app(local_backend(AsyncLLMEngine(engine), "moe"))
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def decode(routed: dict) -> np.ndarray:
    data = np.frombuffer(base64.b64decode(routed["data"]), dtype="<i4")
    return data.reshape(routed["shape"])


def reference(moe_ref: LLMEngine, prompt, max_tokens: int):
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, return_routed_experts=True
    )
    return moe_ref.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_generate_returns_routed_experts(moe_http, moe_ref):
    want = reference(moe_ref, PROMPT_IDS, 6)
    got = moe_http.post(
        "/generate",
        json={
            "input_ids": PROMPT_IDS,
            "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        },
    ).json()
    assert got["output_ids"] == want.token_ids
    routed = decode(got["meta_info"]["routed_experts"])
    assert routed.shape == (len(PROMPT_IDS) + 6 - 1, 2, 2)  # 2 MoE layers, top-2
    np.testing.assert_array_equal(routed, want.routed_experts)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_returns_routed_experts(moe_http, moe_ref, stream):
    messages = [{"role": "user", "content": "Which expert answers?"}]
    want = moe_ref.chat(
        messages,
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, return_routed_experts=True),
        use_tqdm=False,
    )[0].outputs[0]
    body = {
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "return_routed_experts": True,
        "stream": stream,
    }
    response = moe_http.post("/v1/chat/completions", json=body)
    if stream:
        events = [
            json.loads(line[6:])
            for line in response.text.splitlines()
            if line.startswith("data: {")
        ]
        routed = [
            c["routed_experts"] for e in events for c in e["choices"] if "routed_experts" in c
        ]
        assert len(routed) == 1  # on the last chunk of the choice
        routed = routed[0]
    else:
        routed = response.json()["choices"][0]["routed_experts"]
    np.testing.assert_array_equal(decode(routed), want.routed_experts)


# --- the trainer protocols' shapes (build_app(trainer_api=True)) -------------------------------


@pytest.fixture(scope="module")
def moe_trainer_http(tiny_moe_dir) -> Iterator[httpx.Client]:
    engine = LLMEngine(tiny_config(tiny_moe_dir, enable_return_routed_experts=True))
    app = build_app(local_backend(AsyncLLMEngine(engine), "moe"), trainer_api=True)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def test_sglang_generate_sends_its_base64_string_from_the_start_len(moe_trainer_http, moe_ref):
    want = reference(moe_ref, PROMPT_IDS, 6)
    body = {
        "input_ids": PROMPT_IDS,
        "return_routed_experts": True,
        "routed_experts_start_len": 5,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    meta = moe_trainer_http.post("/generate", json=body).json()["meta_info"]
    assert meta["routed_experts_start_len"] == 5
    # as slime decodes it: flat int32, rows [start_len, prompt + output - 1)
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    np.testing.assert_array_equal(flat.reshape(-1, 2, 2), want.routed_experts[5:])
    assert meta["routed_experts_shape"] == [len(PROMPT_IDS) + 6 - 1 - 5, 2, 2]
    too_far = {**body, "routed_experts_start_len": len(PROMPT_IDS) + 1}
    response = moe_trainer_http.post("/generate", json=too_far)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "routed_experts_start_len"
    info = moe_trainer_http.get("/server_info").json()
    assert info["enable_return_routed_experts"] is True


@pytest.mark.parametrize("start", [0, 4])
def test_vllm_tokens_route_sends_routed_experts_as_npy(moe_trainer_http, moe_ref, start):
    import io

    want = reference(moe_ref, PROMPT_IDS, 5)
    body = {
        "token_ids": PROMPT_IDS,
        "sampling_params": {"max_tokens": 5, "temperature": 0, "ignore_eos": True},
        "routed_experts_start_len": start,
    }
    (choice,) = moe_trainer_http.post("/inference/v1/generate", json=body).json()["choices"]
    assert choice["token_ids"] == want.token_ids
    routed = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
    assert routed.dtype == np.int32
    np.testing.assert_array_equal(routed, want.routed_experts[start:])


async def test_verls_token_output_carries_the_routed_experts(moe_http, moe_ref):
    """verl's rollout server (raylane.integrations.verl) with enable_rollout_routing_replay:
    `TokenOutput.routed_experts` is the engine's capture over the whole sequence."""
    from raylane.client import RolloutClient
    from raylane.integrations.verl import RaylaneRolloutServer, RoutesControl, ServerDefaults

    url = str(moe_http.base_url)
    defaults = ServerDefaults(response_length=6, routed_experts=True)
    client, control = RolloutClient(url), RoutesControl(url)
    try:
        server = RaylaneRolloutServer(client, control, defaults)
        out = await server.generate(PROMPT_IDS, {"temperature": 0.0, "ignore_eos": True}, "v")
    finally:
        await client.close()
        await control.close()
    want = reference(moe_ref, PROMPT_IDS, 6)
    assert out.token_ids == want.token_ids and out.stop_reason == "completed"
    np.testing.assert_array_equal(out.routed_experts, want.routed_experts)
