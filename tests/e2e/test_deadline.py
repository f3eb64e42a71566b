"""A request's deadline (`timeout` in the body, or the server's default): past it the request
ends with its partial output and finish reason "abort", and nothing runs on in the engine. And
the server's own limit on `n`.

Reference: the same greedy request without a deadline (its first tokens must be the partial
output's)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.conftest import MAX_BODY, MODEL
from tests.e2e.server import ServerThread

PROMPT = [5, 17, 42, 99, 7, 150, 33]
# tokens: far longer than the deadlines below allow (the tiny model decodes ~1-2 ms a step)
LONG = 1000


@pytest.fixture(scope="module")
def deadline_engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, max_model_len=1024))


@pytest.fixture(scope="module")
def url(deadline_engine) -> Iterator[str]:
    app = build_app(
        local_backend(AsyncLLMEngine(deadline_engine), MODEL),
        max_body_bytes=MAX_BODY,
        request_timeout_s=0.4,
        max_n=3,
    )
    with ServerThread(app) as srv:
        yield srv.url


def generate(url: str, max_new: int, **extra) -> httpx.Response:
    return httpx.post(
        f"{url}/generate",
        timeout=60,
        json={
            "input_ids": PROMPT,
            **extra,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
        },
    )


def idle(engine: LLMEngine) -> bool:
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    bm = engine.block_manager
    return not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


def test_past_the_deadline_the_partial_output_ends_as_abort(url, deadline_engine):
    full = generate(url, 40, timeout=60).json()  # a body's timeout wins over the default
    assert full["meta_info"]["finish_reason"]["type"] == "length"
    start = time.monotonic()
    cut = generate(url, LONG, timeout=0.15).json()
    assert time.monotonic() - start < 5
    ids = cut["output_ids"]
    assert cut["meta_info"]["finish_reason"]["type"] == "abort" and len(ids) < LONG
    assert ids == full["output_ids"][: len(ids)] or full["output_ids"] == ids[:40]
    assert idle(deadline_engine)  # aborted on the engine too: nothing runs on


def test_the_server_default_applies_and_streams_end_with_abort(url, deadline_engine):
    cut = generate(url, LONG).json()  # no timeout in the body: the server's 0.4 s
    assert cut["meta_info"]["finish_reason"]["type"] == "abort"
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": LONG,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "timeout": 0.2,
    }
    reasons = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                reasons += [c["finish_reason"] for c in json.loads(line[6:])["choices"]]
    assert reasons[-1] == "abort" and "length" not in reasons
    assert idle(deadline_engine)


def test_chat_with_n_ends_every_sample(url, deadline_engine):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "n": 3,
        "max_tokens": LONG,
        "ignore_eos": True,
        "timeout": 0.2,
    }
    choices = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["abort"] * 3
    assert idle(deadline_engine)


@pytest.mark.parametrize("bad", [0, -1, "soon"])
def test_a_bad_timeout_is_400(url, bad):
    response = generate(url, 4, timeout=bad)
    assert response.status_code == 400 and response.json()["error"]["param"] == "timeout"


def test_the_servers_n_limit_is_a_400_naming_n(url):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/chat/completions", json={**chat, "n": 3}).status_code == 200
    for route, body in (
        ("/v1/chat/completions", {**chat, "n": 4}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 4}),
        ("/generate", {"text": "hi", "sampling_params": {"n": 4}}),
    ):
        response = httpx.post(f"{url}{route}", json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "n", route
        assert "at most 3" in response.json()["error"]["message"]
