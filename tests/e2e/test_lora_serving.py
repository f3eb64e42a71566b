"""LoRA adapters over HTTP, through the app `raylane serve` builds (`build_app` over an in-process
engine, served by uvicorn): mixed requests to two adapters and the base model, sent at once with
the `openai` client, equal PEFT's `PeftModel` greedy tokens; `/v1/models` lists the adapters;
vLLM's and SGLang's load/unload routes, and their errors, change nothing on failure; an unknown
model gets vLLM's 404 body; `RolloutClient`'s adapter verbs, the adapter-only update included,
whose outputs equal PEFT's with the new adapter (a mismatched one changes nothing). Adapters are
PEFT's own (`init_lora_weights=False`,
tests/lora_adapters.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from raylane.actors.engine import AsyncLLMEngine, LLMEngine
from raylane.client import RolloutClient
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend
from safetensors.torch import load_file

from tests.e2e.admin_helpers import ADMIN_KEY, USER_KEY, keyed_client
from tests.e2e.conftest import MAX_BODY, MODEL, tiny_config
from tests.e2e.server import ServerThread
from tests.lora_adapters import make_adapter, peft_greedy, peft_models

pytest.importorskip("peft")

PROMPTS = [[5, 17, 42, 99, 7], [3, 8, 1, 250, 64, 12], [77, 2, 19]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_serving")
    return {
        "alpha": make_adapter(tiny_llama_dir, root / "alpha", seed=1, r=4),
        "beta": make_adapter(tiny_llama_dir, root / "beta", seed=2, r=8),
        "gamma": make_adapter(tiny_llama_dir, root / "gamma", seed=3, r=4),
    }


@pytest.fixture(scope="module")
def peft(tiny_llama_dir, adapters):
    return peft_models(tiny_llama_dir, adapters)


@pytest.fixture(scope="module")
def lora_engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(tiny_config(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8))


@pytest.fixture(scope="module")
def lora_server(lora_engine) -> Iterator[ServerThread]:
    backend = local_backend(AsyncLLMEngine(lora_engine), MODEL)
    app = build_app(backend, api_keys=[USER_KEY], admin_api_key=ADMIN_KEY, max_body_bytes=MAX_BODY)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture
def user(lora_server) -> Iterator[httpx.Client]:
    with keyed_client(lora_server, USER_KEY) as client:
        yield client


@pytest.fixture
def admin(lora_server, adapters, user) -> Iterator[httpx.Client]:
    """An admin client; every test starts with alpha and beta loaded, and nothing else."""
    with keyed_client(lora_server, ADMIN_KEY) as client:
        loaded = served_names(user) - {MODEL}
        for name in loaded - {"alpha", "beta"}:
            client.post("/v1/unload_lora_adapter", json={"lora_name": name})
        for name in {"alpha", "beta"} - loaded:
            body = {"lora_name": name, "lora_path": adapters[name]}
            assert client.post("/v1/load_lora_adapter", json=body).status_code == 200
        yield client


@pytest.fixture
def client(lora_server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=lora_server.url + "/v1", api_key=USER_KEY, max_retries=0, timeout=60
    )


def served_names(user: httpx.Client) -> set[str]:
    return {card["id"] for card in user.get("/v1/models").json()["data"]}


def native_tokens(http: httpx.Client, prompt: list[int], lora: str | None) -> list[int]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True},
        **({"lora_path": lora} if lora else {}),
    }
    resp = http.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


def test_mixed_adapters_and_base_equal_peft(admin, client, peft):
    """Two adapters and the base model, every prompt on each, all in flight at once."""
    jobs = [(model, p) for model in ("alpha", "beta", MODEL) for p in PROMPTS]

    def complete(job):
        model, prompt = job
        out = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            # PEFT's greedy loop runs past EOS too; vLLM's return_token_ids: the ids themselves
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return out.model, out.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(complete, jobs))
    for (model, prompt), (answered_model, ids) in zip(jobs, answers):
        tokens, _ = peft_greedy(peft, None if model == MODEL else model, prompt, MAX_TOKENS)
        assert answered_model == model
        assert ids == tokens, (model, prompt)


def test_sglang_lora_path_on_generate_equals_peft(admin, user, peft):
    for lora in ("alpha", "beta", None):
        expected, _ = peft_greedy(peft, lora, PROMPTS[0], MAX_TOKENS)
        assert native_tokens(user, PROMPTS[0], lora) == expected


def test_adapters_differ_from_the_base(admin, peft):
    """The test's own premise: each adapter changes greedy tokens."""
    outs = {lora: peft_greedy(peft, lora, PROMPTS[0], MAX_TOKENS)[0] for lora in ("alpha", None)}
    assert outs["alpha"] != outs[None]


