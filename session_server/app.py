"""`build_app`: the stateless FastAPI ingress over an `EngineBackend`."""

from __future__ import annotations

import time
from collections.abc import Sequence

from fastapi import FastAPI
from raylane.session_server import (
    admin_routes,
    lora_routes,
    lora_update_routes,
    metrics,
    native_routes,
    openai_routes,
    session_routes,
)
from raylane.session_server.auth import ADMIN_PREFIX, AdminAuth, ApiKeyAuth
from raylane.session_server.backend import EngineBackend
from raylane.session_server.body_limit import BodyLimit
from raylane.session_server.errors import install_error_handlers
from raylane.session_server.header_limit import HeaderLimit
from raylane.session_server.metrics import MetricsSource
from raylane.session_server.openapi import ERRORS
from raylane.session_server.schemas import MAX_N
from raylane.session_server.tool_calls import PARSERS, detect_parser
from raylane.session_server.trainer_api import mount as mount_trainer_api


def build_app(
    backend: EngineBackend,
    *,
    api_keys: list[str] | None = None,
    max_body_bytes: int = 8 << 20,
    admin_api_key: str | None = None,
    max_bucket_bytes: int = 1 << 30,
    request_timeout_s: float | None = None,
    max_n: int = 128,
    tool_call_parser: str | None = None,
    metrics_sources: Sequence[MetricsSource] = (),
    trainer_api: bool = False,
) -> FastAPI:
    """The HTTP surface: OpenAI routes, SGLang-style /generate, /tokenize, /detokenize,
    multi-turn /sessions, /health and /metrics, with the OpenAI error body for every error.
    Holds no state beyond the request, so any number of copies can serve one cluster.

    `api_keys`: bearer-key auth on every route but /health. `admin_api_key`: the admin routes
    (/admin/..., the RL control plane; weight buckets up to `max_bucket_bytes`), only it opens.
    `trainer_api`: vLLM's RL API, SGLang's native API and TRL's routes too (`trainer_api`
    package), the admin key guarding their state-changing routes when there is one.
    `request_timeout_s`: a generation's default deadline (a body's `timeout` wins; past it, the
    partial output, finish reason "abort"). `max_n`: the most samples a request may ask for.
    `tool_call_parser`: "hermes" or "llama3" (None: the chat template's). `metrics_sources`:
    more Prometheus text for /metrics, left out when one fails or is slow. Bodies over
    `max_body_bytes` get 413; more than 100 headers or 64 KiB of them get 431."""
    _check_limits(max_body_bytes, max_bucket_bytes, request_timeout_s, max_n)
    _check_keys_and_parser(api_keys, admin_api_key, tool_call_parser)
    app = FastAPI(title="raylane", summary="OpenAI-compatible and native LLM serving")
    app.state.backend = backend
    app.state.created = int(time.time())
    app.state.request_timeout_s = request_timeout_s
    app.state.max_n = max_n
    app.state.metrics_sources = tuple(metrics_sources)
    app.state.tool_call_parser = tool_call_parser or _parser_of(backend)
    app.state.trainer_api = trainer_api  # /generate answers SGLang's exact shape
    install_error_handlers(app)
    guarded = _mount_routes(app, backend, admin_api_key is not None, trainer_api)
    _add_limits_and_auth(app, guarded, api_keys, admin_api_key, max_body_bytes, max_bucket_bytes)
    return app


def _mount_routes(
    app: FastAPI, backend: EngineBackend, admin: bool, trainer_api: bool
) -> frozenset[str]:
    """Every route module the options ask for; the paths the admin key guards outside /admin/
    (the trainer protocols' and the adapters' state-changing routes)."""
    modules = [openai_routes, native_routes, session_routes, metrics]
    lora = backend.info.enable_lora  # the adapter routes (LoRA)
    admins = [admin_routes, *([lora_update_routes] if lora else [])]
    for module in (modules + admins) if admin else modules:
        app.include_router(module.router, responses=ERRORS)  # the OpenAI error body
    guarded = mount_trainer_api(app) if trainer_api else frozenset()
    return guarded | (lora_routes.mount(app) if lora else frozenset())


def _add_limits_and_auth(
    app: FastAPI,
    guarded: frozenset[str],
    api_keys: list[str] | None,
    admin_api_key: str | None,
    max_body_bytes: int,
    max_bucket_bytes: int,
) -> None:
    # added last = runs first: auth before the body is read
    admin = admin_api_key is not None
    app.add_middleware(
        BodyLimit,
        max_bytes=max_body_bytes,
        path_limits=dict.fromkeys(_BUCKET_PATHS, max_bucket_bytes) if admin else {},
    )
    if admin_api_key is not None:
        app.add_middleware(AdminAuth, admin_key=admin_api_key, paths=guarded)
    if api_keys:
        app.add_middleware(
            ApiKeyAuth,
            api_keys=list(api_keys),
            pass_prefixes=(ADMIN_PREFIX,) if admin else (),
            pass_paths=guarded if admin else frozenset(),
        )
    app.add_middleware(HeaderLimit)  # first of all: nothing reads a header flood


def _parser_of(backend: EngineBackend) -> str:
    """The tool-call format the served model's chat template teaches it."""
    return detect_parser(getattr(backend.tokenizer, "chat_template", None))


def _check_keys_and_parser(
    api_keys: list[str] | None, admin_api_key: str | None, tool_call_parser: str | None
) -> None:
    if admin_api_key is not None and admin_api_key in (api_keys or []):
        raise ValueError("admin_api_key must differ from every user API key")
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(
            f"tool_call_parser must be one of {list(PARSERS)}, got {tool_call_parser!r}"
        )


_BUCKET_PATHS = (admin_routes.BUCKET_PATH, lora_update_routes.BUCKET_PATH)


def _check_limits(
    max_body_bytes: int, max_bucket_bytes: int, request_timeout_s: float | None, max_n: int
) -> None:
    for name, value in (("max_body_bytes", max_body_bytes), ("max_bucket_bytes", max_bucket_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1")
    if request_timeout_s is not None and not request_timeout_s > 0:
        raise ValueError("request_timeout_s must be > 0 seconds, or None")
    if not 1 <= max_n <= MAX_N:
        raise ValueError(f"max_n must be in [1, {MAX_N}]")
