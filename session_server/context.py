"""Per-request facts every route needs: the backend, the model check, the routing key, ids."""

from __future__ import annotations

import uuid

from fastapi import Request
from raylane.session_server.backend import EngineBackend, ModelInfo
from raylane.session_server.errors import APIError, bad_request

ROUTING_HEADERS = ("x-routing-key", "x-session-id")


def backend_of(request: Request) -> EngineBackend:
    return request.app.state.backend


def check_model(name: str | None, info: ModelInfo) -> None:
    """`None` means the served model; any other name is a 404 as OpenAI answers it."""
    if name is not None and name != info.name:
        raise APIError(
            404,
            f"The model {name!r} does not exist; this server serves {info.name!r}",
            param="model",
            code="model_not_found",
        )


def check_n(request: Request, n: int) -> None:
    """`n` within the server's limit (`build_app(max_n=)`, `raylane serve --max-n`)."""
    limit = request.app.state.max_n
    if n > limit:
        raise bad_request(f"n: {n} samples asked, this server allows at most {limit}", "n")


def timeout_of(request: Request, from_body: float | None) -> float | None:
    """The request's deadline in seconds: its own `timeout`, else the server's default."""
    return from_body if from_body is not None else request.app.state.request_timeout_s


def routing_key(request: Request, from_body: str | None) -> str | None:
    """Requests with the same key stick to one replica: a header wins over the body's field."""
    for header in ROUTING_HEADERS:
        value = request.headers.get(header)
        if value:
            return value
    return from_body or None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
