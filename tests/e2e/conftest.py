"""One tiny-Llama server for the e2e tests: the real engine behind `build_app`, served by uvicorn
on a free loopback port, with an API key; an independent engine instance as the reference."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing

import httpx
import openai
import pytest
from raylane.actors.engine import AsyncLLMEngine, EngineConfig, LLMEngine
from raylane.session_server.app import build_app
from raylane.session_server.backend import Backend, local_backend

from tests.e2e.admin_helpers import ADMIN_KEY, USER_KEY, keyed_client
from tests.e2e.server import ServerThread

API_KEY = "sk-raylane-test"
MODEL = "tiny"
MAX_BODY = 1 << 20


def tiny_config(model_dir: str, **overrides) -> EngineConfig:
    options = {"num_kv_blocks": 128, "max_model_len": 256, **overrides}
    return EngineConfig(model=model_dir, **options)


class ProbeBackend:
    """The real backend, plus what tests need to see and provoke: the routing keys it was
    given, an error to raise at the start or after the first output, and a readiness switch."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.info = inner.info
        self.tokenizer = inner.tokenizer
        self.control = inner.control
        self.calls: list[tuple[str, str | None]] = []  # (request_id, routing_key)
        self.fail: Exception | None = None
        self.fail_after_first = False
        self.is_ready = True

    async def generate(self, prompt_ids, params, request_id, routing_key=None) -> AsyncIterator:
        self.calls.append((request_id, routing_key))
        if self.fail is not None and not self.fail_after_first:
            raise self.fail
        stream = self.inner.generate(prompt_ids, params, request_id, routing_key)
        async with aclosing(stream):
            async for out in stream:
                yield out
                if self.fail is not None:
                    raise self.fail

    async def ready(self) -> bool:
        return self.is_ready

    async def stats(self) -> list[dict]:
        return await self.inner.stats()

    def reset(self) -> None:
        self.calls.clear()
        self.fail, self.fail_after_first, self.is_ready = None, False, True


@pytest.fixture(scope="session")
def engine(tiny_llama_dir) -> LLMEngine:
    """The engine the server runs (inspect its block manager; never step it from a test)."""
    return LLMEngine(tiny_config(tiny_llama_dir))


@pytest.fixture(scope="session")
def ref_engine(tiny_llama_dir) -> LLMEngine:
    """A second engine on the same model: the offline reference."""
    return LLMEngine(tiny_config(tiny_llama_dir))


@pytest.fixture(scope="session")
def _probe(engine) -> ProbeBackend:
    return ProbeBackend(local_backend(AsyncLLMEngine(engine), MODEL))


@pytest.fixture
def probe(_probe) -> Iterator[ProbeBackend]:
    """The server's backend; whatever a test switches on is switched off after it."""
    _probe.reset()
    yield _probe
    _probe.reset()


@pytest.fixture(scope="session")
def server(_probe) -> Iterator[ServerThread]:
    app = build_app(_probe, api_keys=["another-key", API_KEY], max_body_bytes=MAX_BODY)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as client:
        yield client


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


# --- the trainer protocols (build_app(trainer_api=True)) -------------------------------------


@pytest.fixture(scope="session")
def trainer_engine(tiny_llama_dir) -> LLMEngine:
    """The trainer server's own engine: its pauses and version bumps reach no other server."""
    return LLMEngine(tiny_config(tiny_llama_dir))


@pytest.fixture(scope="session")
def trainer_backend(trainer_engine) -> Backend:
    return local_backend(AsyncLLMEngine(trainer_engine), MODEL)


@pytest.fixture(scope="session")
def trainer_server(trainer_backend) -> Iterator[ServerThread]:
    """As trainers run it: the trainer API on, no keys (a private network)."""
    app = build_app(trainer_backend, trainer_api=True, max_body_bytes=MAX_BODY)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture
def trainer(trainer_server, trainer_engine) -> Iterator[httpx.Client]:
    """A client of the trainer server; whatever a test leaves paused is resumed after it."""
    with httpx.Client(base_url=trainer_server.url, timeout=60) as client:
        yield client
        client.post("/resume")
        deadline = time.monotonic() + 10
        while trainer_engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.02)


# --- the admin routes (tests/e2e/test_admin*.py) ------------------------------------------------
# NOTE: module-scoped, so each module's updates reach no other module's server


@pytest.fixture(scope="module")
def admin_engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(tiny_config(tiny_llama_dir))


@pytest.fixture(scope="module")
def admin_server(admin_engine) -> Iterator[ServerThread]:
    backend = local_backend(AsyncLLMEngine(admin_engine), MODEL)
    app = build_app(backend, api_keys=[USER_KEY], admin_api_key=ADMIN_KEY, max_body_bytes=MAX_BODY)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture
def user(admin_server) -> Iterator[httpx.Client]:
    with keyed_client(admin_server, USER_KEY) as client:
        yield client


@pytest.fixture
def admin(admin_server) -> Iterator[httpx.Client]:
    with keyed_client(admin_server, ADMIN_KEY) as client:
        yield client
        client.post("/admin/resume")  # whatever a test left paused


@pytest.fixture(scope="module")
def weights(tiny_llama_dir, tmp_path_factory) -> dict[str, tuple[str, list]]:
    """{"v0": the checkpoint, "v1": v0 plus seeded noise}: (model dir, named HF tensors)."""
    from tests.hf_reference import hf_model, perturbed_model

    v0 = [(n, p.detach().clone()) for n, p in hf_model(tiny_llama_dir).named_parameters()]
    v1 = perturbed_model(tiny_llama_dir, str(tmp_path_factory.mktemp("tiny_llama_admin_v1")), 23)
    return {"v0": (tiny_llama_dir, v0), "v1": v1}
