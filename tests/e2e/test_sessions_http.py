"""Multi-turn sessions over HTTP (`local_backend`, tiny Qwen3-MoE with routed-expert capture).

Agents are the official `openai` client pointed at `/sessions/{id}/v1`; the reference is a second
engine run directly on each turn's prompt ids (greedy), and the chat template itself for the
first turn.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from raylane.router.samples import TrainingSample
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.server import ServerThread
from tests.unit.sessions_helpers import rendered, user
from tests.unit.test_sessions_engine import TOOLS, TURNS  # the same 5-turn tool conversation

KEY = "sk-sessions"
MODEL = "tiny-moe"
MAX_TOKENS = 8


def moe_config(model_dir: str) -> EngineConfig:
    return EngineConfig(
        model=model_dir, num_kv_blocks=256, max_model_len=1024, enable_return_routed_experts=True
    )


@pytest.fixture(scope="module")
def server(tiny_moe_dir) -> Iterator[ServerThread]:
    backend = local_backend(AsyncLLMEngine(LLMEngine(moe_config(tiny_moe_dir))), MODEL)
    with ServerThread(build_app(backend, api_keys=[KEY])) as srv:
        yield srv


@pytest.fixture(scope="module")
def ref(tiny_moe_dir) -> LLMEngine:
    return LLMEngine(moe_config(tiny_moe_dir))


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {KEY}"}
    ) as client:
        yield client


class Agent:
    """An agent on one session: the openai client at the session's base URL, keeping the
    conversation client-side and echoing each reply back."""

    def __init__(self, server: ServerThread, http: httpx.Client, **metadata) -> None:
        resp = http.post("/sessions", json={"metadata": metadata} if metadata else None)
        assert resp.status_code == 200, resp.text
        self.id = resp.json()["session_id"]
        self.http = http
        self.client = openai.OpenAI(
            base_url=f"{server.url}/sessions/{self.id}/v1", api_key=KEY, max_retries=0, timeout=30
        )
        self.messages: list[dict] = []

    def chat(self, messages: list[dict], **kwargs):
        kwargs = {"temperature": 0, "max_tokens": MAX_TOKENS, **kwargs}
        return self.client.chat.completions.create(model=MODEL, messages=messages, **kwargs)

    def say(self, *new: dict, **kwargs):
        self.messages += new
        resp = self.chat(self.messages, **kwargs)
        self.messages.append(resp.choices[0].message.model_dump(exclude_none=True))
        return resp

    def describe(self) -> dict:
        resp = self.http.get(f"/sessions/{self.id}")
        assert resp.status_code == 200, resp.text
        return resp.json()


def reference(engine: LLMEngine, prompt_ids: list[int]):
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, logprobs=0, return_routed_experts=True
    )
    return engine.generate([prompt_ids], params, use_tqdm=False)[0].outputs[0]


def decode(routed: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(routed["data"]), dtype="<i4").reshape(routed["shape"])


def test_five_turns_with_tools_merge_to_what_the_engine_generates(server, http, ref):
    agent = Agent(server, http, task="weather")
    replies = [
        agent.say(
            *new,
            tools=TOOLS,
            logprobs=True,
            extra_body={"return_token_ids": True, "return_routed_experts": True},
        )
        for new in TURNS
    ]
    session = agent.describe()
    assert session["metadata"] == {"task": "weather"} and session["num_turns"] == 5
    records = session["records"]
    assert records[0]["prompt_ids"] == rendered(ref.tokenizer, TURNS[0], tools=TOOLS)
    tokens, mask, logprobs = [], [], []
    for resp, record in zip(replies, records):
        prompt = tokens + record["prompt_ids"]  # what the model saw: everything so far + new
        want = reference(ref, prompt)
        choice = resp.choices[0]
        assert choice.model_extra["token_ids"] == want.token_ids
        assert choice.message.content == want.text
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
            want.logprobs, abs=1e-4
        )
        assert "routed_experts" not in choice.model_extra  # the reply omits replay blobs
        assert resp.usage.prompt_tokens == len(prompt)
        tokens = prompt + want.token_ids
        mask += [0] * len(record["prompt_ids"]) + [1] * len(want.token_ids)
        logprobs += [0.0] * len(record["prompt_ids"]) + want.logprobs
    sample = http.post(f"/sessions/{agent.id}/samples").json()
    assert sample["tokens"] == tokens
    assert sample["loss_mask"] == mask
    assert sample["rollout_logprobs"] == pytest.approx(logprobs, abs=1e-4)
    routed = decode(sample["routed_experts"])
    assert routed.shape == (len(tokens) - 1, 2, 2)  # 2 MoE layers, top-2
    np.testing.assert_array_equal(routed, want.routed_experts)  # the final turn's own routing
    assert sample["status"] == ("truncated" if want.finish_reason == "length" else "completed")
    assert sample["weight_versions"] == [0] * 5


def test_streamed_turn_is_the_engines_and_continues_the_session(server, http, ref):
    agent = Agent(server, http)
    agent.messages = [user("Tell me a story.")]
    chunks = list(agent.chat(agent.messages, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    record = agent.describe()["records"][0]
    assert record["prompt_ids"] == rendered(ref.tokenizer, agent.messages)
    want = reference(ref, record["prompt_ids"])
    assert text == want.text and record["output_ids"] == want.token_ids
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    agent.messages.append({"role": "assistant", "content": text})
    agent.say(user("Go on."))
    assert agent.describe()["num_turns"] == 2


def test_retrying_the_last_turn_replaces_it(server, http):
    agent = Agent(server, http)
    agent.say(user("first"))
    agent.say(user("second"))
    before = agent.describe()["records"]
    retry = agent.messages[:-2] + [user("second, again")]
    agent.chat(retry)
    after = agent.describe()["records"]
    assert len(after) == 2 and after[0] == before[0]
    assert after[1]["new_messages"] == [user("second, again")]
    assert after[1]["prefix_len"] == before[1]["prefix_len"]


def test_two_step_rollback_is_a_400_and_leaves_the_session_unchanged(server, http):
    agent = Agent(server, http)
    agent.say(user("first"))
    agent.say(user("second"))
    before = agent.describe()
    with pytest.raises(openai.BadRequestError) as err:
        agent.chat([user("a different first message")])
    assert err.value.body["code"] == "rollback_too_deep"
    assert err.value.body["param"] == "messages"
    assert agent.describe() == before


@pytest.mark.parametrize("method,path", [("GET", ""), ("DELETE", ""), ("POST", "/samples")])
def test_unknown_session_is_404(http, method, path):
    resp = http.request(method, f"/sessions/sess-unknown{path}")
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "session_not_found"
    assert "sess-unknown" in resp.json()["error"]["message"]


def test_chat_after_delete_is_404(server, http):
    agent = Agent(server, http)
    agent.say(user("hello"))
    assert http.delete(f"/sessions/{agent.id}").json() == {"session_id": agent.id, "deleted": True}
    with pytest.raises(openai.NotFoundError):
        agent.say(user("still there?"))
    assert http.get(f"/sessions/{agent.id}").status_code == 404
    assert http.delete(f"/sessions/{agent.id}").status_code == 404


def test_malformed_trajectory_is_422_with_the_reason(server, http):
    agent = Agent(server, http)
    resp = http.post(f"/sessions/{agent.id}/samples")
    assert resp.status_code == 422 and "no turns" in resp.json()["error"]["message"]
    agent.say(user("hello"))
    resp = http.post(f"/sessions/{agent.id}/samples", json={"max_seq_len": 2})
    assert resp.status_code == 422 and "max_seq_len=2" in resp.json()["error"]["message"]


@pytest.mark.parametrize("accept", ["application/octet-stream", "application/safetensors"])
def test_safetensors_sample_round_trips(server, http, accept):
    agent = Agent(server, http)
    agent.say(user("hello"))
    agent.say({"role": "tool", "content": "42"})
    as_json = http.post(f"/sessions/{agent.id}/samples").json()
    resp = http.post(f"/sessions/{agent.id}/samples", headers={"Accept": accept})
    assert resp.status_code == 200 and resp.headers["content-type"] == accept
    sample = TrainingSample.from_safetensors(resp.content)
    assert sample.tokens == as_json["tokens"] and sample.loss_mask == as_json["loss_mask"]
    assert sample.rollout_logprobs == pytest.approx(as_json["rollout_logprobs"], abs=1e-6)
    np.testing.assert_array_equal(sample.routed_experts, decode(as_json["routed_experts"]))
    assert sample.weight_versions == as_json["weight_versions"]
    assert sample.status == as_json["status"]


def test_bad_session_chats_are_400s(server, http):
    agent = Agent(server, http)
    for extra in ({"n": 2}, {"logprobs": True, "top_logprobs": 2}):
        with pytest.raises(openai.BadRequestError) as err:
            agent.chat([user("hi")], **extra)
        assert err.value.body["param"] in extra
    assert agent.describe()["num_turns"] == 0


def test_session_routes_need_the_api_key(server):
    resp = httpx.post(server.url + "/sessions", timeout=10)
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "invalid_api_key"
