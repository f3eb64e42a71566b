"""`raylane serve` started as a user would, driven by the official openai client."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from tests.ray.conftest import free_port, streamed_and_whole_chat


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "raylane")
    proc = subprocess.Popen(
        [
            exe,
            "serve",
            "--model",
            tiny_llama_dir,
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = _wait_for(proc, "raylane is serving", timeout_s=240)
    url = f"http://127.0.0.1:{port}"
    assert url in "".join(lines)
    proc.output = drain(proc, lines)
    yield url, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def drain(proc: subprocess.Popen, lines: list[str]) -> list[str]:
    """Keep reading the server's output into `lines` (a full pipe would block its writes)."""

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _wait_for(proc: subprocess.Popen, marker: str, timeout_s: float) -> list[str]:
    lines: list[str] = []
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail("raylane serve exited early:\n" + "".join(lines) + proc.stdout.read())
        if sel.select(timeout=1):
            line = proc.stdout.readline()
            lines.append(line)
            if marker in line:
                return lines
    pytest.fail("raylane serve did not become ready:\n" + "".join(lines))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_lists_the_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_streamed_equals_not_streamed(client):
    text, full = streamed_and_whole_chat(client, "hello world", 10)
    assert text == full.choices[0].message.content
    assert full.usage.completion_tokens == 10 or full.choices[0].finish_reason == "stop"


def test_completion_logprobs_n_and_seed(client):
    out = client.completions.create(
        model="tiny",
        prompt="the quick brown",
        max_tokens=6,
        n=2,
        temperature=1.0,
        seed=7,
        logprobs=2,
    )
    assert len(out.choices) == 2
    assert all(len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) for c in out.choices)
    again = client.completions.create(
        model="tiny",
        prompt="the quick brown",
        max_tokens=6,
        n=2,
        temperature=1.0,
        seed=7,
        logprobs=2,
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]


def test_stop_is_honoured(client):
    base = client.completions.create(model="tiny", prompt="hello", max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("the tiny model produced no visible text to stop on")
    out = client.completions.create(
        model="tiny", prompt="hello", max_tokens=16, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == text[: text.find(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_bad_requests_get_openai_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=10**7)


def test_ctrl_c_shuts_down_cleanly(server):
    _, proc = server
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # it dumps every thread's stack
        time.sleep(2)
        pytest.fail("raylane serve did not stop on Ctrl-C:\n" + "".join(proc.output))
    assert code == 0, "".join(proc.output)
