"""Every error the HTTP surface answers, as the OpenAI error body with the right status.

`{"error": {"message", "type", "param", "code"}}` — for bad JSON and wrong types (400, never
FastAPI's 422), unknown models (404), engine `ValueError`s (400 naming the field), busy replicas
(429 with Retry-After), failed replicas (503), engines paused with a full queue (503 with
Retry-After), the Router's session and control errors (their own status and type) and anything
unexpected (500, logged).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from raylane.actors.engine.errors import EnginePaused, RequestFailed
from raylane.router.errors import RouterError
from raylane.session_server.lora_errors import lora_http_error
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
}
# "SamplingParams.top_p must ...", "prompt: 9 tokens ...", "logprobs: 30 is more than ..."
# pydantic names the union member that failed ("str", "list[int]", "function-after[...]")
_TYPE_TAG = re.compile(r"^(str|int|float|bool|dict|list|none|.*\[.*\])$")
_PARAM = re.compile(r"^(?:SamplingParams\.)?([a-z_.]+)(?::| must| is)")


class APIError(Exception):
    """An error the client caused or can act on; rendered as the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,  # int: vLLM's bodies carry the status
        headers: dict[str, str] | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.type = type  # None: the status's usual type


class ClientGone(Exception):
    """The client disconnected before its response was ready; nobody reads the answer."""


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    code: str | int | None = None,
    type: str | None = None,
) -> dict:
    return {
        "error": {
            "message": message,
            "type": type or _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | int | None = None,
    headers: dict[str, str] | None = None,
    type: str | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, param, code, type), status_code=status, headers=headers
    )


def from_exception(exc: BaseException, param_names: dict[str, str] | None = None) -> APIError:
    """Map an exception raised while serving into the `APIError` the client should see.

    `param_names` renames engine field names into the route's own (e.g. SGLang's names).
    """
    if isinstance(exc, APIError):
        return exc
    lora = lora_http_error(exc)  # an adapter's error: vLLM's status and body
    if lora is not None:
        return APIError(lora.status, lora.message, param=lora.param, code=lora.code, type=lora.type)
    if isinstance(exc, ValueError):
        return _value_error(str(exc), param_names or {})
    if isinstance(exc, EnginePaused):
        return APIError(503, str(exc), code="engine_paused", headers={"Retry-After": "1"})
    if isinstance(exc, RequestFailed):  # a step it was in raised; the engine serves on
        return APIError(500, str(exc), code="request_failed")
    if isinstance(exc, RouterError):
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return APIError(
            exc.status,
            str(exc),
            param=exc.param,
            code=exc.code,
            headers=headers,
            type=exc.error_type,
        )
    log.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def _value_error(message: str, param_names: dict[str, str]) -> APIError:
    match = _PARAM.match(message)
    if match is None:
        return bad_request(message)
    param = param_names.get(match.group(1), match.group(1))
    if param != match.group(1):  # say it in the client's words
        message = param + message[match.end(1) :]
    elif message.startswith("SamplingParams."):
        message = message[len("SamplingParams.") :]
    return bad_request(message, param)


def api_error_response(err: APIError) -> JSONResponse:
    return error_response(
        err.status, err.message, param=err.param, code=err.code, headers=err.headers, type=err.type
    )


def install_error_handlers(app: FastAPI) -> None:
    """Route every error FastAPI or a route raises through the OpenAI error body."""

    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation(exc.errors())
        return error_response(400, message, param=param, code="invalid_request")

    async def on_http(_: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(
            exc.status_code, str(exc.detail), code=code, headers=getattr(exc, "headers", None)
        )

    async def on_any(request: Request, exc: Exception) -> JSONResponse:
        # a route may name the fields engine errors refer to in the client's words
        names = getattr(request.state, "param_names", None)
        return api_error_response(from_exception(exc, names))

    async def on_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"

    # Starlette's stub types every handler as taking any Exception; it calls each one only with
    # the class it is registered for
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(ClientGone, on_gone)  # type: ignore[arg-type]
    # NOTE: the errors a request meets in normal operation are named here: Starlette answers
    # an unnamed one (the Exception entry) from its outermost middleware and then re-raises
    # it, and uvicorn closes a connection whose app raised, resetting a keep-alive client's
    # next request on it
    for kind in (APIError, ValueError, EnginePaused, RequestFailed, RouterError, Exception):
        app.add_exception_handler(kind, on_any)


def describe_validation(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A readable message and the top-level field for pydantic / FastAPI validation errors."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _TYPE_TAG.match(str(p))]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    if not loc:
        return f"the request body is invalid: {first.get('msg')}", None
    # a union field fails once per accepted form: say them all
    same = [e for e in errors if _field(e) == loc[0]]
    reasons = "; or ".join(dict.fromkeys(e.get("msg", "") for e in same))
    more = len(errors) - len(same)
    extra = f" (and {more} more errors)" if more else ""
    return f"{'.'.join(loc)}: {reasons}{extra}", loc[0]


def _field(error: dict) -> str | None:
    loc = [p for p in error.get("loc", ()) if p != "body"]
    return str(loc[0]) if loc else None