def test_models_list_adapters_with_their_parent(admin, user, adapters):
    cards = {c["id"]: c for c in user.get("/v1/models").json()["data"]}
    assert set(cards) == {MODEL, "alpha", "beta"}
    assert cards[MODEL]["parent"] is None
    for name in ("alpha", "beta"):
        assert (cards[name]["parent"], cards[name]["root"]) == (MODEL, adapters[name])
    assert user.get("/v1/models/alpha").json()["parent"] == MODEL


def test_tokenize_takes_an_adapters_name(admin, user):
    for model in ("alpha", MODEL):
        resp = user.post("/tokenize", json={"model": model, "prompt": "hello"})
        assert resp.status_code == 200, resp.text
    assert user.post("/tokenize", json={"model": "nope", "prompt": "hi"}).status_code == 404


def test_unknown_model_gets_vllms_404_body(client, admin):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt=[1, 2], max_tokens=2)
    assert err.value.response.json() == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_vllm_routes_load_and_unload(admin, user, adapters, client, peft):
    body = {"lora_name": "gamma", "lora_path": adapters["gamma"]}
    resp = admin.post("/v1/load_lora_adapter", json=body)
    assert (resp.status_code, resp.text) == (
        200,
        "Success: LoRA adapter 'gamma' added successfully.",
    )
    expected, _ = peft_greedy(peft, "gamma", PROMPTS[1], MAX_TOKENS)
    assert native_tokens(user, PROMPTS[1], "gamma") == expected
    again = admin.post("/v1/load_lora_adapter", json=body)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    resp = admin.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
    assert (resp.status_code, resp.text) == (
        200,
        "Success: LoRA adapter 'gamma' removed successfully.",
    )
    assert "gamma" not in served_names(user)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gamma", prompt=[1, 2], max_tokens=2)
    gone = admin.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == "The lora adapter 'gamma' cannot be found."


