"""Every session route answers 503 with the OpenAI error body, never a 500, while the Router
actor is dead or restarting — including a turn whose stream reports the Router's death."""

from __future__ import annotations

import httpx
import pytest
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError
from raylane.router.session_host import SessionSetup
from raylane.serve_backend import serve_backend
from raylane.session_server.app import build_app
from raylane.session_server.backend import ModelInfo

from tests.tiny_models import make_tokenizer


class FailedRef:
    def __init__(self, error: Exception):
        self.error = error

    def __await__(self):
        raise self.error
        yield  # an awaitable


class DeadStream:
    """A streaming call to a dead actor: its first ref fails (`in_stream`) or the stream
    itself does."""

    def __init__(self, error: Exception, in_stream: bool):
        self.error, self.in_stream = error, in_stream

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.in_stream:
            raise self.error
        return FailedRef(self.error)


class DeadMethod:
    def __init__(self, error: Exception, in_stream: bool):
        self.error, self.in_stream = error, in_stream

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        return (
            DeadStream(self.error, self.in_stream)
            if self.in_stream is not None
            else FailedRef(self.error)
        )


class DeadRouter:
    def __init__(self, error: Exception, in_stream: bool):
        self.error, self.in_stream = error, in_stream

    def __getattr__(self, name: str) -> DeadMethod:
        return DeadMethod(self.error, self.in_stream if name == "session_turn" else None)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


CASES = [
    (ActorDiedError(), False),
    (ActorDiedError(), True),
    (ActorUnavailableError("the Router restarts", None), True),
]


@pytest.mark.parametrize("error,in_stream", CASES, ids=["died-ref", "died-stream", "restarting"])
@pytest.mark.parametrize("stream", [False, True])
async def test_session_routes_answer_503(tok, monkeypatch, error, in_stream, stream):
    cancelled = []
    monkeypatch.setattr(ray, "cancel", cancelled.append)
    backend = serve_backend(
        DeadRouter(error, in_stream), tok, ModelInfo("tiny", 512, len(tok)), SessionSetup("tiny")
    )
    transport = httpx.ASGITransport(app=build_app(backend))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        calls = [
            http.post("/sessions"),
            http.get("/sessions/sess-x"),
            http.delete("/sessions/sess-x"),
            http.post("/sessions/sess-x/samples"),
            http.post(
                "/sessions/sess-x/v1/chat/completions",
                json={
                    "model": "tiny",
                    "stream": stream,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            ),
        ]
        for call in calls:
            response = await call
            assert response.status_code == 503, response.text
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert len(cancelled) == 1  # the failed turn was cancelled in the Router too
