"""`lora_version` over HTTP, through the app `raylane serve` builds over an in-process engine: an
adapter loaded again in place (vLLM's `load_inplace`) is at version 2; asking for version 2 on
the completions, chat and /generate bodies runs on it (PEFT's tokens with the second directory),
version 1 (replaced, no request holds it) answers 409 with the API's error body, and a version
asked for without an adapter is a 400 naming `lora_version`. Reference: PEFT's `PeftModel`.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from raylane.actors.engine import AsyncLLMEngine, LLMEngine
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.admin_helpers import ADMIN_KEY, USER_KEY, keyed_client
from tests.e2e.conftest import MAX_BODY, MODEL, tiny_config
from tests.e2e.server import ServerThread
from tests.lora_adapters import make_adapter, peft_greedy, peft_models

pytest.importorskip("peft")

PROMPT = [5, 17, 42, 99, 7]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_version_http")
    return {
        "first": make_adapter(tiny_llama_dir, root / "first", seed=41, r=4),
        "second": make_adapter(tiny_llama_dir, root / "second", seed=42, r=4),
    }


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters) -> Iterator[ServerThread]:
    engine = LLMEngine(tiny_config(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8))
    backend = local_backend(AsyncLLMEngine(engine), MODEL)
    app = build_app(backend, api_keys=[USER_KEY], admin_api_key=ADMIN_KEY, max_body_bytes=MAX_BODY)
    with ServerThread(app) as srv, keyed_client(srv, ADMIN_KEY) as admin:
        for path, inplace in ((adapters["first"], False), (adapters["second"], True)):
            body = {"lora_name": "policy", "lora_path": path, "load_inplace": inplace}
            answer = admin.post("/v1/load_lora_adapter", json=body)
            assert answer.status_code == 200, answer.text
        yield srv


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=USER_KEY, max_retries=0, timeout=60)


@pytest.fixture
def user(server) -> Iterator[httpx.Client]:
    with keyed_client(server, USER_KEY) as http:
        yield http


def completion(client: openai.OpenAI, version: int, model: str = "policy") -> list[int]:
    answer = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"lora_version": version, "ignore_eos": True, "return_token_ids": True},
    )
    return answer.choices[0].model_extra["token_ids"]


def generate(user: httpx.Client, version: int, lora: str | None = "policy") -> httpx.Response:
    body = {
        "input_ids": PROMPT,
        "lora_version": version,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True},
        **({"lora_path": lora} if lora else {}),
    }
    return user.post("/generate", json=body)


def test_a_held_version_runs_and_a_replaced_one_is_409(client, user, adapters, tiny_llama_dir):
    peft = peft_models(tiny_llama_dir, adapters)
    second, _ = peft_greedy(peft, "second", PROMPT, MAX_TOKENS)
    first, _ = peft_greedy(peft, "first", PROMPT, MAX_TOKENS)
    assert first != second  # the two versions answer differently
    assert completion(client, 2) == second
    answer = generate(user, 2)
    assert answer.status_code == 200, answer.text
    assert answer.json()["output_ids"] == second
    with pytest.raises(openai.ConflictError) as gone:
        completion(client, 1)
    assert gone.value.body["code"] == 409
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"lora_version": 1},
        )
    refused = generate(user, 1)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["type"] == "ConflictError"


def test_a_version_without_an_adapter_is_400(client, user):
    with pytest.raises(openai.BadRequestError) as bad:
        completion(client, 1, model=MODEL)
    assert bad.value.body["param"] == "lora_version"
    answer = generate(user, 1, lora=None)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "lora_version"
