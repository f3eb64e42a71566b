"""LoRA slots over HTTP: with every one of `max_loras` slots pinned, a second pinned load is
refused (SGLang's answer, nothing loaded) and a request on an unpinned adapter gets 429 (the
engine's LoRASlotsFull); a request pinned to a version no longer held would be 409 (the
engine's LoRAVersionGone, raised here by hand to check its HTTP answer)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from raylane.actors.engine import AsyncLLMEngine, LLMEngine
from raylane.actors.lora.errors import LoRAVersionGone
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend
from raylane.session_server.errors import from_exception

from tests.e2e.conftest import MODEL, tiny_config
from tests.e2e.server import ServerThread
from tests.lora_adapters import make_adapter

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_slots")
    return {n: make_adapter(tiny_llama_dir, root / n, seed=s, r=4) for n, s in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def http(tiny_llama_dir) -> Iterator[httpx.Client]:
    engine = LLMEngine(tiny_config(tiny_llama_dir, enable_lora=True, max_loras=1, max_lora_rank=8))
    app = build_app(local_backend(AsyncLLMEngine(engine), MODEL))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client


def test_all_slots_pinned(http, adapters):
    pinned = {"lora_name": "a", "lora_path": adapters["a"], "pinned": True}
    assert http.post("/load_lora_adapter", json=pinned).json()["success"] is True
    again = http.post(
        "/load_lora_adapter", json={**pinned, "lora_name": "b", "lora_path": adapters["b"]}
    )
    assert again.status_code == 400 and again.json()["success"] is False
    assert "slots" in again.json()["error_message"]
    assert again.json()["loaded_adapters"] == {"a": adapters["a"]}  # b was not loaded
    body = {"lora_name": "b", "lora_path": adapters["b"]}
    assert http.post("/v1/load_lora_adapter", json=body).status_code == 200  # registered only
    resp = http.post("/v1/completions", json={"model": "b", "prompt": [1, 2, 3], "max_tokens": 2})
    assert resp.status_code == 429, resp.text
    assert resp.json()["error"]["code"] == 429
    ok = http.post("/v1/completions", json={"model": "a", "prompt": [1, 2, 3], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_a_gone_version_is_a_409():
    err = from_exception(LoRAVersionGone("lora_name 'a': version 7 is no longer held"))
    assert (err.status, err.code, err.param) == (409, 409, "model")
