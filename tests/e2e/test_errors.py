"""Bad input gets a 4xx with the OpenAI error body; busy and failed replicas get 429 / 503."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from raylane.actors.engine.errors import RequestFailed
from raylane.router.errors import ReplicaFailed, ReplicasBusy

from tests.e2e.conftest import MAX_BODY, MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def assert_error(
    response: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    # OpenAI's error types by status: the client's fault, its rate, or the server's
    want = (
        "invalid_request_error"
        if status < 429
        else "rate_limit_error"
        if status == 429
        else "server_error"
    )
    assert error["type"] == want, error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, "messages"),
        ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
        ("/v1/chat/completions", {**CHAT, "n": 129}, "n"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 10_000}, "max_tokens"),
        (
            "/v1/chat/completions",
            {**CHAT, "max_completion_tokens": 10_000},
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
        ("/v1/completions", {**COMPLETION, "max_tokens": "2"}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "prompt": [1.5]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": "x" * 2000}, "prompt"),
        ("/v1/completions", {**COMPLETION, "n": True}, "n"),
        (
            "/v1/completions",
            {**COMPLETION, "echo": True, "max_tokens": 0, "min_tokens": 1},
            "min_tokens",
        ),
        ("/v1/completions", {**COMPLETION, "stop": ["s"] * 65}, "stop"),  # caps against floods
        ("/v1/chat/completions", {**CHAT, "stop_token_ids": [1] * 1025}, "stop_token_ids"),
        (
            "/v1/chat/completions",
            {**CHAT, "logit_bias": {str(i): 1.0 for i in range(1025)}},
            "logit_bias",
        ),
        ("/generate", {"text": "hi", "sampling_params": {"stop": ["s"] * 65}}, "sampling_params"),
        # these pass the schema and are refused by the engine (its ValueError names the field)
        ("/v1/completions", {**COMPLETION, "temperature": -1}, "temperature"),
        ("/v1/completions", {**COMPLETION, "top_p": 0}, "top_p"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "logprobs": 50}, "logprobs"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 10**6]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "stream": True, "prompt": [10**6]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "return_routed_experts": True}, "return_routed_experts"),
        ("/generate", {"text": "hi", "sampling_params": {"max_tokens": 3}}, "sampling_params"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 10_000}},
            "max_new_tokens",
        ),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
        ("/generate", {"input_ids": [10**6]}, "input_ids"),
        ("/generate", {"input_ids": []}, "input_ids"),
        ("/generate", {"text": "a", "input_ids": [1]}, "input_ids"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ],
)
def test_bad_input_is_400_naming_the_field(http, route, body, param):
    assert_error(http.post(route, json=body), 400, param)


@pytest.mark.parametrize("raw", [b"{", b"", b"[1, 2]", b"null", b'{"model": "tiny",}'])
def test_malformed_json_is_400(http, raw):
    response = http.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert_error(response, 400)


def test_unknown_model_is_404(client, http):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=CHAT["messages"])
    assert err.value.code == "model_not_found"
    assert_error(
        http.post("/v1/completions", json={**COMPLETION, "model": "x"}),
        404,
        "model",
        "model_not_found",
    )


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)


def test_oversized_body_is_413(http):
    big = json.dumps({**COMPLETION, "prompt": "x" * MAX_BODY}).encode()
    assert_error(
        http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413
    )

    def chunks():  # no Content-Length: the server must count what actually arrives
        for i in range(0, len(big), 64 << 10):
            yield big[i : i + 64 << 10]

    response = http.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert "content-length" not in response.request.headers
    assert_error(response, 413)
    assert http.get("/v1/models").status_code == 200  # the server is fine afterwards


def test_api_keys(server, http):
    no_key = httpx.post(server.url + "/v1/completions", json=COMPLETION)
    assert_error(no_key, 401, code="invalid_api_key")
    for header in (
        "Bearer wrong",
        "Basic sk-raylane-test",
        "Bearer sk-raylane-tes",
        "sk-raylane-test",
    ):
        response = httpx.get(server.url + "/v1/models", headers={"Authorization": header})
        error = assert_error(response, 401)
        assert "wrong" not in error["message"]
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # open for probes
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    other = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer another-key"})
    assert other.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_queue_full_is_429_with_retry_after(http, client, probe, stream):
    probe.fail = ReplicasBusy("every engine replica is busy; retry later")
    response = http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    error = assert_error(response, 429, code="rate_limit_exceeded")
    assert error["type"] == "rate_limit_error"
    assert response.headers["retry-after"] == "1"
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_replica_failure_is_503(http, probe):
    probe.fail = ReplicaFailed("engine replica died")
    assert_error(http.post("/v1/completions", json=COMPLETION), 503)
    assert_error(http.post("/generate", json={"text": "hi"}), 503)
    probe.fail_after_first = True
    assert_error(http.post("/v1/completions", json={**COMPLETION, "max_tokens": 5}), 503)


def test_a_failed_step_is_500_and_keeps_the_connection(http, probe):
    """A keep-alive client's connection survives a 500: uvicorn closes the connection of an app
    that raised, so the error must be answered, not re-raised past the app."""

    def client_port(response: httpx.Response) -> int:
        return response.extensions["network_stream"].get_extra_info("client_addr")[1]

    first = http.post("/v1/completions", json=COMPLETION)
    probe.fail = RequestFailed("request x: the engine step failed: injected")
    failed = http.post("/v1/completions", json=COMPLETION)
    assert_error(failed, 500, code="request_failed")
    probe.fail = None
    after = http.post("/v1/completions", json=COMPLETION)
    assert first.status_code == after.status_code == 200
    assert client_port(first) == client_port(failed) == client_port(after)


def test_replica_failure_mid_stream_ends_the_stream_cleanly(http, probe, engine):
    probe.fail, probe.fail_after_first = ReplicaFailed("engine replica died"), True
    body = {**CHAT, "max_tokens": 50, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = [line[len("data: ") :] for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2])
    assert json.loads(events[-2])["error"]["code"] == "replica_failed"


def test_health_follows_backend_readiness(server, probe):
    assert httpx.get(server.url + "/health").status_code == 200
    probe.is_ready = False
    assert_error(httpx.get(server.url + "/health"), 503)
