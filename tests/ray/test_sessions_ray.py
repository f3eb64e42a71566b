"""Sessions through the deployed app on a local Ray cluster: the Router hosts the registry and
runs each turn on the session's replica (two replicas of the tiny Qwen3-MoE)."""

from __future__ import annotations

import base64
import time

import httpx
import numpy as np
import openai
import pytest
from raylane.router.actor import NAMESPACE, ROUTER_NAME

from tests.ray.conftest import free_port
from tests.ray.replica_helpers import counts_after, routed_counts

MODEL = "tiny-moe"
ENGINE = {
    "num_kv_blocks": 128,
    "max_num_seqs": 8,
    "max_model_len": 1024,
    "enable_return_routed_experts": True,
}


@pytest.fixture(scope="module")
def moe_served(ray_cluster, tiny_moe_dir) -> str:
    from raylane import launch
    from raylane.config import ClusterConfig

    config = ClusterConfig(
        model=tiny_moe_dir,
        served_model_name=MODEL,
        replicas=2,
        port=free_port(),
        torch_threads=1,
        engine=ENGINE,
    )
    return launch.deploy(config)


def new_session(url: str) -> tuple[str, openai.OpenAI]:
    resp = httpx.post(f"{url}/sessions", json={"metadata": {"run": 1}}, timeout=30)
    assert resp.status_code == 200, resp.text
    session_id = resp.json()["session_id"]
    client = openai.OpenAI(
        base_url=f"{url}/sessions/{session_id}/v1", api_key="none", max_retries=0, timeout=60
    )
    return session_id, client


def chat(client: openai.OpenAI, messages: list[dict], **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 6, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def test_session_turns_stick_to_one_replica_and_merge(moe_served, ray_cluster, tiny_moe_dir):
    from raylane.actors.engine import EngineConfig, LLMEngine, SamplingParams

    url = moe_served
    session_id, client = new_session(url)
    before = routed_counts(ray_cluster)
    messages = [{"role": "user", "content": "Weather in Berlin?"}]
    for turn in range(3):
        if turn == 1:  # one streamed turn: the Router's streaming method end to end
            chunks = list(chat(client, messages, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = chat(client, messages).choices[0].message.content
        messages += [
            {"role": "assistant", "content": text},
            {"role": "tool", "content": f'{{"temp": {20 + turn}}}'},
        ]
    after = counts_after(ray_cluster, before, 3)
    grew = sorted(after[rid] - before.get(rid, 0) for rid in after)
    assert grew == [0, 3]  # every turn on the same replica

    records = httpx.get(f"{url}/sessions/{session_id}", timeout=30).json()["records"]
    sample = httpx.post(f"{url}/sessions/{session_id}/samples", timeout=30).json()
    prompt = sample["tokens"][: records[-1]["prefix_len"] + len(records[-1]["prompt_ids"])]
    engine = LLMEngine(EngineConfig(model=tiny_moe_dir, enable_return_routed_experts=True))
    want = engine.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=6, return_routed_experts=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert sample["tokens"] == prompt + want.token_ids
    assert sum(sample["loss_mask"]) == sum(len(r["output_ids"]) for r in records)
    routed = sample["routed_experts"]
    data = np.frombuffer(base64.b64decode(routed["data"]), dtype="<i4").reshape(routed["shape"])
    np.testing.assert_array_equal(data, want.routed_experts)


def aborted(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "raylane:request_success_total" and s.labels.get("finished_reason") == "abort"
    )


def test_deleted_session_is_404_and_an_abandoned_stream_leaves_no_trace(moe_served, ray_cluster):
    url = moe_served
    session_id, client = new_session(url)
    aborted_before = aborted(url)
    messages = [{"role": "user", "content": "Tell me a long story."}]
    with chat(
        client, messages, stream=True, max_tokens=1000, extra_body={"ignore_eos": True}
    ) as stream:
        for i, _ in enumerate(stream):
            if i >= 2:
                break  # hang up mid-turn: the ingress cancels the Router's call
    wait_aborted(ray_cluster, url, aborted_before + 1, "the abandoned turn")
    assert httpx.get(f"{url}/sessions/{session_id}", timeout=30).json()["num_turns"] == 0

    chat(client, messages)
    assert httpx.delete(f"{url}/sessions/{session_id}", timeout=30).status_code == 200
    with pytest.raises(openai.NotFoundError) as err:
        chat(client, messages)
    assert err.value.body["code"] == "session_not_found"
    assert httpx.get(f"{url}/sessions/{session_id}", timeout=30).status_code == 404


def wait_aborted(ray_cluster, url: str, count: int, what: str) -> None:
    """Until the replicas' abort counter reaches `count` and the Router holds no request."""
    router = ray_cluster.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    deadline = time.monotonic() + 30
    while (
        any(r["in_flight"] for r in ray_cluster.get(router.replicas.remote()))
        or aborted(url) != count
    ):
        assert time.monotonic() < deadline, f"{what} was not aborted"
        time.sleep(0.2)


def test_a_turn_past_its_deadline_is_aborted_on_its_replica_and_recorded(moe_served, ray_cluster):
    url = moe_served
    session_id, client = new_session(url)
    aborted_before = aborted(url)
    messages = [{"role": "user", "content": "Tell me a long story."}]
    # the body's `timeout` (the openai client's own `timeout=` is its HTTP timeout)
    resp = chat(client, messages, max_tokens=1000, extra_body={"ignore_eos": True, "timeout": 0.3})
    choice = resp.choices[0]
    assert choice.finish_reason == "abort" and resp.usage.completion_tokens < 1000
    wait_aborted(ray_cluster, url, aborted_before + 1, "the turn past its deadline")
    records = httpx.get(f"{url}/sessions/{session_id}", timeout=30).json()["records"]
    assert records[0]["finish_reason"] == "abort"
    assert len(records[0]["output_ids"]) == resp.usage.completion_tokens

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "user", "content": "Go on."},
    ]
    # ignore_eos: the aborted reply's length depends on this machine's speed, and some of
    # those prompts end the tiny model's greedy reply with EOS within 6 tokens
    nxt = chat(client, messages, extra_body={"ignore_eos": True})
    assert nxt.choices[0].finish_reason == "length"
    assert httpx.get(f"{url}/sessions/{session_id}", timeout=30).json()["num_turns"] == 2
