"""A Router actor that died (or restarts) is a 503 with the OpenAI error body, never a 500:
the ingress maps Ray's actor errors from every Router call on the request path."""

from __future__ import annotations

import httpx
import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError
from raylane.router.errors import ReplicaFailed
from raylane.router.session_host import SessionSetup
from raylane.serve_backend import serve_backend
from raylane.session_server.app import build_app
from raylane.session_server.backend import ModelInfo


class DeadMethod:
    def __init__(self, error: Exception):
        self.error = error

    def remote(self, *args, **kwargs):
        async def fail():
            raise self.error

        return fail()


class DeadRouter:
    """Every method of the Router handle fails as a dead or restarting actor's would."""

    def __init__(self, error: Exception):
        self.error = error

    def __getattr__(self, name: str) -> DeadMethod:
        return DeadMethod(self.error)


ERRORS = [ActorDiedError(), ActorUnavailableError("the Router restarts", None)]


@pytest.mark.parametrize("error", ERRORS, ids=["died", "restarting"])
async def test_generate_is_replica_failed_and_not_ready(error):
    info, setup = ModelInfo("tiny", 512, 256), SessionSetup("tiny")
    backend = serve_backend(DeadRouter(error), None, info, setup)
    with pytest.raises(ReplicaFailed):
        async for _ in backend.generate([1, 2, 3], None, "r1"):
            pass
    assert await backend.ready() is False


@pytest.mark.parametrize("error", ERRORS, ids=["died", "restarting"])
async def test_http_answers_503_with_the_error_body(error):
    info, setup = ModelInfo("tiny", 512, 256), SessionSetup("tiny")
    backend = serve_backend(DeadRouter(error), None, info, setup)
    transport = httpx.ASGITransport(app=build_app(backend))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.post("/generate", json={"input_ids": [1, 2, 3]})
        assert response.status_code == 503, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert (await http.get("/health")).status_code == 503
