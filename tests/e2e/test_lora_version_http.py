"""`lora_version` over HTTP, through the app `raylane serve` builds over an in-process engine: an
adapter loaded again in place (vLLM's `load_inplace`) is at version 2; asking for version 2 on
the completions, chat and /generate bodies, vLLM's tokens route (`/inference/v1/generate`, and
SkyRL's `/skyrl/v1/generate` over the same body) and a session's turns (on the adapter the
session was opened on) runs on it (PEFT's tokens with the second directory), as asking for none
does (the newest); version 1 (replaced, no request holds it) answers 409 with the API's error
body (a refused turn leaves the session as it was), and a version asked for without an adapter
(the base model, a session opened on none) is a 400 naming `lora_version`. Reference: PEFT's
`PeftModel`.
"""

from __future__ import annotations

import asyncio
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
    app = build_app(
        backend,
        api_keys=[USER_KEY],
        admin_api_key=ADMIN_KEY,
        max_body_bytes=MAX_BODY,
        trainer_api=True,
    )
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


def tokens(
    user: httpx.Client, version: int | None, model: str = "policy", route: str = "inference/v1"
) -> httpx.Response:
    body = {
        "token_ids": PROMPT,
        "model": model,
        "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
    }
    if version is not None:
        body["lora_version"] = version
    return user.post(f"/{route}/generate", json=body)


def test_the_tokens_route_asks_for_a_version(user, adapters, tiny_llama_dir):
    peft = peft_models(tiny_llama_dir, adapters)
    second, _ = peft_greedy(peft, "second", PROMPT, MAX_TOKENS)
    assert second != peft_greedy(peft, "first", PROMPT, MAX_TOKENS)[0]  # versions differ
    for version in (2, None):  # the held version, and the newest when none is asked for
        answer = tokens(user, version)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == second
    skyrl = tokens(user, 2, route="skyrl/v1")
    assert skyrl.status_code == 200, skyrl.text
    assert skyrl.json()["choices"][0]["token_ids"] == second
    for route in ("inference/v1", "skyrl/v1"):
        gone = tokens(user, 1, route=route)
        assert gone.status_code == 409, gone.text
        assert gone.json()["error"]["type"] == "ConflictError"
        assert gone.json()["error"]["code"] == 409
    base = tokens(user, 1, model=MODEL)
    assert base.status_code == 400, base.text
    assert base.json()["error"]["param"] == "lora_version"


def turn(user: httpx.Client, session: str, history: list[dict], version: int | None):
    body = {"messages": history, "max_tokens": MAX_TOKENS, "temperature": 0}
    if version is not None:
        body["lora_version"] = version
    return user.post(f"/sessions/{session}/v1/chat/completions", json=body)


def replies(sample: dict) -> list[tuple[int, int]]:
    """Each generated span of the sample: (start, end)."""
    mask = sample["loss_mask"]
    starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
    return [(s, next((i for i in range(s, len(mask)) if not mask[i]), len(mask))) for s in starts]


def test_a_session_turn_asks_for_a_version_of_its_adapter(user, adapters, tiny_llama_dir):
    peft = peft_models(tiny_llama_dir, adapters)
    session = user.post("/sessions", json={"metadata": {"lora": "policy"}}).json()["session_id"]
    history = [{"role": "user", "content": "hello there"}]
    gone = turn(user, session, history, 1)
    assert gone.status_code == 409, gone.text
    assert gone.json()["error"]["type"] == "ConflictError"
    for version, text in ((2, "and again"), (None, "once more")):
        answer = turn(user, session, history, version)
        assert answer.status_code == 200, answer.text
        history += [answer.json()["choices"][0]["message"], {"role": "user", "content": text}]
    sample = user.post(f"/sessions/{session}/samples").json()
    spans = replies(sample)
    assert len(spans) == 2  # the refused turn left nothing
    on_first = []
    for start, end in spans:
        want, _ = peft_greedy(peft, "second", sample["tokens"][:start], end - start)
        assert sample["tokens"][start:end] == want
        on_first.append(peft_greedy(peft, "first", sample["tokens"][:start], end - start)[0])
    assert on_first != [sample["tokens"][s:e] for s, e in spans]  # the premise: v1 differs


def test_a_version_on_a_session_without_an_adapter_is_400(user):
    session = user.post("/sessions", json={}).json()["session_id"]
    answer = turn(user, session, [{"role": "user", "content": "hi"}], 1)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "lora_version"


def test_the_rollout_clients_session_asks_for_a_version(server, adapters, tiny_llama_dir):
    from raylane.client import RolloutClient
    from raylane.client.errors import ClientError

    async def scenario() -> tuple[list[int], list[int], int]:
        async with RolloutClient(server.url, api_key=USER_KEY) as client:
            session = await client.session(metadata={"lora": "policy"})
            hello = [{"role": "user", "content": "hello there"}]
            with pytest.raises(ClientError) as gone:
                await session.chat(hello, lora_version=1, max_tokens=MAX_TOKENS, temperature=0)
            turn = await session.chat(hello, lora_version=2, max_tokens=MAX_TOKENS, temperature=0)
            sample = await session.sample()
            return list(sample.tokens), list(turn.token_ids), gone.value.status

    tokens, reply, status = asyncio.run(scenario())
    assert status == 409
    start = len(tokens) - len(reply)
    assert tokens[start:] == reply  # the one turn recorded: the refused one left nothing
    peft = peft_models(tiny_llama_dir, adapters)
    assert reply == peft_greedy(peft, "second", tokens[:start], len(reply))[0]
