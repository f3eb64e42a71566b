"""A session turn's deadline over HTTP (`local_backend`, tiny Llama): `timeout` in the body, else
the server's `request_timeout_s`. Past it the turn ends with its partial output, finish reason
"abort" (streamed or not), nothing runs on in the engine, the session records the aborted turn
and the next turn carries on after it.

Reference: a second engine run greedily on the turn's prompt ids (the partial output must be
the start of what it generates)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from raylane.session_server.app import build_app
from raylane.session_server.backend import local_backend

from tests.e2e.server import ServerThread
from tests.e2e.test_deadline import LONG, idle

MODEL = "tiny"


def config(model_dir: str) -> EngineConfig:
    return EngineConfig(model=model_dir, num_kv_blocks=128, max_model_len=1024)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    """The engine the server runs (inspected, never stepped, by the tests)."""
    return LLMEngine(config(tiny_llama_dir))


@pytest.fixture(scope="module")
def url(engine) -> Iterator[str]:
    app = build_app(local_backend(AsyncLLMEngine(engine), MODEL), request_timeout_s=0.4)
    with ServerThread(app) as srv:
        yield srv.url


def new_session(url: str) -> str:
    return httpx.post(f"{url}/sessions", timeout=30).json()["session_id"]


def turn(url: str, session_id: str, messages: list[dict], **body) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "temperature": 0, **body}
    return httpx.post(f"{url}/sessions/{session_id}/v1/chat/completions", json=body, timeout=60)


def describe(url: str, session_id: str) -> dict:
    return httpx.get(f"{url}/sessions/{session_id}", timeout=30).json()


def test_past_the_deadline_the_turn_is_aborted_recorded_and_the_next_one_works(
    url, engine, tiny_llama_dir
):
    session_id = new_session(url)
    messages = [{"role": "user", "content": "Tell me a long story."}]
    cut = turn(
        url,
        session_id,
        messages,
        max_tokens=LONG,
        ignore_eos=True,
        timeout=0.15,
        return_token_ids=True,
    ).json()
    choice = cut["choices"][0]
    ids = choice["token_ids"]
    assert choice["finish_reason"] == "abort" and len(ids) < LONG
    assert cut["usage"]["completion_tokens"] == len(ids)
    assert idle(engine)  # aborted on the engine too: nothing runs on

    first = describe(url, session_id)["records"][0]
    assert first["finish_reason"] == "abort" and first["output_ids"] == ids
    if ids:  # the partial output is the start of the greedy one
        ref = LLMEngine(config(tiny_llama_dir))
        want = ref.generate(
            [first["prompt_ids"]],
            SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert want.outputs[0].token_ids == ids

    messages += [choice["message"], {"role": "user", "content": "Go on."}]
    # ignore_eos: the prompt ends where the deadline cut the first turn, which varies from run
    # to run, and the tiny model's greedy reply to some of those ends early (EOS, "stop")
    nxt = turn(url, session_id, messages, max_tokens=4, ignore_eos=True)
    assert nxt.status_code == 200, nxt.text
    assert nxt.json()["choices"][0]["finish_reason"] == "length"
    session = describe(url, session_id)
    second = session["records"][1]
    assert session["num_turns"] == 2 and second["prefix_len"] == len(first["prompt_ids"]) + len(ids)
    sample = httpx.post(f"{url}/sessions/{session_id}/samples", timeout=30).json()
    assert sum(sample["loss_mask"]) == len(ids) + len(second["output_ids"])
    assert sample["status"] == "truncated"  # the last turn hit max_tokens


def test_the_servers_default_deadline_ends_a_streamed_turn_as_abort(url, engine):
    session_id = new_session(url)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }  # no timeout: the 0.4 s
    reasons, text = [], ""
    with httpx.stream(
        "POST", f"{url}/sessions/{session_id}/v1/chat/completions", json=body, timeout=60
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    reasons.append(c["finish_reason"])
                    text += c["delta"].get("content") or ""
    assert reasons[-1] == "abort" and "length" not in reasons
    assert idle(engine)
    session = describe(url, session_id)
    assert session["num_turns"] == 1 and session["records"][0]["finish_reason"] == "abort"
    assert session["messages"][-1] == {"role": "assistant", "content": text}


@pytest.mark.parametrize("bad", [0, -1, "soon"])
def test_a_bad_timeout_is_400(url, bad):
    response = turn(
        url, new_session(url), [{"role": "user", "content": "hi"}], max_tokens=2, timeout=bad
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "timeout"
