"""LoRA adapters changed at runtime outlive the replica that served them, and a request may ask
for one version of an adapter. One engine replica with LoRA on: an adapter loaded at runtime
(`RolloutClient.load_lora`) gets a new version pushed as tensors (`update_lora`: only its
B matrices); a `lora_modules` adapter is unloaded. The replica is killed: the one the Router
starts instead holds the pushed version under the same number and label, not the unloaded one,
and serves PEFT's outputs with the pushed tensors. `lora_version` over HTTP (the openai client's
`extra_body`, SGLang's /generate) and from `RolloutClient`: the version held answers its
outputs, one no longer held 409. Reference: PEFT's `PeftModel` over the same base model.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from safetensors.torch import load_file

from tests.lora_adapters import make_adapter, peft_greedy, peft_models, rewritten
from tests.ray.conftest import wait_for, wait_healthy
from tests.ray.replica_helpers import deploy_lora_cluster, replica_actor

pytest.importorskip("peft")
pytest.importorskip("openai")

ADMIN_KEY = "admin-lora-replace"
PROMPTS = [[5, 17, 42, 99, 7], [9, 8, 7, 6, 5, 4]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_replace")
    v1 = make_adapter(tiny_llama_dir, root / "v1", seed=31, r=4)
    # the pushed version: v1 with its B matrices changed (what the test sends, and PEFT's copy)
    pushed, _ = rewritten(v1, root / "pushed", lambda n, t: -1.5 * t if "lora_B" in n else t)
    gone = make_adapter(tiny_llama_dir, root / "gone", seed=33, r=4)
    return {"v1": v1, "pushed": pushed, "gone": gone}


@pytest.fixture(scope="module")
def peft(tiny_llama_dir, adapters):
    return peft_models(tiny_llama_dir, {k: adapters[k] for k in ("v1", "pushed")})


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_llama_dir, adapters) -> str:
    modules = {"gone": adapters["gone"]}
    return deploy_lora_cluster(tiny_llama_dir, 1, ADMIN_KEY, modules)


def listed(ray, replica_id: str) -> dict[str, dict]:
    """The replica's adapters as it lists them itself, by name."""
    return {a["name"]: a for a in ray.get(replica_actor(ray, replica_id).list_loras.remote())}