def test_sglang_routes_load_and_unload(admin, user, adapters, peft):
    body = {"lora_name": "gamma", "lora_path": adapters["gamma"], "pinned": True}
    resp = admin.post("/load_lora_adapter", json=body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["success"] and answer["error_message"] is None
    assert answer["loaded_adapters"]["gamma"] == adapters["gamma"]
    expected, _ = peft_greedy(peft, "gamma", PROMPTS[2], MAX_TOKENS)
    assert native_tokens(user, PROMPTS[2], "gamma") == expected
    resp = admin.post("/unload_lora_adapter", json={"lora_name": "gamma"})
    assert resp.status_code == 200 and "gamma" not in resp.json()["loaded_adapters"]


def test_bad_adapter_loads_nothing(admin, user, tmp_path):
    before = user.get("/v1/models").json()["data"]
    resp = admin.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
    resp = admin.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert resp.json()["error_message"]
    assert user.get("/v1/models").json()["data"] == before


def test_load_routes_need_the_admin_key(lora_server, adapters):
    with keyed_client(lora_server, USER_KEY) as user:
        body = {"lora_name": "gamma", "lora_path": adapters["gamma"]}
        assert user.post("/v1/load_lora_adapter", json=body).status_code == 403
        assert user.post("/unload_lora_adapter", json={"lora_name": "alpha"}).status_code == 403


# --- RolloutClient ----------------------------------------------------------------------------


def peft_tensors(adapter_dir: str) -> list:
    """The adapter's tensors under PEFT's names, as a trainer would send them."""
    return sorted(load_file(f"{adapter_dir}/adapter_model.safetensors").items())


async def greedy(client: RolloutClient, prompt: list[int], lora: str | None) -> list[int]:
    (out,) = await client.generate(
        prompt, lora=lora, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    return list(out.token_ids)


def test_client_loads_generates_updates_and_unloads(lora_server, adapters, peft):
    async def scenario() -> None:
        async with RolloutClient(lora_server.url, api_key=USER_KEY, admin_key=ADMIN_KEY) as client:
            for name in {a["name"] for a in await client.list_loras()}:
                await client.unload_lora(name)
            await client.load_lora("tenant", adapters["alpha"])
            listed = {a["name"]: a for a in await client.list_loras()}
            assert listed["tenant"]["path"] == adapters["alpha"]
            want, _ = peft_greedy(peft, "alpha", PROMPTS[0], MAX_TOKENS)
            assert await greedy(client, PROMPTS[0], "tenant") == want
            # the adapter-only update: gamma's tensors become tenant's next version
            (before,) = await client.generate(PROMPTS[0], lora="tenant", max_tokens=3)
            assert before.lora_versions == [listed["tenant"]["version"]] * 3
            version = await client.update_lora("tenant", peft_tensors(adapters["gamma"]))
            assert version == listed["tenant"]["version"] + 1
            for prompt in PROMPTS:
                want, _ = peft_greedy(peft, "gamma", prompt, MAX_TOKENS)
                assert await greedy(client, prompt, "tenant") == want
            (after,) = await client.generate(PROMPTS[0], lora="tenant", max_tokens=3)
            (base,) = await client.generate(PROMPTS[0], max_tokens=3)
            assert (after.lora_versions, base.lora_versions) == ([version] * 3, None)
            # beta is rank 8: its shapes are not tenant's; refused, tenant unchanged
            with pytest.raises(ValueError):
                await client.update_lora("tenant", peft_tensors(adapters["beta"]))
            renamed = [
                (n.replace("q_proj", "qq_proj"), t) for n, t in peft_tensors(adapters["alpha"])
            ]
            with pytest.raises(ValueError):
                await client.update_lora("tenant", renamed)
            assert {a["name"]: a for a in await client.list_loras()}["tenant"]["version"] == version
            want, _ = peft_greedy(peft, "gamma", PROMPTS[0], MAX_TOKENS)
            assert await greedy(client, PROMPTS[0], "tenant") == want
            # base model requests are untouched throughout
            want, _ = peft_greedy(peft, None, PROMPTS[0], MAX_TOKENS)
            assert await greedy(client, PROMPTS[0], None) == want
            await client.unload_lora("tenant")
            assert "tenant" not in {a["name"] for a in await client.list_loras()}

    asyncio.run(scenario())


# --- sessions opened on an adapter ------------------------------------------------------------


def test_a_session_opened_on_an_adapter_runs_every_turn_on_it(admin, user, peft):
    session = user.post("/sessions", json={"metadata": {"lora": "beta"}}).json()["session_id"]
    history: list[dict] = []  # each turn sends the conversation so far
    for text in ("hello there", "and again"):
        history.append({"role": "user", "content": text})
        turn = {"messages": history, "max_tokens": MAX_TOKENS, "temperature": 0}
        resp = user.post(f"/sessions/{session}/v1/chat/completions", json=turn)
        assert resp.status_code == 200, resp.text
        history.append(resp.json()["choices"][0]["message"])
    sample = user.post(f"/sessions/{session}/samples").json()
    tokens, mask = sample["tokens"], sample["loss_mask"]
    starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
    assert len(starts) == 2  # two replies, each generated on beta from all that came before
    on_base = []
    for start in starts:
        end = next((i for i in range(start, len(mask)) if not mask[i]), len(mask))
        expected, _ = peft_greedy(peft, "beta", tokens[:start], end - start)
        assert tokens[start:end] == expected
        on_base.append(peft_greedy(peft, None, tokens[:start], end - start)[0] == expected)
    assert not all(on_base)  # the premise: the base model would have answered otherwise


def test_a_session_on_an_unknown_adapter_is_refused(admin, user):
    resp = user.post("/sessions", json={"metadata": {"lora": "nope"}})
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "NotFoundError"
