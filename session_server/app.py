"""`build_app`: the stateless FastAPI ingress over an `EngineBackend`."""

from __future__ import annotations

import time

from fastapi import FastAPI

from session_server import metrics, native_routes, openai_routes, session_routes
from session_server.auth import ApiKeyAuth
from session_server.backend import EngineBackend
from session_server.body_limit import BodyLimit
from session_server.errors import install_error_handlers


def build_app(backend: EngineBackend, *, api_keys: list[str] | None = None,
              max_body_bytes: int = 8 << 20) -> FastAPI:
    """The HTTP surface: OpenAI routes, SGLang-style /generate, /tokenize, /detokenize,
    multi-turn /sessions, /health and /metrics, with the OpenAI error body for every error.

    Holds no state beyond the request, so any number of copies can serve one cluster.
    `api_keys` turns on bearer-key auth for every route but /health; bodies over
    `max_body_bytes` get 413.
    """
    if max_body_bytes < 1:
        raise ValueError("max_body_bytes must be >= 1")
    app = FastAPI(title="raylane", summary="OpenAI-compatible and native LLM serving")
    app.state.backend = backend
    app.state.created = int(time.time())
    install_error_handlers(app)
    for module in (openai_routes, native_routes, session_routes, metrics):
        app.include_router(module.router)
    # added last = runs first: auth before the body is read
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_keys:
        app.add_middleware(ApiKeyAuth, api_keys=list(api_keys))
    return app