def native(url: str, prompt: list[int], version: int | None = None) -> httpx.Response:
    body = {
        "input_ids": prompt,
        "lora_path": "policy",
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    if version is not None:
        body["lora_version"] = version
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def greedy(url: str, version: int | None = None) -> list[list[int]]:
    outs = []
    for prompt in PROMPTS:
        answer = native(url, prompt, version)
        assert answer.status_code == 200, answer.text
        outs.append(answer.json()["output_ids"])
    return outs


def expected(peft, adapter: str) -> list[list[int]]:
    return [peft_greedy(peft, adapter, p, MAX_TOKENS)[0] for p in PROMPTS]


def pushed_tensors(adapters) -> list:
    tensors = load_file(f"{adapters['pushed']}/adapter_model.safetensors")
    return sorted((n, t) for n, t in tensors.items() if "lora_B" in n)


async def _client(url: str | None, verb: str, *args, **kwargs):
    """`RolloutClient`'s `verb` over HTTP (`url`), or in the cluster (None)."""
    from raylane.client import RolloutClient

    make = RolloutClient.in_cluster if url is None else RolloutClient
    async with make() if url is None else make(url, admin_key=ADMIN_KEY) as client:
        return await getattr(client, verb)(*args, **kwargs)


def client_greedy(url: str | None, version: int) -> list[int]:
    (out,) = asyncio.run(
        _client(
            url,
            "generate",
            PROMPTS[0],
            lora="policy",
            lora_version=version,
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
        )
    )
    return list(out.token_ids)


def openai_greedy(url: str, version: int) -> list[int]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(
        model="policy",
        prompt=PROMPTS[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"lora_version": version, "ignore_eos": True, "return_token_ids": True},
    )
    return list(answer.choices[0].model_extra["token_ids"])


def test_runtime_adapters_reach_a_replacement_and_versions_are_asked_for(
    cluster, ray_cluster, adapters, peft
):
    import openai
    from raylane.actors.lora.errors import LoRAVersionGone
    from raylane.client.errors import ClientError

    url, ray = cluster, ray_cluster
    (first,) = wait_healthy(ray, 1)
    asyncio.run(_client(url, "load_lora", "policy", adapters["v1"]))
    asyncio.run(_client(url, "unload_lora", "gone"))
    v1 = listed(ray, first)["policy"]["version"]
    assert greedy(url, v1) == expected(peft, "v1")  # version 1, held: its outputs
    assert client_greedy(url, v1) == expected(peft, "v1")[0]
    version = asyncio.run(
        _client(url, "update_lora", "policy", pushed_tensors(adapters), version="step-3")
    )
    assert version == v1 + 1
    assert expected(peft, "pushed") != expected(peft, "v1")  # the push changes the outputs
    before = listed(ray, first)["policy"]
    assert greedy(url) == expected(peft, "pushed")

    # asking for a version: the newest by number, and the replaced one is a 409
    assert openai_greedy(url, version) == expected(peft, "pushed")[0]
    assert client_greedy(url, version) == expected(peft, "pushed")[0]
    assert native(url, PROMPTS[0], version).json()["output_ids"] == expected(peft, "pushed")[0]
    gone = native(url, PROMPTS[0], v1)
    assert gone.status_code == 409, gone.text
    assert gone.json()["error"]["code"] == 409
    with pytest.raises(openai.ConflictError):
        openai_greedy(url, v1)
    with pytest.raises(ClientError) as refused:
        client_greedy(url, v1)
    assert refused.value.status == 409
    assert client_greedy(None, version) == expected(peft, "pushed")[0]  # in the cluster
    with pytest.raises(LoRAVersionGone):
        client_greedy(None, v1)

    # the replica is killed; the one started instead serves what the runtime changes made
    ray.kill(replica_actor(ray, first), no_restart=True)

    def others() -> list[str]:
        from raylane.router.names import NAMESPACE, ROUTER_NAME

        router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        replicas = ray.get(router.replicas.remote())
        return [r["replica_id"] for r in replicas if r["healthy"] and r["replica_id"] != first]

    wait_for(lambda: bool(others()), 300, "the Router to replace the killed replica", 1.0)
    (second,) = others()
    # the ingress learns of the new replica from the Router's table (about twice a second)
    wait_for(lambda: native(url, PROMPTS[0]).status_code != 503, 60, "the ingress to route")
    now = listed(ray, second)
    assert "gone" not in now  # unloaded at runtime: not loaded again from lora_modules
    kept = ("path", "version", "version_label", "rank")
    assert [now["policy"][k] for k in kept] == [before[k] for k in kept]
    assert now["policy"]["version_label"] == "step-3"
    assert greedy(url) == expected(peft, "pushed")
    assert greedy(url, version) == expected(peft, "pushed")
    assert native(url, PROMPTS[0], v1).status_code == 409


async def _session_turn(model: str, version: int):
    """One turn of a new in-cluster session on "tenant", asking for `version`."""
    from raylane.client import RolloutClient

    async with RolloutClient.in_cluster(model=model) as client:
        session = await client.session(metadata={"lora": "tenant"})
        hello = [{"role": "user", "content": "hi"}]
        return await session.chat(hello, lora_version=version, max_tokens=2, temperature=0)


def test_a_restarted_router_recalls_runtime_adapters_from_its_replicas(
    cluster, ray_cluster, adapters, peft, tiny_llama_dir
):
    """The Router restarts (Ray restarts the killed actor: it remembers nothing); it recalls
    from the live replica an adapter loaded and pushed at runtime (its tensors read back) and
    the `lora_modules` adapter unloaded, so the replica it starts instead of the killed one
    holds the pushed version under its number and label, serves PEFT's tokens, and does not
    hold the unloaded one. Before that, a session turn asks for versions of its adapter across
    the cluster (the turn's tokens generated at the ingress)."""
    from raylane.actors.lora.errors import LoRAVersionGone
    from raylane.router.names import NAMESPACE, ROUTER_NAME

    url, ray = cluster, ray_cluster
    (first,) = wait_healthy(ray, 1)
    if "gone" in listed(ray, first):  # this test alone: unload it here
        asyncio.run(_client(url, "unload_lora", "gone"))
    asyncio.run(_client(url, "load_lora", "tenant", adapters["v1"]))
    pushed = asyncio.run(_client(url, "update_lora", "tenant", pushed_tensors(adapters), "s7"))
    before = listed(ray, first)["tenant"]
    assert (before["version"], before["version_label"]) == (pushed, "s7") == (2, "s7")
    session = httpx.post(f"{url}/sessions", json={"metadata": {"lora": "tenant"}}, timeout=60)
    turn = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    turns = f"{url}/sessions/{session.json()['session_id']}/v1/chat/completions"
    assert httpx.post(turns, json={**turn, "lora_version": 1}, timeout=60).status_code == 409
    assert httpx.post(turns, json={**turn, "lora_version": 2}, timeout=60).status_code == 200
    assert len(asyncio.run(_session_turn(tiny_llama_dir, 2)).token_ids) == 2  # in the cluster too
    with pytest.raises(LoRAVersionGone):
        asyncio.run(_session_turn(tiny_llama_dir, 1))

    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    ray.kill(router, no_restart=False)

    def remembered() -> dict[str, dict]:
        try:  # the restarted Router, once it answers and has recalled from the replica
            rows = ray.get(router.control.remote("remembered_loras"), timeout=60)
        except Exception:
            return {}
        return {r["name"]: r for r in rows}

    wait_for(lambda: "tenant" in remembered(), 120, "the restarted Router to recall", 1.0)
    recalled = remembered()["tenant"]
    assert (recalled["version"], recalled["label"], recalled["tensors"]) == (2, "s7", True)

    ray.kill(replica_actor(ray, first), no_restart=True)

    def others() -> list[str]:
        rows = ray.get(router.replicas.remote())
        return [r["replica_id"] for r in rows if r["healthy"] and r["replica_id"] != first]

    wait_for(lambda: bool(others()), 300, "the restarted Router to replace the replica", 1.0)
    (second,) = others()
    now = listed(ray, second)
    assert "gone" not in now
    kept = ("path", "version", "version_label", "rank")
    assert [now["tenant"][k] for k in kept] == [before[k] for k in kept]
    body = {
        "input_ids": PROMPTS[0],
        "lora_path": "tenant",
        "lora_version": 2,
        "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    }

    def served() -> httpx.Response:
        return httpx.post(f"{url}/generate", json=body, timeout=120)

    wait_for(lambda: served().status_code != 503, 60, "the ingress to route to the new replica")
    answer = served()
    assert answer.status_code == 200, answer.text
    assert answer.json()["output_ids"] == expected(peft, "pushed")[0]
    # its heartbeat reports the versions it holds (what version-asking requests route by)
    wait_for(
        lambda: any(
            r["lora_versions"].get("tenant") == [2] for r in ray.get(router.replicas.remote())
        ),
        30,
        "the new replica's heartbeat",
    )
