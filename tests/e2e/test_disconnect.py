"""A client that goes away mid-request aborts it: the engine finishes nothing, frees every block."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import API_KEY

LONG_CHAT = {
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 200,
    "ignore_eos": True,
}


def wait_until_idle(engine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.has_unfinished_requests():
            break
        time.sleep(0.02)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/chat/completions", {**LONG_CHAT, "stream": True, "n": 2}),
        (
            "/v1/completions",
            {
                "prompt": ["a story", "another"],
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": True,
            },
        ),
        (
            "/generate",
            {
                "text": "a story",
                "stream": True,
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
            },
        ),
    ],
)
def test_disconnect_mid_stream_aborts(http, engine, route, body):
    # NOTE: the engine can outrun a reader slowed by warm-up or load and finish before the
    # client leaves; then nothing was left to abort, so the stream is tried again
    prompts = len(body.get("prompt", [None])) if isinstance(body.get("prompt"), list) else 1
    for _ in range(5):
        aborted = engine.stats.finished["abort"]
        with http.stream("POST", route, json=body) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
        wait_until_idle(engine)
        if engine.stats.finished["abort"] == aborted + prompts:
            break
    assert engine.stats.finished["abort"] == aborted + prompts  # every one left was aborted


def test_disconnect_while_waiting_for_a_full_response_aborts(server, engine):
    aborted = engine.stats.finished["abort"]
    body = {**LONG_CHAT, "max_tokens": 220, "n": 6}  # about a second of work
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/chat/completions",
            json=body,
            timeout=0.3,
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
    wait_until_idle(engine)
    assert engine.stats.finished["abort"] == aborted + 1
