"""A DSA model's indexer top-k over HTTP (base64 int32 + shape): /generate, the OpenAI
extension field and the rollout client, equal to the engine's own capture (which
tests/unit/test_dsa_engine.py checks against HF's indexers)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from raylane.actors.engine import AsyncLLMEngine, LLMEngine, SamplingParams
from raylane.client import RolloutClient
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.conftest import tiny_config
from tests.e2e.server import ServerThread
from tests.e2e.test_routed_experts import decode

PROMPT_IDS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 17, 21, 8]
FLAGS = {"enable_return_indexer_topk": True}


@pytest.fixture(scope="module")
def dsa_ref(tiny_dsa_dir) -> LLMEngine:
    return LLMEngine(tiny_config(tiny_dsa_dir, **FLAGS))


@pytest.fixture(scope="module")
def dsa_url(tiny_dsa_dir) -> Iterator[str]:
    engine = LLMEngine(tiny_config(tiny_dsa_dir, **FLAGS))
    with ServerThread(build_app(local_backend(AsyncLLMEngine(engine), "dsa"))) as server:
        yield server.url


def reference(dsa_ref: LLMEngine, max_tokens: int) -> np.ndarray:
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, return_indexer_topk=True
    )
    return dsa_ref.generate([PROMPT_IDS], params, use_tqdm=False)[0].outputs[0].indexer_topk


def test_generate_and_completions_return_indexer_topk(dsa_url, dsa_ref):
    want = reference(dsa_ref, 6)
    assert want.shape == (len(PROMPT_IDS) + 5, 3, 12)
    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=dsa_url, timeout=30) as http:
        body = {"input_ids": PROMPT_IDS, "return_indexer_topk": True, "sampling_params": sampling}
        got = http.post("/generate", json=body).json()
        np.testing.assert_array_equal(decode(got["meta_info"]["indexer_topk"]), want)
        body = {
            "prompt": PROMPT_IDS,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "return_indexer_topk": True,
        }
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
        np.testing.assert_array_equal(decode(choice["indexer_topk"]), want)
        streamed = http.post("/v1/completions", json={**body, "stream": True}).text
        events = [json.loads(x[6:]) for x in streamed.splitlines() if x.startswith("data: {")]
        blobs = [c["indexer_topk"] for e in events for c in e["choices"] if "indexer_topk" in c]
        assert len(blobs) == 1  # once, on the choice's last chunk
        np.testing.assert_array_equal(decode(blobs[0]), want)


def test_rollout_client_returns_indexer_topk(dsa_url, dsa_ref):
    async def run():
        async with RolloutClient(dsa_url) as client:
            return await client.generate(
                PROMPT_IDS,
                temperature=0.0,
                max_tokens=6,
                ignore_eos=True,
                return_indexer_topk=True,
            )

    (got,) = asyncio.run(run())
    np.testing.assert_array_equal(got.indexer_topk, reference(dsa_ref, 6))
